"""Where one cached decode step of the local engine spends its time, against its GEMM floor.

The long TRL workload's generation (`bench_vs_trl.py --workload long`) runs at about twice its floor;
this script splits that generation into what a decode step is made of, so the gap is visible part by
part. Model: the long workload's shape (Qwen2-shaped, 8 layers, hidden 512, 8 heads / 2 KV groups,
SwiGLU FFN 1,536, vocabulary 18, fp32), random weights; 128 rows of 8-token prompts, 128 new tokens,
temperature 1, EOS disabled; CPU, one gloo process.

Figures, per decode step (the mean over the generation's decode forwards):
- `forward`: one decode forward of the model (wall time of `_CachedStepper.decode`);
- `linear`: the model's own linear layers alone, x @ W^T at M = rows for every weight in layer order
  (QKV, output projection, fc1, fc2 per layer, the LM head): the GEMMs of one step, weights read from
  memory as the step reads them;
- `attention`: the generation's core attention (`_SdpaCoreAttention`) alone on caches of the step's
  lengths, all layers;
- `rest`: forward - linear - attention: norms, rotary, the activation, residual adds, bias, cache
  writes and Megatron's module code;
- `outside`: what generate() spends besides the forwards (prefill, sampling, bookkeeping), per step;
- `floor`: bench_vs_trl's floor for the same GEMMs (each shape's best time with its one matrix pair
  repeated, so the weights stay in cache).
Timing is reported, never asserted.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_decode_step.py [--rows 128] [--new-tokens 128]

Last line: one JSON object with the figures (milliseconds per decode step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from bench_vs_trl import _gemm_seconds

    from megatron_dapo.models.arch import get_arch
    from megatron_dapo.models.builder import build_gpt_model
    from megatron_dapo.parallel import destroy_parallel, init_parallel
    from megatron_dapo.rollout import generation_attention, local_engine
    from megatron_dapo.rollout.base import PromptInput, SamplingParams

    pgs = init_parallel()
    arch = get_arch("tiny", num_layers=8, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8,
                    num_query_groups=2, vocab_size=18)
    model = build_gpt_model(arch, pgs=pgs, seed=0)
    rows, P, new = args.rows, args.prompt_len, args.new_tokens
    g = torch.Generator().manual_seed(0)
    n_prompts = max(1, rows // 8)
    prompts = [PromptInput(f"p{i}", tuple(torch.randint(3, arch.vocab_size, (P,), generator=g).tolist()))
               for i in range(n_prompts)]
    sampling = SamplingParams(max_new_tokens=new, min_new_tokens=new, n=rows // n_prompts, temperature=1.0, seed=1)
    engine = local_engine.LocalEngine(model, pgs=pgs, eos_token_id=None, pad_token_id=0, max_batch_size=rows)
    print(f"model: {arch.num_layers} layers, hidden {arch.hidden_size}, {arch.num_attention_heads}/"
          f"{arch.num_query_groups} heads, FFN {arch.ffn_hidden_size}, vocab {arch.vocab_size}, fp32, "
          f"{torch.get_num_threads()} threads; {rows} rows x {P} prompt tokens -> {new} new tokens")

    # 1. The generation, with its decode forwards timed.
    decode_s: list[float] = []
    original = local_engine._CachedStepper.decode

    def timed(self, last):
        t0 = time.perf_counter()
        out = original(self, last)
        decode_s.append(time.perf_counter() - t0)
        return out

    local_engine._CachedStepper.decode = timed
    engine.generate(prompts, SamplingParams(max_new_tokens=4, n=2, seed=0))
    gen_best, forward_best = float("inf"), float("inf")
    for _ in range(args.repeats):
        decode_s.clear()
        t0 = time.perf_counter()
        engine.generate(prompts, sampling)
        gen = time.perf_counter() - t0
        if gen < gen_best:
            gen_best, forward_best, steps = gen, sum(decode_s), len(decode_s)
    local_engine._CachedStepper.decode = original

    # 2. The step's GEMMs alone: every linear weight of the model in layer order, at M = rows.
    weights = [m.weight.detach() for layer in model.decoder.layers
               for m in (layer.self_attention.linear_qkv, layer.self_attention.linear_proj,
                         layer.mlp.linear_fc1, layer.mlp.linear_fc2)] + [model.output_layer.weight.detach()]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def linear_pass():
        for w in weights:
            torch.matmul(inputs[w.shape[1]], w.t())

    linear_s = _best(linear_pass, 2 * args.repeats)
    flops = sum(2.0 * rows * w.numel() for w in weights)
    floor_s = sum(_gemm_seconds(rows, w.shape[1], w.shape[0]) for w in weights)

    # 3. The core attention alone on the step's cache lengths (every layer, every step).
    core = model.decoder.layers[0].self_attention.core_attention
    attn = generation_attention._SdpaCoreAttention(core)
    heads, groups, hn = (core.num_attention_heads_per_partition, core.num_query_groups_per_partition,
                         core.hidden_size_per_attention_head)
    cache = [(torch.randn(P + new, rows, groups, hn), torch.randn(P + new, rows, groups, hn))
             for _ in range(arch.num_layers)]
    q = torch.randn(1, rows, heads, hn)

    def attention_pass():
        with torch.no_grad():
            for sk in range(P + 1, P + new):
                for k, v in cache:
                    attn(q, k[:sk], v[:sk], None)

    attention_s = _best(attention_pass, 1) / (new - 1)

    step = forward_best / steps
    rest = step - linear_s - attention_s
    outside = (gen_best - forward_best) / steps
    ms = lambda s: round(1e3 * s, 2)  # noqa: E731
    print(f"generation {gen_best:.2f} s, {steps} decode forwards; per decode step (ms):")
    print(f"  forward   {ms(step):8.2f}")
    print(f"  linear    {ms(linear_s):8.2f}  ({flops / linear_s / 1e9:.0f} GFLOP/s; floor {ms(floor_s)} ms at "
          f"{flops / floor_s / 1e9:.0f} GFLOP/s with each shape's weights in cache)")
    print(f"  attention {ms(attention_s):8.2f}  (the fp32 K/V cache is read once per layer: "
          f"{2 * 4 * rows * groups * hn * (P + new / 2) * arch.num_layers / attention_s / 1e9:.1f} GB/s)")
    print(f"  rest      {ms(rest):8.2f}  (norms, rotary, activation, residuals, cache writes, module code)")
    print(f"  outside   {ms(outside):8.2f}  (prefill, sampling, bookkeeping: generate() minus the decode forwards)")
    print(f"the step over its GEMM floor: {(step + outside) / floor_s:.2f}x "
          f"(linear {linear_s / floor_s:.2f}x, attention +{attention_s / floor_s:.2f}, rest +{rest / floor_s:.2f}, "
          f"outside +{outside / floor_s:.2f})")
    destroy_parallel(destroy_world=True)
    print(json.dumps({"bench": "decode_step", "rows": rows, "prompt_len": P, "new_tokens": new,
                      "threads": torch.get_num_threads(), "generation_s": round(gen_best, 3),
                      "ms_per_step": {"forward": ms(step), "linear": ms(linear_s), "attention": ms(attention_s),
                                      "rest": ms(rest), "outside": ms(outside), "floor": ms(floor_s)},
                      "linear_gflops": round(flops / linear_s / 1e9, 1),
                      "floor_gflops": round(flops / floor_s / 1e9, 1)}))


if __name__ == "__main__":
    main()
