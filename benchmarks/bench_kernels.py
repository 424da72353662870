"""Peak memory and time of log-prob + entropy forward+backward: fused paths vs materialised logits.

Figures, never pass/fail. Each variant runs in a fresh subprocess so that one variant's allocator
state cannot hide another's peak.

    CPU   N=2048, H=64, V=32000 and N=256, H=64, V=152064 (Qwen's vocabulary), fp32:
          "materialised" (fused_logprob_entropy_reference: full fp32 logits, autograd) against
          "chunked" (fused_logprob_entropy, backend="torch"). Peak = peak RSS during a fwd+bwd after
          a warm-up one, minus the RSS just before it (Linux: VmHWM after resetting it through
          /proc/self/clear_refs). It includes the gradients both variants return.
    CUDA  N=8192, H=5120, V=152064, bf16 (only where CUDA is available): "eager" (bf16 logits,
          .float(), log_softmax, entropy; what verl-style actors do) against "triton" and, when
          importable, Liger-Kernel's LigerFusedLinearCrossEntropyLoss (cross-entropy only, no
          entropy). Peak = torch.cuda.max_memory_allocated during fwd+bwd minus the memory before.
Goals from the issue (reported, not enforced): CPU peak <= 0.25x materialised; CUDA peak <= 0.1x
and fwd+bwd >= 1.5x faster than eager.

Usage: python benchmarks/bench_kernels.py [--repeats 3] [--skip-cuda]
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

CPU_CASES = [(2048, 64, 32000), (256, 64, 152064)]
CUDA_CASE = (8192, 5120, 152064)
GOALS = {"cpu_peak_ratio_max": 0.25, "cuda_peak_ratio_max": 0.1, "cuda_speedup_min": 1.5}


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> bool:
    try:  # "5" resets VmHWM (the peak RSS) of this process; Linux only
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _make_step(variant: str, n: int, h: int, v: int, device: str):
    """A fwd+bwd closure over fresh inputs; the same objective (sum of logprobs and entropies)."""
    import torch

    from megatron_dapo.kernels import fused_logprob_entropy, fused_logprob_entropy_reference

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, generator=gen, device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, device=device, dtype=dtype) * h**-0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen, device=device)

    def eager():
        logits = (hidden @ weight.t()).float()  # [N, V]
        log_p = torch.log_softmax(logits, dim=-1)
        logprobs = log_p.gather(-1, labels[:, None]).squeeze(-1)
        entropy = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return logprobs, entropy

    def liger():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return -LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, hidden, labels), None

    forward = {
        "materialised": lambda: fused_logprob_entropy_reference(hidden, weight, labels),
        "chunked": lambda: fused_logprob_entropy(hidden, weight, labels, backend="torch"),
        "triton": lambda: fused_logprob_entropy(hidden, weight, labels, backend="triton"),
        "eager": eager,
        "liger": liger,
    }[variant]

    def step():
        hidden.grad = weight.grad = None
        logprobs, entropy = forward()
        objective = logprobs.sum() if entropy is None else logprobs.sum() + entropy.sum()
        objective.backward()

    return step


def run_variant(variant: str, n: int, h: int, v: int, device: str, repeats: int) -> dict:
    """Runs in the child process: peak memory of the second fwd+bwd (after a warm-up), median time
    of the next `repeats`."""
    import torch

    step = _make_step(variant, n, h, v, device)
    if device == "cuda":
        step()  # compile / autotune / cuBLAS workspaces before measuring
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        step()  # first touch of library code pages (MKL, OpenMP) would otherwise count as memory
        before = _rss_bytes()
        if not _reset_peak_rss():  # then the peak since process start: an upper bound
            print("warning: cannot reset the peak RSS; figures include start-up", file=sys.stderr)
        step()
        peak = _peak_rss_bytes() - before
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return {"peak_mib": round(peak / 2**20, 1), "time_s": round(statistics.median(times), 4)}


def _child(variant: str, n: int, h: int, v: int, device: str, repeats: int) -> dict | str:
    cmd = [sys.executable, __file__, "--child", variant, str(n), str(h), str(v), device, str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _compare(results: dict, base: str, other: str) -> dict:
    a, b = results.get(base), results.get(other)
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return {}
    return {f"{other}_peak_ratio": round(b["peak_mib"] / max(a["peak_mib"], 1e-9), 3),
            f"{other}_speedup": round(a["time_s"] / b["time_s"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-cuda", action="store_true")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, n, h, v, device, repeats = args.child
        print(json.dumps(run_variant(variant, int(n), int(h), int(v), device, int(repeats))))
        return

    import torch

    figures: dict = {"goals": GOALS, "threads": torch.get_num_threads(),
                     "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpu": {}, "cuda": None}
    for n, h, v in CPU_CASES:
        key = f"N{n}_H{h}_V{v}"
        results = {name: _child(name, n, h, v, "cpu", args.repeats) for name in ("materialised", "chunked")}
        results.update(_compare(results, "materialised", "chunked"))
        figures["cpu"][key] = results
        print(f"cpu  {key:22s} materialised {results['materialised']}  chunked {results['chunked']}  "
              f"peak ratio {results.get('chunked_peak_ratio')} (goal <= {GOALS['cpu_peak_ratio_max']})  "
              f"speedup {results.get('chunked_speedup')}x")
    if torch.cuda.is_available() and not args.skip_cuda:
        n, h, v = CUDA_CASE
        results = {name: _child(name, n, h, v, "cuda", args.repeats) for name in ("eager", "triton")}
        results["liger"] = (_child("liger", n, h, v, "cuda", args.repeats)
                            if importlib.util.find_spec("liger_kernel") else "not installed")
        results.update(_compare(results, "eager", "triton"))
        results.update(_compare(results, "eager", "liger"))
        figures["cuda"] = {f"N{n}_H{h}_V{v}_bf16": results, "device": torch.cuda.get_device_name()}
        print(f"cuda N{n}_H{h}_V{v} bf16 eager {results['eager']}  triton {results['triton']}  "
              f"liger {results['liger']}  triton peak ratio {results.get('triton_peak_ratio')} "
              f"(goal <= {GOALS['cuda_peak_ratio_max']})  triton speedup {results.get('triton_speedup')}x "
              f"(goal >= {GOALS['cuda_speedup_min']})")
    else:
        print("cuda: not available here (figures for N=8192, H=5120, V=152064 need a GPU run)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
