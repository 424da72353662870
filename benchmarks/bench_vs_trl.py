"""Training throughput of this trainer (DAPOTrainer) against TRL's GRPOTrainer, on two workloads.

Workloads (`--workload toy|long|both`, default both):
- toy: Qwen2-shaped, 4 layers, hidden 256, 4 heads / 2 KV heads, SwiGLU FFN 768 (3.2M params);
  8 prompts x 8 completions per step, at most 8 new tokens (EOS ends a response); 2 warm-up + 8
  timed steps (`--steps`, `--warmup`). Goal: never slower than TRL (ratio >= 1).
- long: 8 layers, hidden 512, 8 heads / 2 KV heads, FFN 1536 (25M params); 16 prompts x 8
  completions, exactly 128 new tokens: EOS is suppressed on both sides (ours: rollout.min_new_tokens;
  TRL: generation_kwargs min_new_tokens, transformers' MinNewTokensLengthLogitsProcessor); 1 warm-up
  + 3 timed steps (`--long-steps`, `--long-warmup`). Goal: >= 1.5x TRL's tokens/s, or within 1.25x of
  the floor (below) where the floor itself rules 1.5x out.

The same on both sides, in both workloads:
- model: RMSNorm, RoPE, QKV bias, untied embeddings, the synthetic task's CharTokenizer vocabulary
  (18), fp32, CPU, 2 threads, and the same random initial weights: our Megatron model is exported with
  save_mcore_as_hf and TRL's side loads it, checking the logits of a probe sequence first;
- data: the synthetic arithmetic prompts ("12+7=" after <bos>), the same prompts in the same order
  (this script writes the exact sequence our seeded sampler will draw; TRL does not shuffle);
- step: temperature 1, top-p 1, reward 1/0 for the exact integer (our overlong shaping off: TRL has
  none), group-std-normalised advantages, token-mean ("dapo") loss clipped at 0.2 / 0.28, no KL (beta
  0), one AdamW step per generation batch (TRL: num_iterations 1, gradient_accumulation_steps 1; ours:
  ppo_mini_batch_size = train_batch_size, ppo_epochs 1) at the same constant lr, grad clip 1.0, weight
  decay as ours; no dynamic sampling, no supervised warm-up and no lr warm-up on either side; rewards
  run inline.

Both sides do the same passes: with one update per generation TRL skips the old-log-prob pass (the
ratio is then exactly 1), and so does ours (`actor.old_log_prob_from_update`, on by default: old :=
the update forward's own log-probs). Our fit() also writes a checkpoint after its last step
(outside the timed steps).

Phases, per side, summed over the timed steps: generation, old log-prob (0 when skipped), update
(forward + backward + optimizer), and the rest of the step (rewards, advantages, batching). Ours:
fit()'s `timing_s/gen`, `timing_s/old_log_prob`, `timing_s/update_actor`. TRL: its `_generate`
(generation), its `_get_per_token_logps_and_entropies` while inside `_generate_and_score_completions`
(old log-prob), and the step time outside `_generate_and_score_completions` (update), each wrapped
with a perf_counter on the trainer instance (benchmarks/_trl_side.py).

The floor: the FLOPs of each phase at this machine's fp32 GEMM rate measured on that phase's own
shapes (`_floor`, measured after each side ran, the faster of the two kept): generation = 2 x (matmul weights) FLOPs per token, each (K, N) of the linear layers
and the LM head timed at M = the rows of one decode step (prefill: M = rows x prompt length), plus
the causal attention's 4 x hidden x context FLOPs per token and layer; update = 3 x the forward
(forward + backward) at M = the step's tokens; no optimizer, norms or sampling. Floor seconds per
step = the sum over the phases; TRL's step over the floor step is the most any trainer could gain
over TRL here, and our step over the floor step (`floor_ratio`) is how far ours is from it.

Tokens/s = (prompt + response tokens of the timed steps) / (sum of their step times), after the
untimed warm-up steps. Ours: fit()'s `perf/total_num_tokens` and `perf/time_per_step` (generation
through weight sync), read from a stand-in logger. TRL: perf_counter in a TrainerCallback's
on_step_begin -> on_step_end, tokens from the growth of `state.num_input_tokens_seen`. Also shown
for the toy: the median and the best per-step tokens/s, and tokens per process-CPU-second. On a
machine shared with other jobs a step can take 10-30x longer (CPU time grows with it: the OpenMP
threads spin waiting for a descheduled partner, on both sides alike), so there the best step is the
closest estimate of uncontended throughput; compare the 1-min load average printed with the figures.
The two policies start equal but drift apart after the first update with a non-zero advantage,
so the tokens per step differ a little (toy; the long workload's responses are all 128 tokens).
Timing is reported, never asserted.

    make bench-trl      # creates .venv-trl (TRL is no project dependency), then runs this
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_vs_trl.py [--workload both] [--steps 8] [--warmup 2]

Last line: one JSON object with the figures: `ratio` (toy), `ratio_long`, `floor_ratio_long`, and
per workload its own object.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")  # before torch is imported; main() sets the torch threads too

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOALS = {"toy": 1.0, "long": 1.5}  # issue #17: never slower than TRL on the toy; >= 1.5x on the long one
FLOOR_GOAL = 1.25  # long: within 1.25x of the floor where the floor rules 1.5x out

# One update per generation batch, no dynamic sampling, no warm-up of any kind, no validation,
# checkpoints or loggers inside the timed loop.
OUR_OVERRIDES = [
    "model.arch=tiny", "model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=768",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.params_dtype=fp32",
    "data.train_batch_size=8", "data.gen_batch_size=null", "rollout.n=8", "data.max_response_length=8",
    "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=-1",
    "actor.ppo_mini_batch_size=8", "actor.ppo_epochs=1", "actor.clip_ratio_low=0.2",
    "actor.clip_ratio_high=0.28",
    "actor.loss_agg_mode=token-mean", "actor.use_kl_loss=false", "actor.entropy_coeff=0.0",
    "actor.lr_warmup_steps=0", "actor.lr_decay_style=constant", "actor.clip_grad=1.0",
    "actor.lr=3e-4", "actor.adam_beta2=0.999",  # the embedded default's until 2026-12 (figures stay comparable)
    "algorithm.filter_groups.enable=false", "algorithm.use_kl_in_reward=false",
    "algorithm.norm_adv_by_std_in_grpo=true", "reward.overlong_buffer.enable=false", "reward.timeout_s=0",
    "trainer.sft_warmup_steps=0", "trainer.test_freq=0", "trainer.val_before_train=false",
    "trainer.save_freq=-1", "trainer.logger=[]", "trainer.resume_mode=disable", "trainer.device=cpu",
    # The prompt pool is pinned here, not inherited from tiny_cpu.yaml: the figures stay comparable
    # across changes to the embedded default.
    "data.arithmetic.num_train=2000", "data.arithmetic.max_digits=2", "data.arithmetic.operators=+-",
]
# The long-generation workload: what differs from the toy's overrides (a later key wins).
LONG_OVERRIDES = [
    "model.num_layers=8", "model.hidden_size=512", "model.ffn_hidden_size=1536",
    "model.num_attention_heads=8", "model.num_query_groups=2",
    "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "data.max_response_length=128",
    "rollout.min_new_tokens=128",
]
WORKLOADS = {"toy": OUR_OVERRIDES, "long": OUR_OVERRIDES + LONG_OVERRIDES}


class _StepCapture:
    """Stands in for MetricsLogger: keeps each step's throughput figures instead of writing them.

    `cpu_s` is the process CPU time (all threads) since the previous log call, i.e. one whole step;
    unlike wall time it barely grows when other jobs on the machine take the cores.
    """

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self._cpu = time.process_time()

    def log(self, metrics, step: int) -> None:
        keys = ("perf/total_num_tokens", "perf/time_per_step", "timing_s/gen", "timing_s/old_log_prob",
                "timing_s/update_actor")
        cpu = time.process_time()
        row = {k: float(metrics[k]) for k in keys if k in metrics}
        self.steps.append(row | {"step": step, "cpu_s": cpu - self._cpu})
        self._cpu = cpu

    def close(self) -> None:
        pass


def run_ours(overrides: list[str], *, steps: int, warmup: int, threads: int, out_dir: str) -> tuple[dict, dict]:
    """Run DAPOTrainer for warmup + steps steps; return the figures and the TRL side's spec."""
    from megatron_dapo.config import load_config
    from megatron_dapo.data.tokenizer import CharTokenizer
    from megatron_dapo.models.config_arch import model_arch
    from megatron_dapo.models.forward import logits_forward, unwrap_model
    from megatron_dapo.models.hf import save_mcore_as_hf
    from megatron_dapo.parallel import destroy_parallel
    from megatron_dapo.trainer.fit import DAPOTrainer
    from megatron_dapo.trainer.run import build_parts

    torch.set_num_threads(threads)
    total = warmup + steps
    run = [f"trainer.total_training_steps={total}", f"trainer.output_dir={out_dir}",
           "trainer.experiment_name=ours"]
    cfg = load_config(os.path.join(REPO, "configs", "tiny_cpu.yaml"), overrides + run)
    parts = build_parts(cfg)
    # The exact prompts fit() will draw, in order, for the TRL side (a copy of the seeded sampler).
    sampler = copy.deepcopy(parts.sampler)
    records = [parts.train_data[i] for _ in range(total) for i in sampler.next_batch()]
    prompts = [{"prompt": r.raw_prompt, "ground_truth": r.ground_truth} for r in records]
    per_step = cfg.data.train_batch_size
    tok = parts.tokenizer
    if not isinstance(tok, CharTokenizer):
        raise TypeError(f"TRL's tokenizer is built from CharTokenizer's vocabulary; the run has {type(tok)}")
    arch = model_arch(cfg, vocab_size=tok.vocab_size)
    model = unwrap_model(parts.actor.policy.chunks[0])
    n_params = sum(p.numel() for p in model.parameters())
    # Both sides start from the same weights: ours exported as an HF Qwen2 checkpoint, plus the
    # logits of one probe sequence so the TRL side can check it loaded the same function.
    hf_dir = os.path.join(out_dir, "init_hf")
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    save_mcore_as_hf(model, hf_dir, pgs=parts.pgs, arch=arch, dtype=torch.float32, hf_config=ids)
    first = parts.train_data[0]
    probe = first.prompt_ids + tok.encode(first.ground_truth) + [tok.eos_id]  # [S]
    with torch.no_grad():
        probe_ids = torch.tensor([probe], device=parts.pgs.device)  # [1, S]
        probe_logits = logits_forward(model, probe_ids)[0].float().cpu()  # [S, V]
    a = cfg.actor
    spec = {
        "vocab": list(CharTokenizer.SPECIALS) + list(CharTokenizer.CHARS),
        "pad_id": tok.pad_id, "bos_id": tok.bos_id, "eos_id": tok.eos_id, "prompts": prompts,
        "init_hf_dir": hf_dir, "probe": {"ids": probe, "logits": probe_logits.tolist()},
        "model": {k: getattr(arch, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                                "num_attention_heads", "num_query_groups")},
        "train": {"prompts_per_step": cfg.data.train_batch_size, "n": cfg.rollout.n,
                  "max_new_tokens": cfg.data.max_response_length, "min_new_tokens": cfg.rollout.min_new_tokens,
                  "lr": a.lr, "clip_grad": a.clip_grad,
                  "adam_beta1": a.adam_beta1, "adam_beta2": a.adam_beta2, "adam_eps": a.adam_eps,
                  "weight_decay": a.weight_decay, "temperature": cfg.rollout.temperature,
                  "seed": cfg.trainer.seed, "warmup_steps": warmup, "timed_steps": steps},
    }
    if len(spec["vocab"]) != tok.vocab_size:
        raise RuntimeError(f"{len(spec['vocab'])} vocabulary strings != vocab_size {tok.vocab_size}")
    trainer = DAPOTrainer(cfg, parts)
    capture = _StepCapture()  # reset its CPU clock here, after the build
    parts.logger = capture
    t0 = time.perf_counter()
    try:
        trainer.fit()
    finally:
        parts.reward_manager.close()
    wall = time.perf_counter() - t0
    destroy_parallel(destroy_world=True)
    if len(capture.steps) != total:
        raise RuntimeError(f"expected {total} logged steps, fit() logged {len(capture.steps)}")
    timed = capture.steps[warmup:]
    figures = {"seconds": [s["perf/time_per_step"] for s in timed],
               "tokens": [int(s["perf/total_num_tokens"]) for s in timed],
               "cpu_seconds": [s["cpu_s"] for s in timed],
               "warmup_seconds": [s["perf/time_per_step"] for s in capture.steps[:warmup]],
               "phase_seconds": {ph: sum(s.get(f"timing_s/{k}", 0.0) for s in timed)
                                 for ph, k in (("gen", "gen"), ("old_log_prob", "old_log_prob"),
                                               ("update", "update_actor"))},
               "prompt_tokens": [cfg.rollout.n * sum(len(r.prompt_ids) for r in records[i * per_step:(i + 1) * per_step])
                                 for i in range(warmup, total)],
               "wall_s": wall, "params": n_params, "threads": torch.get_num_threads()}
    return figures, spec


