"""Actor throughput on CPU: tokens/s of compute_log_prob and update_policy on the tiny model.

    OMP_NUM_THREADS=2 python benchmarks/bench_actor.py [--rows 64] [--prompt 16] [--response 64]

Prints human-readable lines; the last line is one JSON object of the figures.
"""

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    from megatron_dapo.config import load_config
    from megatron_dapo.parallel import init_parallel
    from megatron_dapo.workers.batch import PolicyBatch
    from megatron_dapo.workers.build import build_actor

    B, P, T, V = args.rows, args.prompt, args.response, 512
    cfg = load_config("configs/tiny_cpu.yaml", [
        f"data.max_prompt_length={P}", f"data.max_response_length={T}", "rollout.n=8",
        f"data.train_batch_size={B // 8}", f"data.gen_batch_size={B // 8}", f"actor.ppo_mini_batch_size={B // 8}",
        "actor.max_tokens_per_microbatch=2048", "reward.overlong_buffer.len=4"])
    pgs = init_parallel()
    actor = build_actor(cfg, pgs, vocab_size=V, pad_id=0)
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(1, V, (B, P), generator=g)
    responses = torch.randint(1, V, (B, T), generator=g)
    pl, rl = torch.full((B,), P), torch.full((B,), T)
    mask = torch.ones(B, T)
    tokens = B * (P + T)

    def timed(fn):
        fn()  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t0)
        return best, out

    t_lp, lp = timed(lambda: actor.compute_log_prob(prompt_ids, pl, responses, rl))
    batch = PolicyBatch(prompt_ids=prompt_ids, prompt_length=pl, responses=responses, response_length=rl,
                        response_mask=mask, old_log_probs=lp.log_probs, advantages=torch.randn(B, 1).expand(B, T),
                        rollout_log_probs=lp.log_probs, index=[str(i // 8) for i in range(B)])
    t_up, _ = timed(lambda: actor.update_policy(batch))
    n_params = sum(p.numel() for c in actor.policy.chunks for p in c.parameters())
    figures = {"params": n_params, "rows": B, "tokens_per_batch": tokens, "threads": torch.get_num_threads(),
               "compute_log_prob_s": round(t_lp, 4), "compute_log_prob_tokens_per_s": round(tokens / t_lp, 1),
               "update_policy_s": round(t_up, 4), "update_policy_tokens_per_s": round(tokens / t_up, 1)}
    print(f"tiny actor: {n_params / 1e6:.2f}M params, {B} rows x {P}+{T} tokens, {torch.get_num_threads()} threads")
    print(f"compute_log_prob: {t_lp * 1e3:.0f} ms = {tokens / t_lp:,.0f} tokens/s")
    print(f"update_policy:    {t_up * 1e3:.0f} ms = {tokens / t_up:,.0f} tokens/s (fwd+bwd+Adam)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
