"""Training throughput and MFU of a ~1B-parameter Megatron GPT (bf16 on CUDA, TE spec when available)
through the actor's own update path: forward, backward and optimizer step of `Actor.update_policy`.

    python tests/gpu/mfu_1b.py [--seq 4096] [--rows 8] [--steps 5] [--peak-tflops 989]
    python tests/gpu/mfu_1b.py --tiny      # a 2-layer fp32 model on the CPU: checks the script, not a figure

MFU = (6 * params + 12 * layers * hidden * seq) * tokens/s / peak FLOP/s: the dense matrix products of
forward and backward plus attention's score and value products, counted without the causal mask's saving
(PaLM's convention). The default peak is 989 TFLOP/s, the datasheet's dense bf16 rate of an H100/H200 SXM;
`--peak-tflops` takes a measured rate instead (tests/gpu/gpu_env.py measures one). Each row is one
sequence of --seq tokens (half prompt, half response) and one micro-batch. The last line is one JSON object.
"""

import argparse
import json
import time

import torch

DATASHEET_BF16_TFLOPS = 989.0
_1B = dict(num_layers=16, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16, num_query_groups=8,
           vocab=32000)  # ~1.1B parameters, SwiGLU, GQA with 8 KV groups
_TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=172, num_attention_heads=4, num_query_groups=2,
             vocab=512)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rows", type=int, default=8, help="sequences per step, a multiple of 8 (rollout.n)")
    p.add_argument("--steps", type=int, default=5, help="timed steps, after one warm-up step")
    p.add_argument("--peak-tflops", type=float, default=DATASHEET_BF16_TFLOPS)
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, seq 64, fp32, on the CPU")
    args = p.parse_args()
    if args.tiny:
        args.seq, args.steps = 64, 2
    elif not torch.cuda.is_available():
        raise SystemExit("mfu_1b.py needs CUDA (or --tiny for the CPU check)")
    if args.rows % 8 or args.seq % 2:
        raise SystemExit(f"--rows must be a multiple of 8 and --seq even, got {args.rows} and {args.seq}")

    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import default_backend
    from megatron_dapo.parallel import init_parallel
    from megatron_dapo.workers.batch import PolicyBatch
    from megatron_dapo.workers.build import build_actor

    shape = _TINY if args.tiny else _1B
    V, S, B, half = shape["vocab"], args.seq, args.rows, args.seq // 2
    cfg = load_config("configs/tiny_cpu.yaml", [
        *(f"model.{k}={v}" for k, v in shape.items() if k != "vocab"),
        f"model.params_dtype={'fp32' if args.tiny else 'bf16'}",
        f"data.max_prompt_length={half}", f"data.max_response_length={half}", "rollout.n=8",
        f"data.train_batch_size={B // 8}", f"data.gen_batch_size={B // 8}",
        f"actor.ppo_mini_batch_size={B // 8}", f"actor.max_tokens_per_microbatch={S}",
        f"reward.overlong_buffer.len={S // 4}"])
    pgs = init_parallel()
    device = pgs.device
    actor = build_actor(cfg, pgs, vocab_size=V, pad_id=0)
    n_params = sum(p.numel() for c in actor.policy.chunks for p in c.parameters())
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, V, (B, half), generator=gen)
    resp = torch.randint(1, V, (B, half), generator=gen)
    lengths = torch.full((B,), half)
    lp = actor.compute_log_prob(prompt, lengths, resp, lengths).log_probs
    batch = PolicyBatch(prompt_ids=prompt, prompt_length=lengths, responses=resp, response_length=lengths,
                        response_mask=torch.ones(B, half), old_log_probs=lp,
                        advantages=torch.randn(B, 1, generator=gen).expand(B, half), rollout_log_probs=lp,
                        index=[str(i // 8) for i in range(B)])

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    actor.update_policy(batch)  # warm-up: allocator, cuBLAS workspaces, Triton compilation
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        metrics = actor.update_policy(batch)
        sync()
        times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    tokens = B * S
    arch = actor.policy.chunks[0].config
    flops_per_token = 6 * n_params + 12 * arch.num_layers * arch.hidden_size * S
    mfu = flops_per_token * tokens / dt / (args.peak_tflops * 1e12)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    print(f"{n_params / 1e6:,.1f}M params, {B} x {S} tokens on {device.type}: {dt * 1e3:.0f} ms/step (median of "
          f"{args.steps}), {tokens / dt:,.0f} tokens/s, MFU {mfu * 100:.1f}% of {args.peak_tflops} TFLOP/s")
    print(json.dumps({"params": n_params, "layers": arch.num_layers, "hidden": arch.hidden_size, "seq": S,
                      "rows": B, "dtype": cfg.model.params_dtype, "device": device.type,
                      "backend": default_backend(device), "steps": args.steps, "step_s": dt,
                      "tokens_per_s": tokens / dt, "flops_per_token": flops_per_token,
                      "peak_tflops": args.peak_tflops, "mfu": mfu, "peak_mem_gib": peak_gib,
                      "pg_loss": float(metrics["actor/pg_loss"])}))


if __name__ == "__main__":
    main()
