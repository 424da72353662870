"""The Triton kernels compile to cubins for sm_80 and sm_90 on a machine without a GPU.

The interpreter tests check the numerics but not that Triton's compiler accepts the kernels (dot
shapes, dtypes, constexpr use); this does, with the launch settings the code uses on CUDA.
Compilation runs in a subprocess because this process has TRITON_INTERPRET=1 (kernels built for
the interpreter cannot be compiled) and needs no GPU: triton ships ptxas.
"""

import os
import subprocess
import sys

_SCRIPT = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_dapo.kernels import clipped_loss as cl, logprob_entropy as le

def compile_for(kernel, types, constexprs, arch, **options):
    names = kernel.arg_names
    signature = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts),
                   target=GPUTarget("cuda", arch, 32), options=options)
    print("compiled", kernel.__name__, arch, sorted(constexprs.items()))

ints = dict.fromkeys(["N", "V", "H", "T", "stride_h", "stride_w", "stride_dz", "vocab_start",
                      "n_splits", "tiles_per_split"], "i32")
floats = dict.fromkeys(["temperature", "ratio_low", "ratio_high", "clip_c"], "fp32")
for arch, dtype, ptr in ((90, torch.bfloat16, "*bf16"), (80, torch.bfloat16, "*bf16"), (90, torch.float32, "*fp32")):
    cfg = le._launch_config(dtype)
    options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
    types = dict(ints, **floats, h_ptr=ptr, w_ptr=ptr, dz_ptr=ptr, labels_ptr="*i64", stats_ptr="*fp32",
                 lse_ptr="*fp32", ez_ptr="*fp32", g_lp_ptr="*fp32", g_ent_ptr="*fp32")
    compile_for(le._lse_entropy_fwd_kernel, types, dict(cfg, COMPUTE_SUM_SQ=True), arch, **options)
    compile_for(le._logits_grad_kernel, types, dict(cfg, HAS_GRAD_ENT=True), arch, **options)
for arch, ptr, mask in ((90, "*bf16", "*u8"), (80, "*fp32", "*fp32")):
    types = dict(ints, **floats, lp_ptr=ptr, old_ptr=ptr, adv_ptr=ptr, isw_ptr=ptr, grad_ptr=ptr, mask_ptr=mask,
                 stats_ptr="*fp32", row_scale_ptr="*fp32")
    for kernel in (cl._clipped_loss_fwd_kernel, cl._clipped_loss_bwd_kernel):
        compile_for(kernel, types, dict(HAS_ISW=True, BLOCK_T=cl._BLOCK_T), arch)
"""


def test_kernels_compile_for_sm80_and_sm90_without_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cache hit would skip the compiler
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("compiled") == 10, proc.stdout
