"""The actor at DAPO's production shapes, scaled to a CPU: this actor against the one it replaced.

    python benchmarks/bench_prod_shapes.py [--rows 32] [--max-response 1024] [--old-commit e4774ca]

Two DP ranks over gloo (the script relaunches itself under torchrun), a tiny Megatron model with hidden
256 and V = 32,000, and a batch whose lengths follow the 32B recipe's shape scaled down: responses
lognormal with mean ~5% of the cap and a tail to it, prompts 192-320 tokens (a long prompt keeps the
old path's [rows x max_response_length, V] temporaries within this machine's memory; the old path is
what OOMs at step 1 on the real recipe). Both actors run side by side in each process on the same
initial weights: the new one (workers.policy / workers.actor), and the old one loaded from git at
--old-commit (the materialised-logits path: every row evaluated at max_response_length positions,
row-order update micro-batches, per-rank micro-batch counts).

Figures (max over ranks where it matters):
  lm_head_positions_per_response_token  output-layer positions evaluated / real response tokens
                                        (compute_log_prob and the update; goal <= 1.02)
  padded_per_real_token_update          transformer positions run / real tokens, update micro-batches
                                        (fillers included; goal <= 1.10)
  microbatches_per_rank_update          per mini-batch, the count on each DP rank (goal: equal)
  compute_log_prob_peak_mib             peak resident memory added by one pass (VmHWM reset before it)
  *_tokens_per_s                        real (prompt + response) tokens / wall seconds of one pass

Prints human-readable lines; the last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, PAD = 32000, 0
OLD_MODULES = ("megatron_dapo/workers/logprob.py", "megatron_dapo/workers/microbatch.py",
               "megatron_dapo/workers/actor.py")


def make_batch(rows: int, max_response: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt_length = torch.randint(192, 321, (rows,), generator=g)
    # lognormal with sigma 1: mean = exp(mu + 1/2); ~5% of the cap, clipped to [1, cap] (a tail to it)
    mu = torch.log(torch.tensor(0.05 * max_response)) - 0.5
    response_length = torch.exp(mu + torch.randn(rows, generator=g)).round().clamp(1, max_response).long()
    response_length[0] = max_response  # the tail reaches the cap, as on the real recipe
    prompt_ids = torch.randint(1, VOCAB, (rows, 320), generator=g)
    responses = torch.randint(1, VOCAB, (rows, max_response), generator=g)
    mask = (torch.arange(max_response)[None] < response_length[:, None]).float()
    return prompt_ids, prompt_length, responses, response_length, mask


def load_old_actor(commit: str):
    """The actor modules at `commit`, imported under private names (the rest of the package is shared)."""
    mods = {}
    for path in OLD_MODULES:
        src = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
        for name in mods:
            src = src.replace(f"megatron_dapo.workers.{name}", f"_old_{name}")
        name = os.path.basename(path)[:-3]
        mod = types.ModuleType(f"_old_{name}")
        sys.modules[mod.__name__] = mod
        exec(compile(src, f"{commit}:{path}", "exec"), mod.__dict__)  # noqa: S102 - our own repository's history
        mods[name] = mod
    return mods


def hwm_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def rss_bytes() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak resident set size (Linux >= 4.0)
        f.write("5")


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_dapo.config import load_config
    from megatron_dapo.parallel import destroy_parallel, init_parallel
    from megatron_dapo.workers.batch import PolicyBatch
    from megatron_dapo.workers.build import build_actor

    old = load_old_actor(args.old_commit)
    rows, T = args.rows, args.max_response
    n = 4
    cfg = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"), [
        "trainer.n_gpus_per_node=2", "model.hidden_size=256", "model.ffn_hidden_size=1024",
        "data.max_prompt_length=320", f"data.max_response_length={T}", f"rollout.n={n}",
        f"data.train_batch_size={rows // n}", f"data.gen_batch_size={rows // n}",
        f"actor.ppo_mini_batch_size={rows // n // 2}", f"actor.max_tokens_per_microbatch={T + 320}",
        "actor.use_fused_kernels=false", "reward.overlong_buffer.len=4", "actor.lr_warmup_steps=0"])
    pgs = init_parallel()
    prompt_ids, pl, responses, rl, mask = make_batch(rows, T, seed=args.seed)
    seqs = (prompt_ids, pl, responses, rl)
    real_tokens = int((pl + rl).sum())
    response_tokens = int(rl.sum())

    def build(kind: str):
        a = build_actor(cfg, pgs, vocab_size=VOCAB, pad_id=PAD)
        if kind == "new":
            return a
        o = old["actor"]
        policy = o.PolicyModel(a.policy.chunks, pgs=pgs, pad_id=PAD, temperature=a.policy.temperature,
                               max_tokens=a.policy.max_tokens, vocab_size=VOCAB, fused=False)
        return o.Actor(policy, optimizer=a.optimizer, scheduler=a.scheduler, cfg=a.cfg, loss_fn=a.loss_fn, n=n,
                       balance_batch=cfg.trainer.balance_batch)

    def spy_lm_head(actor, kind: str, seen: list):
        if kind == "new":
            import megatron_dapo.kernels as kernels

            real = kernels.fused_logprob_stats
            kernels.fused_logprob_stats = lambda h, w, y, **kw: seen.append(h.shape[0]) or real(h, w, y, **kw)
            return lambda: setattr(kernels, "fused_logprob_stats", real)
        mod = old["actor"]
        real = mod.logprob_entropy_from_logits
        mod.logprob_entropy_from_logits = lambda logits, labels, **kw: seen.append(logits.shape[0]) or real(
            logits, labels, **kw)
        return lambda: setattr(mod, "logprob_entropy_from_logits", real)

    def spy_run(actor, seen: list):
        policy = actor.policy
        real = policy.run

        def run(microbatches, *a, **kw):
            seen.append((len(microbatches), sum(int(mb.input_ids.numel()) for mb in microbatches),
                         sum(int(mb.seq_len.sum()) for mb in microbatches if mb.rows.numel())))
            return real(microbatches, *a, **kw)

        policy.run = run
        return lambda: setattr(policy, "run", real)

    out = {}
    for kind in ("new", "old"):
        actor = build(kind)
        actor.compute_log_prob(*(t[:4] for t in seqs))  # warm-up: first-call allocations and caches
        dist.barrier()
        lm = []
        undo = spy_lm_head(actor, kind, lm)
        reset_hwm()
        base = rss_bytes()
        t0 = time.perf_counter()
        lp = actor.compute_log_prob(*seqs, with_sum_sq=True)
        dist.barrier()
        t_lp = time.perf_counter() - t0
        peak = hwm_bytes() - base
        lm_lp = sum(lm)
        lm.clear()
        batch = PolicyBatch(prompt_ids=prompt_ids, prompt_length=pl, responses=responses, response_length=rl,
                            response_mask=mask, old_log_probs=lp.log_probs * mask,
                            advantages=torch.randn(rows, 1).expand(rows, T) * mask,
                            rollout_log_probs=lp.log_probs * mask, index=[str(i // n) for i in range(rows)])
        runs = []
        undo_run = spy_run(actor, runs)
        dist.barrier()
        t0 = time.perf_counter()
        actor.update_policy(batch)
        dist.barrier()
        t_up = time.perf_counter() - t0
        undo()
        undo_run()
        stats = torch.tensor([peak, lm_lp, sum(lm), sum(r[1] for r in runs), sum(r[2] for r in runs)],
                             dtype=torch.float64)
        every = [torch.zeros_like(stats) for _ in range(pgs.dp_size)]
        dist.all_gather(every, stats, group=pgs.dp)
        counts = [None] * pgs.dp_size
        dist.all_gather_object(counts, [r[0] for r in runs], group=pgs.dp)
        every = torch.stack(every)
        out[kind] = {
            "compute_log_prob_peak_mib": round(float(every[:, 0].max()) / 2**20, 1),
            "lm_head_positions_per_response_token_log_prob": round(float(every[:, 1].sum()) / response_tokens, 3),
            "lm_head_positions_per_response_token_update": round(float(every[:, 2].sum()) / response_tokens, 3),
            "padded_per_real_token_update": round(float(every[:, 3].sum() / every[:, 4].sum()), 3),
            "microbatches_per_rank_update": [list(c) for c in zip(*counts)],
            "compute_log_prob_tokens_per_s": round(real_tokens / t_lp, 1),
            "update_policy_tokens_per_s": round(real_tokens / t_up, 1),
        }
        del actor, lp, batch
    if pgs.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    destroy_parallel(destroy_world=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-response", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--old-commit", default="e4774ca", help="the actor before issue #13 (materialised logits)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(29500 + os.getpid() % 1000), os.path.abspath(__file__), "--worker",
           "--rows", str(args.rows), "--max-response", str(args.max_response), "--seed", str(args.seed),
           "--old-commit", args.old_commit]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        sys.exit(f"benchmark worker failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    new, old = res["new"], res["old"]
    print(f"batch: {args.rows} rows, max_response_length {args.max_response}, V {VOCAB}, hidden 256, 2 DP ranks (gloo)")
    for key in new:
        print(f"{key:<48} new {new[key]!s:<24} old {old[key]!s}")
    figures = {
        "lm_head_positions_per_response_token": max(new["lm_head_positions_per_response_token_log_prob"],
                                                    new["lm_head_positions_per_response_token_update"]),
        "lm_head_positions_per_response_token_old": max(old["lm_head_positions_per_response_token_log_prob"],
                                                        old["lm_head_positions_per_response_token_update"]),
        "padded_per_real_token_update": new["padded_per_real_token_update"],
        "padded_per_real_token_update_old": old["padded_per_real_token_update"],
        "microbatches_per_rank_update": new["microbatches_per_rank_update"],
        "microbatches_per_rank_update_old": old["microbatches_per_rank_update"],
        "compute_log_prob_peak_mib": new["compute_log_prob_peak_mib"],
        "compute_log_prob_peak_mib_old": old["compute_log_prob_peak_mib"],
        "compute_log_prob_peak_ratio": round(new["compute_log_prob_peak_mib"] / old["compute_log_prob_peak_mib"], 3),
        "compute_log_prob_tokens_per_s": new["compute_log_prob_tokens_per_s"],
        "compute_log_prob_tokens_per_s_old": old["compute_log_prob_tokens_per_s"],
        "compute_log_prob_speedup": round(new["compute_log_prob_tokens_per_s"] / old["compute_log_prob_tokens_per_s"], 2),
        "update_policy_tokens_per_s": new["update_policy_tokens_per_s"],
        "update_policy_tokens_per_s_old": old["update_policy_tokens_per_s"],
        "update_policy_speedup": round(new["update_policy_tokens_per_s"] / old["update_policy_tokens_per_s"], 2),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
