"""python -m megatron_dapo.plan: the planner's command line (megatron_dapo/plan/memory.py, main)."""

import sys

from megatron_dapo.plan.memory import main

sys.exit(main())
