"""Decode throughput of the local rollout engine with and without Megatron's static KV cache.

Model: the "tiny" preset widened to hidden 256 (SwiGLU ffn 1024, 4 layers, 4 heads / 2 KV groups),
vocab 512, fp32, on this process's device (CPU: gloo world of one). Workload: 8 prompts of 32
tokens, greedy, 128 new tokens each, EOS disabled so every row runs to max_new_tokens.
Throughput counts new tokens per second of generate() wall time (prefill included), best of
`--repeats` runs after one warm-up. Timing is reported, never asserted.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_rollout.py [--new-tokens 128] [--batch 8]

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="sequences (one prompt each)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from megatron_dapo.models.arch import get_arch
    from megatron_dapo.models.builder import build_gpt_model
    from megatron_dapo.parallel import destroy_parallel, init_parallel
    from megatron_dapo.rollout.base import PromptInput, SamplingParams
    from megatron_dapo.rollout.local_engine import LocalEngine

    pgs = init_parallel()
    arch = get_arch("tiny", hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
                    num_layers=args.layers, vocab_size=args.vocab)
    model = build_gpt_model(arch, pgs=pgs, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [PromptInput(f"p{i}", tuple(torch.randint(0, args.vocab, (args.prompt_len,), generator=g).tolist()))
               for i in range(args.batch)]
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    warm = SamplingParams(max_new_tokens=4, temperature=0.0)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {n_params / 1e6:.2f}M params, "
          f"fp32, device {pgs.device}, torch threads {torch.get_num_threads()}")
    print(f"workload: {args.batch} sequences x {args.prompt_len} prompt tokens -> {args.new_tokens} new tokens, "
          "greedy, EOS disabled")

    figures, outputs = {}, {}
    for name, use_cache in (("kv_cache", True), ("no_cache", False)):
        engine = LocalEngine(model, pgs=pgs, eos_token_id=None, pad_token_id=0, use_kv_cache=use_cache,
                             max_batch_size=args.batch)
        engine.generate(prompts, warm)
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            samples = engine.generate(prompts, sampling)
            best = min(best, time.perf_counter() - t0)
        new_tokens = sum(len(s.response_token_ids) for s in samples)
        outputs[name] = [s.response_token_ids for s in samples]
        figures[name] = {"seconds": round(best, 4), "new_tokens": new_tokens,
                         "tokens_per_s": round(new_tokens / best, 1)}
        print(f"{name:>9}: {best:7.3f} s for {new_tokens} new tokens = {new_tokens / best:8.1f} tok/s")

    speedup = figures["kv_cache"]["tokens_per_s"] / figures["no_cache"]["tokens_per_s"]
    same = outputs["kv_cache"] == outputs["no_cache"]
    print(f"speedup of the KV cache: {speedup:.2f}x (goal >= 3x at 128 new tokens); "
          f"greedy tokens identical: {same}")
    destroy_parallel(destroy_world=True)
    print(json.dumps({"bench": "rollout_local_engine", "batch": args.batch, "prompt_len": args.prompt_len,
                      "new_tokens": args.new_tokens, "hidden": args.hidden, "layers": args.layers,
                      "vocab": args.vocab, "threads": torch.get_num_threads(),
                      "kv_cache_tokens_per_s": figures["kv_cache"]["tokens_per_s"],
                      "no_cache_tokens_per_s": figures["no_cache"]["tokens_per_s"],
                      "speedup": round(speedup, 2), "greedy_tokens_identical": same}))


if __name__ == "__main__":
    main()
