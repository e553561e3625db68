"""Fleet health: which rank or node makes the whole job slow, named (docs/operations.md "Slow jobs").

    detector.py    pure arithmetic on recorded per-rank phase times: a rank late `fleet.windows` windows in a row
                   is named, compute stragglers told apart from data-wait stragglers
    watch.py       the trainer's side: every rank's phases gathered to rank 0 each window, logged and recorded
                   (<run_dir>/fleet/windows.jsonl, TensorBoard fleet/*)
    preflight.py   the check before launch (`python -m pretrain.fleet CONFIG`, or fleet.preflight: true): a fixed
                   GEMM on every rank, a two-way exchange over every node pair; slow ones named with their figures
    exclusion.py   fleet.exclude: which node leaves, the data-parallel size without it, <run_dir>/fleet/excluded_nodes,
                   the trainer's request to the supervisor (pretrain/supervision/exclude.py acts on it)
"""
from pretrain.fleet.detector import JUDGED, PHASES, Detector, Place, Straggler, places, slowest

__all__ = ["JUDGED", "PHASES", "Detector", "Place", "Straggler", "places", "slowest"]
