"""CUDA: forward+backward throughput and MFU of a ~1B-parameter Megatron GPT (bf16, TE spec when
available) through the actor's own update path.

    python tests/gpu/mfu_1b.py [--seq 4096] [--rows 8] [--peak-tflops 989]

MFU = 6 * params * tokens/s (+ attention 12 * layers * hidden * seq per token) / peak bf16 FLOP/s
(989 TFLOP/s dense for H100/H200 SXM). The last line is one JSON object.
"""

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    args = p.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"

    from megatron_dapo.config import load_config
    from megatron_dapo.parallel import init_parallel
    from megatron_dapo.workers.batch import PolicyBatch
    from megatron_dapo.workers.build import build_actor

    V, S, B = 32000, args.seq, args.rows
    # ~1.1B: 16 layers, hidden 2048, 16 heads / 8 KV groups, SwiGLU 5632.
    cfg = load_config("configs/tiny_cpu.yaml", [
        "model.num_layers=16", "model.hidden_size=2048", "model.ffn_hidden_size=5632",
        "model.num_attention_heads=16", "model.num_query_groups=8", "model.params_dtype=bf16",
        f"data.max_prompt_length={S // 2}", f"data.max_response_length={S // 2}", "rollout.n=8",
        f"data.train_batch_size={B // 8 or 1}", f"data.gen_batch_size={B // 8 or 1}",
        f"actor.ppo_mini_batch_size={B // 8 or 1}", f"actor.max_tokens_per_microbatch={S}",
        f"reward.overlong_buffer.len={S // 4}"])
    pgs = init_parallel()
    actor = build_actor(cfg, pgs, vocab_size=V, pad_id=0)
    n_params = sum(p.numel() for c in actor.policy.chunks for p in c.parameters())
    prompt = torch.randint(1, V, (B, S // 2))
    resp = torch.randint(1, V, (B, S // 2))
    pl, rl = torch.full((B,), S // 2), torch.full((B,), S // 2)
    mask = torch.ones(B, S // 2)
    lp = actor.compute_log_prob(prompt, pl, resp, rl).log_probs
    batch = PolicyBatch(prompt_ids=prompt, prompt_length=pl, responses=resp, response_length=rl, response_mask=mask,
                        old_log_probs=lp, advantages=torch.randn(B, 1).expand(B, S // 2), rollout_log_probs=lp,
                        index=[str(i // 8) for i in range(B)])
    actor.update_policy(batch)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        actor.update_policy(batch)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    tokens = B * S
    arch = actor.policy.chunks[0].config
    flops_per_token = 6 * n_params + 12 * arch.num_layers * arch.hidden_size * S
    mfu = flops_per_token * tokens / dt / (args.peak_tflops * 1e12)
    print(f"{n_params / 1e9:.2f}B params, {B} x {S} tokens: {dt * 1e3:.0f} ms/step, {tokens / dt:,.0f} tokens/s, "
          f"MFU {mfu * 100:.1f}% (peak {args.peak_tflops} TFLOP/s)")
    print(json.dumps({"params": n_params, "tokens_per_s": tokens / dt, "step_s": dt, "mfu": mfu}))


if __name__ == "__main__":
    main()
