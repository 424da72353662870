"""Training metrics: pure functions from a step's tensors to `{name: float}`, and the logger.

- `data`: scores, rewards, advantages, returns, lengths, abort ratio (`critic/*`, `response_length/*`, ...)
- `timing`: `StageTimer` / `timer`, `timing_s/*`, `timing_per_token_ms/*`, `perf/*`
- `variance`: gradient-variance proxies (`variance_proxy/*`)
- `moe`: router load balance accumulated over micro-batches (`moe/*`)
- `staleness`: policy-version span and lag of off-policy trajectories (`staleness/*`)
- `spec_decode`: speculative-decoding acceptance (`spec_decode/*`)
- `logger`: `MetricsLogger`, TensorBoard events + console progress

Importing this package is light: the logger imports tensorboard only when a TensorBoard backend
is constructed.
"""

from megatron_dapo.metrics.data import compute_data_metrics, compute_overlong_metrics, reward_extra_metrics
from megatron_dapo.metrics.logger import MetricsLogger
from megatron_dapo.metrics.moe import MoELoadBalanceAccumulator
from megatron_dapo.metrics.spec_decode import compute_spec_decode_metrics
from megatron_dapo.metrics.staleness import compute_staleness_metrics
from megatron_dapo.metrics.timing import (
    StageTimer,
    compute_throughout_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    timer,
)
from megatron_dapo.metrics.variance import compute_variance_proxy_metrics

__all__ = [
    "MetricsLogger",
    "MoELoadBalanceAccumulator",
    "StageTimer",
    "compute_data_metrics",
    "compute_overlong_metrics",
    "reward_extra_metrics",
    "compute_spec_decode_metrics",
    "compute_staleness_metrics",
    "compute_throughout_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "compute_variance_proxy_metrics",
    "timer",
]
