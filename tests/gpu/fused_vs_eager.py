"""The fused Triton kernels against the eager PyTorch path: time and peak memory of forward + backward.

    python tests/gpu/fused_vs_eager.py            # CUDA, production shapes (below)
    python tests/gpu/fused_vs_eager.py --tiny     # CPU, tiny shapes, Triton's interpreter (checks the script)

Shape legend: hidden [N, H], weight [V, H], labels [N]; log_prob, old_log_prob, advantages, mask [B, T].

    logprob  log-probs and entropy of the labels from hidden states and the output weight, then the
             gradients of hidden and weight (objective: sum of log-probs + sum of entropies).
             eager: the [N, V] logits materialised, upcast to fp32, log_softmax / softmax (what a plain
             actor does); fused: fused_logprob_entropy(backend="triton"), never the full logits.
             CUDA: N=8192 tokens, H=5120, V=152064 (Qwen2.5-32B's hidden size and vocabulary), bf16.
    loss     DAPO's clipped token loss (clip 0.2 / 0.28, dual clip 3, token-mean) and its gradient
             w.r.t. log_prob. eager: algos.policy_loss.compute_policy_loss_vanilla; fused:
             fused_clipped_token_loss(backend="triton"). CUDA: B=256 x T=4096, fp32, ~70% valid.

Each variant: one warm-up step (Triton compilation), then the median of --repeats steps (host clock
around a synchronised step); peak memory is what one step allocates above what was allocated before it
(torch.cuda.max_memory_allocated on CUDA; on the CPU the growth of the peak resident set, a rough
figure). The fused outputs are compared with the eager ones (max |difference| of the values, normwise
relative difference of each gradient). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CUDA_SHAPES = {"logprob": dict(N=8192, H=5120, V=152064), "loss": dict(B=256, T=4096)}
TINY_SHAPES = {"logprob": dict(N=64, H=32, V=1000), "loss": dict(B=4, T=64)}
LOSS_KWARGS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean")


def _cpu_peak_reset() -> int:
    """Reset the peak resident set (Linux: /proc/self/clear_refs) and return it, now the resident set.

    Both ends of the difference read VmHWM: statm and status are summed from per-thread counters at
    different moments, so mixing them can put the peak a few hundred KiB below the start.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _cpu_peak_bytes()


def _cpu_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(step, clear, *, device, repeats: int) -> dict:
    """Median time [s] of `repeats` steps and the peak memory [MiB] of one, after a warm-up step."""
    import torch

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()
    clear()
    sync()
    if cuda:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = _cpu_peak_reset()
    outputs = step()
    sync()
    # The kernel folds each thread's resident-page count in lazily: on the CPU a step that adds nothing can
    # read a little below its start. Nothing added is 0.
    peak = max(0, (torch.cuda.max_memory_allocated() if cuda else _cpu_peak_bytes()) - before)
    times = []
    for _ in range(repeats):
        clear()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return {"time_s": sorted(times)[len(times) // 2], "min_s": min(times), "peak_mib": peak / 2**20,
            "outputs": outputs}


def _diffs(fused: dict, eager: dict) -> dict:
    """max |fused - eager| of each value, normwise relative difference of each gradient."""
    out = {}
    for name, a in fused.items():
        b = eager[name].float()
        a = a.float()
        if name.startswith("grad_"):
            out[f"{name}_rel_diff"] = float((a - b).norm() / b.norm().clamp(min=1e-30))
        else:
            out[f"{name}_max_abs_diff"] = float((a - b).abs().max())
    return out


def logprob_case(device, dtype, shape: dict, repeats: int) -> dict:
    import torch

    from megatron_dapo.kernels import fused_logprob_entropy

    n, h, v = shape["N"], shape["H"], shape["V"]
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, generator=gen, device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, device=device, dtype=dtype) * 2 * h**-0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen, device=device)

    def eager():
        logits = (hidden @ weight.t()).float()  # [N, V]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        entropy = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return logprobs, entropy

    def fused():
        return fused_logprob_entropy(hidden, weight, labels, backend="triton")

    def clear():
        hidden.grad = weight.grad = None

    def stepper(forward):
        def step():
            logprobs, entropy = forward()
            (logprobs.sum() + entropy.sum()).backward()
            return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "grad_hidden": hidden.grad,
                    "grad_weight": weight.grad}
        return step

    res = {name: measure(stepper(fwd), clear, device=device, repeats=repeats)
           for name, fwd in (("eager", eager), ("fused", fused))}
    return _summary(res, shape, dtype)


