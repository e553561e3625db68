"""Which node this process runs on, by the name the fleet tools use (pretrain/fleet/: the detector's host, the
excluded nodes of fleet.exclude; the supervisor of one node of several).

    SYNTHFORMER_NODE   the node's name, where the host's own is not the one to use: two "nodes" on one machine (the
                       rehearsal, tests), or a cluster whose host names differ from the scheduler's node names
    otherwise          socket.gethostname()
"""
from __future__ import annotations

import os
import socket

NODE = "SYNTHFORMER_NODE"


def node_name() -> str:
    return os.environ.get(NODE) or socket.gethostname()