def run_trl(spec: dict, *, python: str, threads: int, out_dir: str, timeout_s: float) -> dict:
    """Run benchmarks/_trl_side.py with TRL's interpreter; return its last-line JSON."""
    path = os.path.join(out_dir, "trl_spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTHONPATH", None)  # the TRL side runs without megatron_dapo on its path
    proc = subprocess.run([python, os.path.join(REPO, "benchmarks", "_trl_side.py"), "--spec", path],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"the TRL side failed (exit {proc.returncode}); its stderr is above")
    lines = proc.stdout.strip().splitlines()
    for line in lines[:-1]:
        if not line.startswith("{"):  # Trainer's per-step log dicts are left out
            print(f"  [trl] {line}")
    return json.loads(lines[-1])


def _rate(side: dict, clock: str = "seconds") -> float:
    """Tokens of the timed steps over their summed step times (wall; CPU with clock="cpu_seconds")."""
    return sum(side["tokens"]) / sum(side[clock])


def _step_rates(side: dict) -> list[float]:
    return [t / s for t, s in zip(side["tokens"], side["seconds"], strict=True)]


def _linear_params(m: dict, vocab: int) -> int:
    """Weights that take part in a matmul per token: QKV, output projection, SwiGLU FFN, LM head."""
    h, f = m["hidden_size"], m["ffn_hidden_size"]
    kv = m["num_query_groups"] * (h // m["num_attention_heads"])
    return m["num_layers"] * (h * (h + 2 * kv) + h * h + h * 2 * f + f * h) + h * vocab


def _matmul_peak_gflops(m: dict, tokens: int, threads: int) -> float:
    """Best fp32 GFLOP/s of this machine on the model's own GEMM shapes at one step's token count."""
    torch.set_num_threads(threads)
    h, f = m["hidden_size"], m["ffn_hidden_size"]
    best = 0.0
    for k, n in ((h, 2 * f), (f, h), (h, h)):
        a, b = torch.randn(tokens, k), torch.randn(k, n)
        for _ in range(3):
            a @ b
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(10):
                a @ b
            best = max(best, 2 * tokens * k * n * 10 / (time.perf_counter() - t0) / 1e9)
    return best


def _linear_shapes(m: dict, vocab: int) -> list[tuple[int, int, int]]:
    """(K, N, count) of every linear layer of the model: fused QKV, output projection, SwiGLU fc1
    (gate and up fused), fc2, per layer; and the LM head. sum(K * N * count) == _linear_params."""
    h, f, L = m["hidden_size"], m["ffn_hidden_size"], m["num_layers"]
    kv = m["num_query_groups"] * (h // m["num_attention_heads"])
    return [(h, h + 2 * kv, L), (h, h, L), (h, 2 * f, L), (f, h, L), (h, vocab, 1)]


def _gemm_seconds(M: int, K: int, N: int, *, budget_s: float = 0.3) -> float:
    """Best time of one fp32 [M, K] @ [K, N] on this machine (repeated within about budget_s)."""
    a, b = torch.randn(M, K), torch.randn(K, N)
    a @ b  # first call: allocation
    t0 = time.perf_counter()
    a @ b
    one = time.perf_counter() - t0
    reps = max(2, min(50, int(budget_s / max(one, 1e-6))))
    best = one
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return best


def _floor(m: dict, vocab: int, *, rows: int, prompt_len: float, response_len: float, threads: int) -> dict:
    """Seconds per step of each phase at this machine's GEMM rate on the phase's own shapes (module
    docstring). rows = prompts x n; prompt_len, response_len: mean tokens per row."""
    torch.set_num_threads(threads)
    shapes = _linear_shapes(m, vocab)
    h, L = m["hidden_size"], m["num_layers"]
    P, R = max(1, round(prompt_len)), max(1, round(response_len))
    S = P + R

    def linear(M: int) -> tuple[float, float]:  # (seconds, FLOPs) of one forward of M tokens
        secs = sum(c * _gemm_seconds(M, k, n) for k, n, c in shapes)
        return secs, sum(2.0 * M * k * n * c for k, n, c in shapes)

    # Attention: 4 * h FLOPs per (query, key) pair and layer (QK^T and AV); causal: a query at
    # position s (1-based) sees s keys. At the phase's linear GEMM rate (optimistic: a floor).
    attn = lambda lo, hi: 4.0 * h * L * rows * (hi * (hi + 1) - lo * (lo + 1)) / 2  # noqa: E731, queries lo+1..hi
    pre_s, pre_f = linear(rows * P)                       # prefill: every prompt token at once
    dec_s, dec_f = linear(rows)                           # one decode step: M = rows
    gen_linear_s = pre_s + dec_s * (R - 1)
    gen_linear_f = pre_f + dec_f * (R - 1)
    gen_s = gen_linear_s * (1 + attn(0, S - 1) / gen_linear_f)  # the last token is sampled, never fed
    upd_s, upd_f = linear(rows * S)
    update_s = 3 * upd_s * (1 + attn(0, S) / upd_f)      # forward + backward (2x the forward)
    return {"gen": gen_s, "old_log_prob": 0.0, "update": update_s, "step": gen_s + update_s,
            "decode_gflops": dec_f / dec_s / 1e9, "update_gflops": upd_f / upd_s / 1e9,
            "prefill_gflops": pre_f / pre_s / 1e9}


def _versions_main() -> dict:
    from importlib.metadata import version

    return {"torch": torch.__version__, "megatron-core": version("megatron-core"),
            "python": sys.version.split()[0]}


PHASES = ("gen", "old_log_prob", "update")


def step_floor(ours: dict, spec: dict, *, threads: int) -> dict:
    """_floor at the shapes of our side's timed steps (rows, mean prompt and response lengths)."""
    tr = spec["train"]
    rows = tr["prompts_per_step"] * tr["n"]
    step_tokens = sum(ours["tokens"]) / len(ours["tokens"])
    prompt_tokens = sum(ours["prompt_tokens"]) / len(ours["prompt_tokens"])
    return _floor(spec["model"], len(spec["vocab"]), rows=rows, prompt_len=prompt_tokens / rows,
                  response_len=(step_tokens - prompt_tokens) / rows, threads=threads)


def faster_floor(a: dict, b: dict) -> dict:
    """The floor of two measurements (one after each side ran): per phase the shorter time, since
    other jobs on a shared machine only ever slow a GEMM down."""
    out = {k: min(a[k], b[k]) for k in ("gen", "old_log_prob", "update")}
    out["step"] = sum(out.values())
    return out | {k: max(a[k], b[k]) for k in ("decode_gflops", "prefill_gflops", "update_gflops")}


def report(name: str, ours: dict, trl: dict, spec: dict, floor: dict, *, threads: int, steps: int,
           warmup: int) -> dict:
    """Print one workload's comparison and return its figures (floor: faster_floor of step_floor)."""
    rate = {side_name: {"sum": _rate(side), "median": statistics.median(_step_rates(side)),
                        "best": max(_step_rates(side)), "cpu": _rate(side, "cpu_seconds")}
            for side_name, side in (("ours", ours), ("trl", trl))}
    ratio = {k: rate["ours"][k] / rate["trl"][k] for k in rate["ours"]}
    tr, m, vocab = spec["train"], spec["model"], len(spec["vocab"])
    goal = GOALS[name]
    print(f"== {name}: {tr['prompts_per_step']} prompts x {tr['n']} completions/step, "
          f"<= {tr['max_new_tokens']} new tokens (EOS suppressed before {tr['min_new_tokens']}); "
          f"Qwen2-shaped {m['num_layers']} layers, hidden {m['hidden_size']}, "
          f"{m['num_attention_heads']}/{m['num_query_groups']} heads, FFN {m['ffn_hidden_size']}, "
          f"vocab {vocab}, fp32, {threads} threads; {warmup} warm-up + {steps} timed steps per side")
    print(f"params: ours {ours['params']:,}  TRL {trl['params']:,}; same initial weights "
          f"(probe logits max abs diff {trl['probe_logits_max_abs_diff']:.2g})")
    for side_name, side in (("ours", ours), ("TRL", trl)):
        r = rate[side_name.lower()]
        print(f"{side_name:>5}: {sum(side['tokens']):6d} tokens in {sum(side['seconds']):7.2f} s = "
              f"{r['sum']:7.1f} tokens/s (median step {r['median']:.1f}, best step {r['best']:.1f}, "
              f"per CPU-s {r['cpu']:.1f})")
        print(f"       s/step {' '.join(f'{x:.2f}' for x in side['seconds'])}")
    rows = tr["prompts_per_step"] * tr["n"]
    step_tokens = sum(ours["tokens"]) / len(ours["tokens"])
    per_step = {side_name: {ph: side["phase_seconds"][ph] / len(side["seconds"]) for ph in PHASES}
                for side_name, side in (("ours", ours), ("trl", trl))}
    for side_name, side in (("ours", ours), ("trl", trl)):
        per_step[side_name]["other"] = sum(side["seconds"]) / len(side["seconds"]) - sum(per_step[side_name].values())
    per_step["floor"] = {ph: floor[ph] for ph in PHASES} | {"other": 0.0}
    print("seconds per step    " + "".join(f"{ph:>14}" for ph in (*PHASES, "other", "step")))
    for side_name in ("ours", "trl", "floor"):
        row = per_step[side_name]
        print(f"  {side_name:<18}" + "".join(f"{row[ph]:14.3f}" for ph in (*PHASES, "other"))
              + f"{sum(row.values()):14.3f}")
    # Each phase's distance from its own floor: where the rest of the gap is.
    phase_ratio = {ph: per_step["ours"][ph] / floor[ph] for ph in PHASES if floor[ph] > 0}
    print("ours over the floor per phase: " + ", ".join(f"{ph} {r:.2f}x ({per_step['ours'][ph]:.2f} s vs "
                                                        f"{floor[ph]:.2f} s)" for ph, r in phase_ratio.items())
          + f", other {per_step['ours']['other']:.2f} s (no floor)")
    floor_step = floor["step"]
    ours_step, trl_step = (sum(side["seconds"]) / len(side["seconds"]) for side in (ours, trl))
    floor_ratio = ours_step / floor_step
    best_possible = trl_step / floor_step
    print(f"floor: {floor_step:.3f} s/step at this machine's GEMM rates on the phase shapes (decode M={rows}: "
          f"{floor['decode_gflops']:.1f} GFLOP/s, prefill {floor['prefill_gflops']:.1f}, update M="
          f"{round(rows * (step_tokens / rows))}: {floor['update_gflops']:.1f}); a trainer at the floor runs "
          f"at {best_possible:.2f}x TRL; ours is {floor_ratio:.2f}x the floor")
    verdict = "met" if ratio["sum"] >= goal else "NOT met"
    if name == "long" and best_possible < goal:
        verdict += (f"; the floor rules {goal:g}x out here (the floor is {best_possible:.2f}x TRL), "
                    f"fallback goal ours <= {FLOOR_GOAL:g}x the floor: "
                    + ("met" if floor_ratio <= FLOOR_GOAL else "NOT met"))
    print(f"ratio ours/TRL: {ratio['sum']:.2f}x (goal >= {goal:g}x: {verdict}); median step "
          f"{ratio['median']:.2f}x, best step {ratio['best']:.2f}x, per CPU-s {ratio['cpu']:.2f}x")
    out = {"prompts_per_step": tr["prompts_per_step"], "n": tr["n"], "max_new_tokens": tr["max_new_tokens"],
           "min_new_tokens": tr["min_new_tokens"], "steps": steps, "warmup": warmup,
           "ours_tokens_per_s": round(rate["ours"]["sum"], 1), "trl_tokens_per_s": round(rate["trl"]["sum"], 1),
           "ratio": round(ratio["sum"], 2), "goal": goal, "floor_s_per_step": round(floor_step, 4),
           "floor_ratio": round(floor_ratio, 2), "floor_vs_trl": round(best_possible, 2),
           "phase_s_per_step": {k: {ph: round(v, 4) for ph, v in row.items()} for k, row in per_step.items()},
           "phase_floor_ratio": {ph: round(r, 2) for ph, r in phase_ratio.items()},
           "floor_gflops": {k: round(floor[f"{k}_gflops"], 1) for k in ("decode", "prefill", "update")}}
    for k in ("median", "best", "cpu"):
        out |= {f"ours_{k}_tokens_per_s": round(rate["ours"][k], 1),
                f"trl_{k}_tokens_per_s": round(rate["trl"][k], 1), f"{k}_ratio": round(ratio[k], 2)}
    out |= {"ours_s_per_step": [round(x, 3) for x in ours["seconds"]],
            "trl_s_per_step": [round(x, 3) for x in trl["seconds"]],
            "ours_tokens": sum(ours["tokens"]), "trl_tokens": sum(trl["tokens"]), "params": ours["params"],
            "probe_logits_max_abs_diff": trl["probe_logits_max_abs_diff"]}
    if name == "toy":  # the toy's earlier compute figures, kept comparable with docs/benchmarks.md's
        flops_per_token = 8 * _linear_params(m, vocab)
        trl_tokens = round(sum(trl["tokens"]) / len(trl["tokens"]))
        peak = _matmul_peak_gflops(m, trl_tokens, threads)
        achieved = {k: flops_per_token * sum(side["tokens"]) / sum(side["seconds"]) / 1e9
                    for k, side in (("ours", ours), ("trl", trl))}
        print(f"compute: >= {flops_per_token / 1e6:.1f} MFLOP per token; achieved ours {achieved['ours']:.1f}, "
              f"TRL {achieved['trl']:.1f} GFLOP/s; fp32 GEMM peak here {peak:.1f} GFLOP/s (M={trl_tokens}); "
              f"one plain HF forward + backward of a step's batch takes {trl['hf_fwd_bwd_s']:.3f} s")
        out |= {"flops_per_token": flops_per_token, "ours_gflops": round(achieved["ours"], 1),
                "trl_gflops": round(achieved["trl"], 1), "gemm_peak_gflops": round(peak, 1),
                "ceiling_ratio": round(peak / achieved["trl"], 2), "hf_fwd_bwd_s": round(trl["hf_fwd_bwd_s"], 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("both", "toy", "long"), default="both")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per side (toy)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (toy; allocator, first-call costs)")
    ap.add_argument("--long-steps", type=int, default=3, help="timed steps per side (long)")
    ap.add_argument("--long-warmup", type=int, default=1, help="untimed steps first (long)")
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads on both sides")
    ap.add_argument("--trl-python", default=os.path.join(REPO, ".venv-trl", "bin", "python"),
                    help="interpreter of the environment that has TRL (make bench-trl creates .venv-trl)")
    ap.add_argument("--trl-timeout", type=float, default=1800.0, help="seconds before the TRL side is stopped")
    args = ap.parse_args()
    if min(args.steps, args.long_steps) < 1 or min(args.warmup, args.long_warmup) < 0:
        ap.error("--steps / --long-steps must be >= 1 and --warmup / --long-warmup >= 0")
    if not os.access(args.trl_python, os.X_OK):
        ap.error(f"--trl-python {args.trl_python} is not executable; `make bench-trl` creates .venv-trl")
    names = ["toy", "long"] if args.workload == "both" else [args.workload]
    figures: dict = {"bench": "vs_trl", "threads": args.threads, "cores": os.cpu_count()}
    load: dict[str, float] = {}
    trl_versions = None
    for name in names:
        steps, warmup = (args.steps, args.warmup) if name == "toy" else (args.long_steps, args.long_warmup)
        out_dir = tempfile.mkdtemp(prefix=f"bench_vs_trl_{name}_")  # our checkpoint, the HF export, the spec
        try:
            load[f"{name}_before_ours"] = os.getloadavg()[0]
            ours, spec = run_ours(WORKLOADS[name], steps=steps, warmup=warmup, threads=args.threads,
                                  out_dir=out_dir)
            floor_a = step_floor(ours, spec, threads=args.threads)
            load[f"{name}_before_trl"] = os.getloadavg()[0]
            trl = run_trl(spec, python=args.trl_python, threads=args.threads, out_dir=out_dir,
                          timeout_s=args.trl_timeout)
            load[f"{name}_after_trl"] = os.getloadavg()[0]
            floor = faster_floor(floor_a, step_floor(ours, spec, threads=args.threads))
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        figures[name] = report(name, ours, trl, spec, floor, threads=args.threads, steps=steps, warmup=warmup)
        trl_versions = trl["versions"]
    if "toy" in figures:
        figures["ratio"] = figures["toy"]["ratio"]
    if "long" in figures:
        figures["ratio_long"] = figures["long"]["ratio"]
        figures["floor_ratio_long"] = figures["long"]["floor_ratio"]
    print(f"1-min load average on {os.cpu_count()} cores: " + ", ".join(f"{k} {v:.1f}" for k, v in load.items()))
    versions = {"ours": _versions_main(), "trl_side": trl_versions}
    print(f"versions: {versions}")
    figures |= {"load_avg_1min": {k: round(v, 2) for k, v in load.items()}, "versions": versions}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
