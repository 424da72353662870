"""The planner: what a config needs of each GPU, of the hosts and of the weight-sync links, before it runs.

    python -m megatron_dapo.plan --config configs/dapo_qwen2.5_32b.yaml [key=value ...] [--gpu-memory-gb 80]

prints the three plans and exits 1 when the configuration does not fit (2 for an invalid config).

- memory.py   per-GPU memory of the actor, the reference and the rollout engine (MemoryPlan, plan_memory,
              plan_from_config), the verdict (check_fits), the table (format_plan) and the CLI (main);
              its docstring gives every formula.
- params.py   parameters per GPU of a parallel layout (count_shards), shared by memory.py and weights.py.
- host.py     host memory per rank and of rank 0's node on the sync trainer's data path (plan_host).
- weights.py  bytes moved per weight sync, per rank role and transport (plan_weight_sync); import it from
              megatron_dapo.plan.weights.

This package re-exports the names callers import from megatron_dapo.plan.
"""

from megatron_dapo.plan.host import HostPlan, check_host, format_host, plan_host
from megatron_dapo.plan.memory import (
    GIB,
    LM_HEAD_SCRATCH_BYTES,
    LM_HEAD_STATS_BYTES,
    LOGPROB_STATS,
    MemoryPlan,
    check_fits,
    format_plan,
    in_flight_microbatches,
    largest_linear_weight,
    layer_activation_bytes_per_token,
    main,
    plan_from_config,
    plan_memory,
)
from megatron_dapo.plan.params import RankParams, count_shards, layer_params, layers_of_rank

__all__ = [
    "GIB",
    "LM_HEAD_SCRATCH_BYTES",
    "LM_HEAD_STATS_BYTES",
    "LOGPROB_STATS",
    "HostPlan",
    "MemoryPlan",
    "RankParams",
    "check_fits",
    "check_host",
    "count_shards",
    "format_host",
    "format_plan",
    "in_flight_microbatches",
    "largest_linear_weight",
    "layer_activation_bytes_per_token",
    "layer_params",
    "layers_of_rank",
    "main",
    "plan_from_config",
    "plan_host",
    "plan_memory",
]
