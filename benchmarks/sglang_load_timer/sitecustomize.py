"""A timer around SGLang's model `load_weights`, for benchmarks/bench_weight_sync.py only.

SGLang 0.5.23 neither logs nor returns the time of one weight update (its only timer,
`_observe_weight_load` in srt/managers/scheduler_components/weight_updater.py:106, feeds the Prometheus gauge
`sglang:weight_load_duration_seconds` with the most recent call's wall time, receive included, and only with
--enable-metrics). The benchmark starts its server with this directory on PYTHONPATH: Python imports this
file at start-up in every server process, and when SGLang's Qwen2 / Qwen3-MoE model module is first imported
its class's `load_weights` is wrapped by a timer that writes one line per call to stderr (the server log):

    BENCH_LOAD_WEIGHTS cls=Qwen3MoeForCausalLM tensors=<n or -1 for an iterator> seconds=<wall s>

Nothing else changes: the wrapper calls the original with the same arguments.
"""

import functools
import importlib.abc
import importlib.util
import sys
import time

_TARGETS = {"sglang.srt.models.qwen3_moe": "Qwen3MoeForCausalLM", "sglang.srt.models.qwen2": "Qwen2ForCausalLM"}


def _timed(cls):
    original = cls.load_weights

    @functools.wraps(original)
    def load_weights(self, weights, *args, **kwargs):
        n = len(weights) if isinstance(weights, (list, tuple)) else -1
        t0 = time.perf_counter()
        try:
            return original(self, weights, *args, **kwargs)
        finally:
            print(f"BENCH_LOAD_WEIGHTS cls={cls.__name__} tensors={n} seconds={time.perf_counter() - t0:.6f}",
                  file=sys.stderr, flush=True)

    cls.load_weights = load_weights


class _WrapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        sys.meta_path.remove(self)  # find the real spec without coming back here
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _timed(getattr(module, _TARGETS[name]))

        spec.loader.exec_module = exec_and_wrap
        return spec


sys.meta_path.insert(0, _WrapOnImport())
