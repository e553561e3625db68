"""`python -m pretrain.config CONFIG [overrides] [--print] [--deepspeed] [--world-size N]`: a thin entry point kept
for launch/pretrain.sh and the README; the command itself is pretrain/prelaunch.py's `main`."""
import sys

from pretrain.prelaunch import main

sys.exit(main())
