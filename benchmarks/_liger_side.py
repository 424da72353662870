"""The peer half of bench_kernels.py, and the measuring harness both halves share.

Run by bench_kernels.py with the peer environment's interpreter (.venv-liger/bin/python, made by
`make liger-env`): it must not import megatron_dapo. Two peers:

    liger  Liger-Kernel's LigerFusedLinearGRPOLoss (loss_type="dapo", beta 0, no reference model,
           its default chunk_size=1 response per chunk and compiled=True loss math): loss and the
           gradients of hidden [B, T, H] and weight [V, H] from hidden states and the output
           weight, never the full logits.
    verl   verl 0.9.1's eager `compute_policy_loss_vanilla` (token-mean, clip 0.2 / 0.28, c = 3)
           and its gradient with respect to log_prob [B, T].

Inputs arrive in one torch.save file written by the main script (identical seeded tensors for both
sides); outputs are the loss and gradients (torch.save to --out) and one JSON line on stdout.

Measuring (`measure`, also imported by bench_kernels.py for our side), in two fresh processes per
side, each after one warm-up step (Liger's torch.compile, first touch of the BLAS and OpenMP code
pages): with --memory, the peak memory of one step; without, the median and min time of --repeats
steps. Peak memory is the growth of the resident set during that step: VmHWM (peak RSS) after
resetting it through /proc/self/clear_refs, minus the RSS just before the step, in a process that
holds nothing else but the inputs (the warm-up's gradients are dropped first). It counts everything
the step allocates and frees, the returned gradients included. tracemalloc would miss torch's
allocations and ru_maxrss cannot be reset. The memory process runs with MALLOC_MMAP_THRESHOLD_=65536
so that glibc maps every block of 64 KiB or more and returns it on free: otherwise memory freed by
the warm-up step would stay in the heap and hide part of the next step's peak. The timing process
keeps glibc's defaults, since mapping every block anew costs page faults that a normal run reuses.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import resource

    return pages * resource.getpagesize()


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
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(step, clear, repeats: int, memory: bool) -> dict:
    """After a warm-up step: the peak RSS growth [MiB] of one step (`memory`), or the median / min /
    all wall times [s] of `repeats` steps with the median CPU time of the process (every thread) and
    CPU time / wall time (how many cores the step kept busy); with the loss. `step()` runs forward + backward and returns the
    loss (a 0-dim tensor), `clear()` drops the gradients it left (outside the measured regions)."""
    loss = step()
    if memory:
        clear()
        gc.collect()
        before = rss_bytes()
        if not _reset_peak_rss():
            print("warning: cannot reset the peak RSS; the figure includes start-up", file=sys.stderr)
        loss = step()
        return {"loss": float(loss), "peak_mib": round((_peak_rss_bytes() - before) / 2**20, 1)}
    times, cpu = [], []
    for _ in range(repeats):
        clear()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"loss": float(loss), "time_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
            "times_s": [round(t, 4) for t in times], "cpu_s": round(statistics.median(cpu), 4),
            "cpu_per_wall": round(sum(cpu) / sum(times), 2)}


def liger_step(inputs: dict, compiled: bool):
    import torch
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    hidden = inputs["hidden"].view(*inputs["labels"].shape, -1).requires_grad_()  # [B, T, H]
    weight = inputs["weight"].requires_grad_()
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo", epsilon_low=0.2,
                                       epsilon_high=0.28, chunk_size=1, compiled=compiled, temperature=1.0)

    def clear():
        hidden.grad = weight.grad = None

    def step():
        loss, _metrics = loss_fn(hidden, weight, inputs["labels"], inputs["mask"], inputs["advantages"],
                                 old_per_token_logps=inputs["old_log_prob"])
        loss.backward()
        return loss.detach()

    def grads():
        return {"grad_hidden": hidden.grad.reshape(-1, hidden.shape[-1]), "grad_weight": weight.grad}

    return step, clear, grads, {"liger_kernel": _version("liger-kernel"), "torch": torch.__version__,
                         "compiled": compiled}


class _VerlActorConfig(dict):
    """What verl's compute_policy_loss_vanilla reads from its ActorConfig: attributes and .get()."""

    __getattr__ = dict.__getitem__


def verl_step(inputs: dict):
    import torch
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    config = _VerlActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                              global_batch_info={})
    log_prob = inputs["log_prob"].requires_grad_()

    def clear():
        log_prob.grad = None

    def step():
        loss, _metrics = compute_policy_loss_vanilla(inputs["old_log_prob"], log_prob, inputs["advantages"],
                                                     inputs["mask"], loss_agg_mode="token-mean", config=config)
        loss.backward()
        return loss.detach()

    return step, clear, (lambda: {"grad_log_prob": log_prob.grad}), {"verl": _version("verl"), "torch": torch.__version__}


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=["liger", "verl"], required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", default="", help="where to save the gradients (none if empty)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="liger: run its loss math eagerly")
    ap.add_argument("--memory", action="store_true", help="measure the peak memory, not the time")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    inputs = torch.load(args.inputs)
    if args.case == "liger":
        step, clear, grads, versions = liger_step(inputs, compiled=not args.no_compile)
    else:
        step, clear, grads, versions = verl_step(inputs)
    figures = measure(step, clear, args.repeats, args.memory)
    if args.out:
        torch.save(grads(), args.out)
    print(json.dumps(dict(figures, versions=versions, threads=torch.get_num_threads())))


if __name__ == "__main__":
    main()
