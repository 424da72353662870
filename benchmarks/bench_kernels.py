"""Peak memory and time of the fused kernels: against materialised logits, Liger-Kernel and verl.

Figures, never pass/fail. Each variant runs in a fresh subprocess (its own allocator state, its
own peak) with 2 threads (torch.set_num_threads; --threads to change). Peak memory and timing are
`benchmarks/_liger_side.py:measure`, each in its own process: the resident-set growth during one
step after a warm-up step, and the median (and min) of --repeats steps after a warm-up step; see
that file for why this method.

    materialised  N=2048, H=64, V=32000 and N=256, H=64, V=152064 (Qwen's vocabulary), fp32:
                  fused_logprob_entropy_reference (full fp32 logits, autograd) against
                  fused_logprob_entropy (the chunked torch path), log-probs + entropy fwd+bwd.
    liger         B=8 x T=1024 (N=8192 tokens, all valid), H=1024, V=32000, fp32: the DAPO
                  clipped loss from hidden states and the output weight, forward + backward
                  (gradients of hidden and weight). Ours: fused_logprob_stats (log-probs only,
                  as Liger) then fused_clipped_token_loss, token-mean: the actor's path. Liger:
                  LigerFusedLinearGRPOLoss(loss_type="dapo", beta=0) in .venv-liger. Same seeded
                  inputs; old log-probs are the current ones plus N(0, 0.15) noise, so about 12%
                  of tokens clip and none reaches the dual clip (c = 3, which Liger lacks) or the
                  +-20 log-ratio clamp: both sides compute the same loss, and the script prints
                  the loss and gradient differences.
    verl          B=256 x T=4096 (1M positions, ~70% valid), fp32: the clipped token loss alone,
                  forward + backward w.r.t. log_prob. Ours: fused_clipped_token_loss (chunked
                  torch path); verl 0.9.1's eager compute_policy_loss_vanilla in .venv-liger.
    cuda          (only with CUDA) N=8192, H=5120, V=152064, bf16: eager logits vs the triton path.

Goals from issue #17 (reported, not enforced): materialised peak ratio <= 0.25; vs Liger time <= 1x
and peak <= 0.8x; vs verl time and peak <= 0.5x.

Usage: python benchmarks/bench_kernels.py [--sections materialised,liger,verl] [--repeats 3]
       [--peer-python .venv-liger/bin/python]   (`make liger-env` creates .venv-liger)
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import _liger_side as harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATERIALISED_CASES = [(2048, 64, 32000), (256, 64, 152064)]
LIGER_CASE = dict(B=8, T=1024, H=1024, V=32000)
VERL_CASE = dict(B=256, T=4096)
CUDA_CASE = (8192, 5120, 152064)
GOALS = {"materialised_peak_ratio_max": 0.25, "liger_time_ratio_max": 1.0, "liger_peak_ratio_max": 0.8,
         "verl_time_ratio_max": 0.5, "verl_peak_ratio_max": 0.5}
# memory children map blocks >= 64 KiB and return them on free: see _liger_side.py
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


# ---------------------------------------------------------------------------------------------
# inputs (main process, seeded) and our side of each comparison (child processes)
# ---------------------------------------------------------------------------------------------


def make_liger_inputs(path: str) -> None:
    import torch

    from megatron_dapo.kernels import fused_logprob_stats

    c = LIGER_CASE
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(c["B"] * c["T"], c["H"], generator=gen)
    weight = torch.randn(c["V"], c["H"], generator=gen) * (2.0 / c["H"] ** 0.5)  # logits of std ~2
    labels = torch.randint(0, c["V"], (c["B"], c["T"]), generator=gen)
    with torch.no_grad():
        logprobs, _, _ = fused_logprob_stats(hidden, weight, labels.reshape(-1), compute_entropy=False)
    old = logprobs.view(c["B"], c["T"]) + 0.15 * torch.randn(c["B"], c["T"], generator=gen)
    torch.save({"hidden": hidden, "weight": weight, "labels": labels, "old_log_prob": old,
                "advantages": torch.randn(c["B"], generator=gen),  # one per response, as in GRPO
                "mask": torch.ones(c["B"], c["T"], dtype=torch.bool)}, path)


def make_verl_inputs(path: str) -> None:
    import torch

    b, t = VERL_CASE["B"], VERL_CASE["T"]
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(b, t, generator=gen) * 3
    log_prob = old + 0.3 * torch.randn(b, t, generator=gen)
    advantages = torch.randn(b, 1, generator=gen) + 0.3 * torch.randn(b, t, generator=gen)
    lengths = ((0.4 + 0.6 * torch.rand(b, generator=gen)) * t).long()  # 70% valid on average
    mask = torch.arange(t)[None, :] < lengths[:, None]
    torch.save({"log_prob": log_prob, "old_log_prob": old, "advantages": advantages, "mask": mask}, path)


def ours_liger_step(inputs: dict):
    import torch

    from megatron_dapo.kernels import fused_clipped_token_loss, fused_logprob_stats

    b, t = inputs["labels"].shape
    hidden, weight = inputs["hidden"].requires_grad_(), inputs["weight"].requires_grad_()
    labels = inputs["labels"].reshape(-1)
    advantages = inputs["advantages"][:, None].expand(b, t)

    def clear():
        hidden.grad = weight.grad = None

    def step():
        logprobs, _, _ = fused_logprob_stats(hidden, weight, labels, compute_entropy=False, backend="torch")
        loss, _ = fused_clipped_token_loss(logprobs.view(b, t), inputs["old_log_prob"], advantages, inputs["mask"],
                                           clip_ratio_low=0.2, clip_ratio_high=0.28, backend="torch")
        loss.backward()
        return loss.detach()

    from megatron_dapo.kernels.logprob_entropy import torch_chunk_tokens

    return step, clear, lambda: {"grad_hidden": hidden.grad, "grad_weight": weight.grad}, {
        "torch": torch.__version__, "chunk_tokens": torch_chunk_tokens(weight.shape[0], None, None)}


def ours_verl_step(inputs: dict):
    import torch

    from megatron_dapo.kernels import fused_clipped_token_loss

    log_prob = inputs["log_prob"].requires_grad_()

    def clear():
        log_prob.grad = None

    def step():
        loss, _ = fused_clipped_token_loss(log_prob, inputs["old_log_prob"], inputs["advantages"], inputs["mask"],
                                           clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                                           backend="torch")
        loss.backward()
        return loss.detach()

    return step, clear, lambda: {"grad_log_prob": log_prob.grad}, {"torch": torch.__version__}


def materialised_step(variant: str, n: int, h: int, v: int, device: str):
    """A log-prob + entropy fwd+bwd closure over fresh inputs (sum of logprobs and entropies)."""
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
        entropy = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return log_p.gather(-1, labels[:, None]).squeeze(-1), entropy

    forward = {
        "materialised": lambda: fused_logprob_entropy_reference(hidden, weight, labels),
        "chunked": lambda: fused_logprob_entropy(hidden, weight, labels, backend="torch"),
        "triton": lambda: fused_logprob_entropy(hidden, weight, labels, backend="triton"),
        "eager": eager,
    }[variant]

    def clear():
        hidden.grad = weight.grad = None

    def step():
        logprobs, entropy = forward()
        objective = logprobs.sum() + entropy.sum()
        objective.backward()
        return objective.detach()

    return step, clear


def _cuda_measure(step, clear, repeats: int) -> dict:
    import torch

    step()  # compile / autotune / cuBLAS workspaces before measuring
    clear()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    times = []
    for _ in range(repeats):
        clear()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return {"peak_mib": round(peak / 2**20, 1), "time_s": round(sorted(times)[len(times) // 2], 4)}


def child_main(args) -> None:
    """Our side of one measurement (the peer side is _liger_side.py in the peer's venv)."""
    import torch

    torch.set_num_threads(args.threads)
    case = args.child
    if case in ("ours_liger", "ours_verl"):
        inputs = torch.load(args.inputs)
        step, clear, grads, versions = (ours_liger_step if case == "ours_liger" else ours_verl_step)(inputs)
        figures = harness.measure(step, clear, args.repeats, args.memory)
        if args.out:
            torch.save(grads(), args.out)
    else:  # materialised / chunked / eager / triton, "VARIANT:N:H:V:DEVICE"
        variant, n, h, v, device = case.split(":")
        step, clear = materialised_step(variant, int(n), int(h), int(v), device)
        figures = (_cuda_measure(step, clear, args.repeats) if device == "cuda"
                   else harness.measure(step, clear, args.repeats, args.memory))
        versions = {"torch": torch.__version__}
    print(json.dumps(dict(figures, versions=versions, threads=torch.get_num_threads())))


# ---------------------------------------------------------------------------------------------
# main process: run the children, compare
# ---------------------------------------------------------------------------------------------


def _run(cmd: list[str], timeout_s: float, memory: bool) -> dict | str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    env.update(MEMORY_ENV if memory else {})
    try:
        proc = subprocess.run(cmd + (["--memory"] if memory else []), capture_output=True, text=True, env=env,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"failed: timed out after {timeout_s:.0f} s"
    if proc.returncode != 0:
        return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _both(cmd: list[str], timeout_s: float, out: str) -> dict | str:
    """The memory run (which saves the gradients to `out`) and the timing run, merged."""
    mem = _run(cmd + ["--out", out], timeout_s, memory=True)
    if not isinstance(mem, dict):
        return mem
    timing = _run(cmd + ["--out", ""], timeout_s, memory=False)
    if not isinstance(timing, dict):
        return timing
    return dict(timing, peak_mib=mem["peak_mib"], loss=mem["loss"])


def _ours(case: str, args, inputs: str = "", out: str = "", cuda: bool = False) -> dict | str:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--inputs", inputs,
           "--repeats", str(args.repeats), "--threads", str(args.threads)]
    return _run(cmd + ["--out", out], args.timeout, memory=False) if cuda else _both(cmd, args.timeout, out)


def _peer(case: str, args, inputs: str, out: str, repeats: int) -> dict | str:
    if not os.access(args.peer_python, os.X_OK):
        return f"not run: {args.peer_python} missing (make liger-env)"
    cmd = [args.peer_python, os.path.join(REPO, "benchmarks", "_liger_side.py"), "--case", case, "--inputs", inputs,
           "--repeats", str(repeats), "--threads", str(args.threads)]
    return _both(cmd + (["--no-compile"] if args.liger_no_compile and case == "liger" else []), args.timeout, out)


def _ratios(ours, peer) -> dict:
    if not (isinstance(ours, dict) and isinstance(peer, dict)):
        return {}
    return {"time_ratio": round(ours["time_s"] / peer["time_s"], 3),
            "min_time_ratio": round(ours["min_s"] / peer["min_s"], 3),
            "peak_ratio": round(ours["peak_mib"] / max(peer["peak_mib"], 1e-9), 3),
            "loss_abs_diff": abs(ours["loss"] - peer["loss"])}


def _grad_diffs(ours_path: str, peer_path: str) -> dict:
    """Max |ours - peer| and the normwise relative difference of each gradient both sides saved."""
    import torch

    if not (os.path.exists(ours_path) and os.path.exists(peer_path)):
        return {}
    a, b = torch.load(ours_path), torch.load(peer_path)
    out = {}
    for name in sorted(set(a) & set(b)):
        x, y = a[name].float(), b[name].float().reshape(a[name].shape)
        out[name] = {"max_abs_diff": float((x - y).abs().max()),
                     "rel_norm_diff": float((x - y).norm() / y.norm().clamp(min=1e-30))}
    return out


def _compare(name: str, make_inputs, ours_case: str, peer_case: str, args, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        inputs = os.path.join(tmp, "inputs.pt")
        make_inputs(inputs)
        ours = _ours(ours_case, argparse.Namespace(**{**vars(args), "repeats": repeats}), inputs,
                     os.path.join(tmp, "ours.pt"))
        peer = _peer(peer_case, args, inputs, os.path.join(tmp, "peer.pt"), repeats)
        result = {"ours": ours, peer_case: peer, **_ratios(ours, peer),
                  "grads": _grad_diffs(os.path.join(tmp, "ours.pt"), os.path.join(tmp, "peer.pt"))}
    t, p = result.get("time_ratio"), result.get("peak_ratio")
    print(f"{name:6s} ours {ours}\n       {peer_case} {peer}\n       time ratio (median) {t}  (min) "
          f"{result.get('min_time_ratio')} (goal <= {GOALS[f'{name}_time_ratio_max']})  peak ratio {p} "
          f"(goal <= {GOALS[f'{name}_peak_ratio_max']})  |loss diff| {result.get('loss_abs_diff')}  "
          f"grads {result['grads']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="materialised,liger,verl,cuda")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (liger: --liger-repeats)")
    parser.add_argument("--liger-repeats", type=int, default=2, help="timed steps of the N=8192 case")
    parser.add_argument("--verl-repeats", type=int, default=20, help="timed steps of the clipped-loss case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per child process")
    parser.add_argument("--peer-python", default=os.path.join(REPO, ".venv-liger", "bin", "python"))
    parser.add_argument("--liger-no-compile", action="store_true", help="Liger's loss math without torch.compile")
    parser.add_argument("--liger-shape", help="B,T,H,V instead of 8,1024,1024,32000 (quick checks)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--inputs", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return

    import torch

    torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    if args.liger_shape:
        LIGER_CASE.update(zip("BTHV", map(int, args.liger_shape.split(",")), strict=True))
    figures: dict = {"goals": GOALS, "threads": args.threads, "load_avg": os.getloadavg()}
    if "materialised" in sections:
        figures["materialised"] = {}
        for n, h, v in MATERIALISED_CASES:
            res = {name: _ours(f"{name}:{n}:{h}:{v}:cpu", args) for name in ("materialised", "chunked")}
            a, b = res["materialised"], res["chunked"]
            if isinstance(a, dict) and isinstance(b, dict):
                res["peak_ratio"] = round(b["peak_mib"] / max(a["peak_mib"], 1e-9), 3)
                res["time_ratio"] = round(b["time_s"] / a["time_s"], 3)
            figures["materialised"][f"N{n}_H{h}_V{v}"] = res
            print(f"materialised N{n}_H{h}_V{v}: materialised {a}\n       chunked {b}\n       peak ratio "
                  f"{res.get('peak_ratio')} (goal <= {GOALS['materialised_peak_ratio_max']})  time ratio "
                  f"{res.get('time_ratio')}")
    if "liger" in sections:
        figures["liger"] = dict(case=LIGER_CASE, **_compare("liger", make_liger_inputs, "ours_liger", "liger",
                                                             args, args.liger_repeats))
    if "verl" in sections:
        figures["verl"] = dict(case=VERL_CASE, **_compare("verl", make_verl_inputs, "ours_verl", "verl", args,
                                                           args.verl_repeats))
    if "cuda" in sections and torch.cuda.is_available():
        n, h, v = CUDA_CASE
        res = {name: _ours(f"{name}:{n}:{h}:{v}:cuda", args, cuda=True) for name in ("eager", "triton")}
        figures["cuda"] = {f"N{n}_H{h}_V{v}_bf16": res, "device": torch.cuda.get_device_name()}
        print(f"cuda N{n}_H{h}_V{v} bf16 eager {res['eager']}  triton {res['triton']}")
    elif "cuda" in sections:
        print("cuda: not available here (N=8192, H=5120, V=152064 bf16 needs a GPU run)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
