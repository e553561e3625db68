"""Fleet health: which rank or node makes the whole job slow, named (docs/operations.md "Slow jobs").

    detector.py    pure arithmetic on recorded per-rank phase times: a rank late `fleet.windows` windows in a row
                   is named, compute stragglers told apart from data-wait stragglers
"""
from pretrain.fleet.detector import JUDGED, PHASES, Detector, Place, Straggler, places, slowest

__all__ = ["JUDGED", "PHASES", "Detector", "Place", "Straggler", "places", "slowest"]