def loss_case(device, shape: dict, repeats: int) -> dict:
    import torch

    from megatron_dapo.algos.policy_loss import compute_policy_loss_vanilla
    from megatron_dapo.kernels import fused_clipped_token_loss

    b, t = shape["B"], shape["T"]
    gen = torch.Generator(device=device).manual_seed(1)
    old = -torch.rand(b, t, generator=gen, device=device) * 3
    log_prob = (old + 0.3 * torch.randn(b, t, generator=gen, device=device)).requires_grad_()
    advantages = torch.randn(b, 1, generator=gen, device=device) + 0.3 * torch.randn(b, t, generator=gen,
                                                                                       device=device)
    lengths = ((0.4 + 0.6 * torch.rand(b, generator=gen, device=device)) * t).long()
    mask = torch.arange(t, device=device)[None, :] < lengths[:, None]  # ~70% valid

    def clear():
        log_prob.grad = None

    def stepper(fn, **extra):
        def step():
            loss, _ = fn(old, log_prob, advantages, mask, **LOSS_KWARGS, **extra)
            loss.backward()
            return {"loss": loss.detach(), "grad_log_prob": log_prob.grad}
        return step

    def fused(old_, lp, adv, m, **kw):
        return fused_clipped_token_loss(lp, old_, adv, m, **kw)

    res = {"eager": measure(stepper(compute_policy_loss_vanilla), clear, device=device, repeats=repeats),
           "fused": measure(stepper(fused, backend="triton"), clear, device=device, repeats=repeats)}
    return _summary(res, shape, torch.float32)


def _summary(res: dict, shape: dict, dtype) -> dict:
    eager, fused = res["eager"], res["fused"]
    out = {"shape": shape, "dtype": str(dtype).removeprefix("torch.")}
    for name, r in res.items():
        out[name] = {k: r[k] for k in ("time_s", "min_s", "peak_mib")}
    out["time_ratio"] = fused["time_s"] / eager["time_s"]
    out["peak_ratio"] = fused["peak_mib"] / eager["peak_mib"] if eager["peak_mib"] > 0 else None
    out.update(_diffs(fused["outputs"], eager["outputs"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU, tiny shapes, TRITON_INTERPRET=1")
    p.add_argument("--repeats", type=int, default=None, help="timed steps (default 10 on CUDA, 3 with --tiny)")
    args = p.parse_args()
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read once, when triton is first imported (below)
    import torch

    from megatron_dapo.kernels import logprob_entropy

    if logprob_entropy.triton is None:
        raise SystemExit(f"triton failed to import: {logprob_entropy.TRITON_IMPORT_ERROR!r}")
    interpreted = logprob_entropy._interpreting()
    if args.tiny:
        device, dtype, shapes, repeats = torch.device("cpu"), torch.float32, TINY_SHAPES, args.repeats or 3
        if not interpreted:
            raise SystemExit("--tiny runs the kernels in Triton's interpreter: TRITON_INTERPRET must be 1")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("fused_vs_eager.py needs CUDA (or --tiny for the CPU check)")
        if interpreted:
            raise SystemExit("TRITON_INTERPRET is set: unset it to measure the compiled kernels")
        device, dtype, shapes, repeats = torch.device("cuda"), torch.bfloat16, CUDA_SHAPES, args.repeats or 10
    figures = {"device": device.type, "triton_interpreted": interpreted, "repeats": repeats,
               "logprob": logprob_case(device, dtype, shapes["logprob"], repeats),
               "loss": loss_case(device, shapes["loss"], repeats)}
    for case in ("logprob", "loss"):
        f = figures[case]
        print(f"{case:8s} {f['shape']} {f['dtype']}: eager {f['eager']['time_s'] * 1e3:.2f} ms "
              f"{f['eager']['peak_mib']:.1f} MiB, fused {f['fused']['time_s'] * 1e3:.2f} ms "
              f"{f['fused']['peak_mib']:.1f} MiB (time x{f['time_ratio']:.2f}, peak x{f['peak_ratio']})",
              file=sys.stderr)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
