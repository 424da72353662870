"""Stand-in for `sgl_kernel`, SGLang's compiled kernel package, in the test venv only.

Why: SGLang 0.5.23 on `--device cpu` imports CPU kernels at module level (for example
`from sgl_kernel import copy_all_layer_kv_cache_cpu` in sglang/kernels/ops/kvcache/cache_move.py and
`assign_req_to_token_pool_cpu` in srt/mem_cache/allocation.py). Their CPU build is not on PyPI (it is
compiled from source for Intel AMX hosts), and with `--attention-backend torch_native` on a host without
AMX none of them is called: SGLang takes its torch fallbacks. Every attribute here is a function that
raises when called, so the imports succeed and any real use fails loudly instead of computing wrong.
"""

__version__ = "0.0.0+megatron-dapo-test-stub"


def __getattr__(name: str):
    if name.startswith("__"):  # import machinery probes (__path__, __file__, ...): a normal module's answer
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but the test venv has only a stub of sgl_kernel "
            "(tests/sglang_env/sgl_kernel): this SGLang code path needs the compiled CPU kernels"
        )

    unavailable.__name__ = name
    return unavailable
