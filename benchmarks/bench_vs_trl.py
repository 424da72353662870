"""Training throughput of this trainer (DAPOTrainer) against TRL's GRPOTrainer on the same workload.

The same on both sides:
- model: Qwen2-shaped, 4 layers, hidden 256, 4 heads / 2 KV heads, SwiGLU FFN 768, RMSNorm, RoPE,
  QKV bias, untied embeddings, the synthetic task's CharTokenizer vocabulary (18), fp32, CPU, 2
  threads, and the same random initial weights: our Megatron model is exported with
  save_mcore_as_hf and TRL's side loads it, checking the logits of a probe sequence first;
- data: the synthetic arithmetic prompts ("12+7=" after <bos>), the same prompts in the same order
  (this script writes the exact sequence our seeded sampler will draw; TRL does not shuffle);
- step: 8 prompts x 8 completions, at most 8 new tokens, temperature 1, top-p 1, reward 1/0 for
  the exact integer (our overlong shaping off: TRL has none), group-std-normalised advantages,
  token-mean ("dapo") loss clipped at 0.2 / 0.28, no KL (beta 0), one AdamW step per generation
  batch (TRL: num_iterations 1, gradient_accumulation_steps 1; ours: ppo_mini_batch_size =
  train_batch_size, ppo_epochs 1) at the same constant lr, grad clip 1.0, weight decay as ours;
  no dynamic sampling, no supervised warm-up and no lr warm-up on either side; rewards run inline.

Both sides do the same passes: with one update per generation TRL skips the old-log-prob pass (the
ratio is then exactly 1), and so does ours (`actor.old_log_prob_from_update`, on by default: old :=
the update forward's own log-probs). Our fit() also writes a checkpoint after its last step
(outside the timed steps).

The compute ceiling: every token goes through the model once while generating and three times in
the update, >= 8 x (matmul weights) FLOPs per token. The script measures this machine's fp32 GEMM
peak on the model's shapes and prints TRL's achieved GFLOP/s against it: peak / TRL's rate is the
most any trainer doing this work could gain over TRL here.

Tokens/s = (prompt + response tokens of the timed steps) / (sum of their step times), after
`--warmup` untimed steps. Ours: fit()'s `perf/total_num_tokens` and `perf/time_per_step` (generation
through weight sync), read from a stand-in logger. TRL: perf_counter in a TrainerCallback's
on_step_begin -> on_step_end, tokens from the growth of `state.num_input_tokens_seen`. Also shown:
the median and the best per-step tokens/s, and tokens per process-CPU-second. On a machine shared
with other jobs a step can take 10-30x longer (CPU time grows with it: the OpenMP threads spin
waiting for a descheduled partner, on both sides alike), so there the best step is the closest
estimate of uncontended throughput; compare the 1-min load average printed with the figures.
The two policies start equal but drift apart after the first update with a non-zero advantage,
so the tokens per step differ a little. Timing is reported, never asserted.

    make bench-trl      # creates .venv-trl (TRL is no project dependency), then runs this
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_vs_trl.py [--steps 8] [--warmup 2]

Last line: one JSON object with the figures.
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
GOAL = 2.0  # the target: at least 2x TRL's tokens/s

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
    "algorithm.filter_groups.enable=false", "algorithm.use_kl_in_reward=false",
    "algorithm.norm_adv_by_std_in_grpo=true", "reward.overlong_buffer.enable=false", "reward.timeout_s=0",
    "trainer.sft_warmup_steps=0", "trainer.test_freq=0", "trainer.val_before_train=false",
    "trainer.save_freq=-1", "trainer.logger=[]", "trainer.resume_mode=disable", "trainer.device=cpu",
    # The prompt pool is pinned here, not inherited from tiny_cpu.yaml: the figures stay comparable
    # across changes to the embedded default.
    "data.arithmetic.num_train=2000", "data.arithmetic.max_digits=2", "data.arithmetic.operators=+-",
]


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


def run_ours(*, steps: int, warmup: int, threads: int, out_dir: str) -> tuple[dict, dict]:
    """Run DAPOTrainer for warmup + steps steps; return the figures and the TRL side's spec."""
    from megatron_dapo.config import load_config
    from megatron_dapo.data.tokenizer import CharTokenizer
    from megatron_dapo.models.forward import logits_forward, unwrap_model
    from megatron_dapo.models.hf import save_mcore_as_hf
    from megatron_dapo.parallel import destroy_parallel
    from megatron_dapo.trainer.fit import DAPOTrainer
    from megatron_dapo.trainer.run import build_parts
    from megatron_dapo.workers.model_arch import model_arch

    torch.set_num_threads(threads)
    total = warmup + steps
    run = [f"trainer.total_training_steps={total}", f"trainer.output_dir={out_dir}",
           "trainer.experiment_name=ours"]
    cfg = load_config(os.path.join(REPO, "configs", "tiny_cpu.yaml"), OUR_OVERRIDES + run)
    parts = build_parts(cfg)
    # The exact prompts fit() will draw, in order, for the TRL side (a copy of the seeded sampler).
    sampler = copy.deepcopy(parts.sampler)
    prompts = [{"prompt": r.raw_prompt, "ground_truth": r.ground_truth}
               for _ in range(total) for r in (parts.train_data[i] for i in sampler.next_batch())]
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
                  "max_new_tokens": cfg.data.max_response_length, "lr": a.lr, "clip_grad": a.clip_grad,
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
               "stage_seconds": {k: round(sum(s.get(f"timing_s/{k}", 0.0) for s in timed), 3)
                                 for k in ("gen", "old_log_prob", "update_actor")},
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


def _versions_main() -> dict:
    from importlib.metadata import version

    return {"torch": torch.__version__, "megatron-core": version("megatron-core"),
            "python": sys.version.split()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (allocator, first-call costs)")
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads on both sides")
    ap.add_argument("--trl-python", default=os.path.join(REPO, ".venv-trl", "bin", "python"),
                    help="interpreter of the environment that has TRL (make bench-trl creates .venv-trl)")
    ap.add_argument("--trl-timeout", type=float, default=900.0, help="seconds before the TRL side is stopped")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if not os.access(args.trl_python, os.X_OK):
        ap.error(f"--trl-python {args.trl_python} is not executable; `make bench-trl` creates .venv-trl")

    out_dir = tempfile.mkdtemp(prefix="bench_vs_trl_")  # our checkpoint, the HF export, the TRL spec
    try:
        load = {"before_ours": os.getloadavg()[0]}
        ours, spec = run_ours(steps=args.steps, warmup=args.warmup, threads=args.threads, out_dir=out_dir)
        load["before_trl"] = os.getloadavg()[0]
        trl = run_trl(spec, python=args.trl_python, threads=args.threads, out_dir=out_dir,
                      timeout_s=args.trl_timeout)
        load["after_trl"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)

    rate = {name: {"sum": _rate(side), "median": statistics.median(_step_rates(side)),
                   "best": max(_step_rates(side)), "cpu": _rate(side, "cpu_seconds")}
            for name, side in (("ours", ours), ("trl", trl))}
    ratio = {k: rate["ours"][k] / rate["trl"][k] for k in rate["ours"]}
    tr = spec["train"]
    m = spec["model"]
    print(f"workload: {tr['prompts_per_step']} prompts x {tr['n']} completions/step, "
          f"<= {tr['max_new_tokens']} new tokens; Qwen2-shaped {m['num_layers']} layers, "
          f"hidden {m['hidden_size']}, "
          f"{m['num_attention_heads']}/{m['num_query_groups']} heads, FFN {m['ffn_hidden_size']}, "
          f"vocab {len(spec['vocab'])}, fp32, {args.threads} threads; "
          f"{args.warmup} warm-up + {args.steps} timed steps per side")
    print(f"params: ours {ours['params']:,}  TRL {trl['params']:,}; same initial weights "
          f"(probe logits max abs diff {trl['probe_logits_max_abs_diff']:.2g})")
    for name, side in (("ours", ours), ("TRL", trl)):
        r = rate[name.lower()]
        print(f"{name:>5}: {sum(side['tokens']):6d} tokens in {sum(side['seconds']):7.2f} s = "
              f"{r['sum']:7.1f} tokens/s (median step {r['median']:.1f}, best step {r['best']:.1f}, "
              f"per CPU-s {r['cpu']:.1f})")
        print(f"       s/step {' '.join(f'{s:.2f}' for s in side['seconds'])}")
    print(f"ours, seconds over the timed steps: {ours['stage_seconds']}")
    print(f"ratio ours/TRL: {ratio['sum']:.2f}x (goal >= {GOAL:g}x); median step {ratio['median']:.2f}x, "
          f"best step {ratio['best']:.2f}x, per CPU-s {ratio['cpu']:.2f}x")
    # The compute ceiling: each side runs every token through the model once while generating
    # (KV cache) and three times in the update (forward + backward), i.e. >= 8 x linear params FLOPs per
    # token. TRL's achieved rate against the machine's GEMM peak bounds what any trainer doing the same
    # work could reach: ceiling = peak / TRL's rate (TRL's padded positions are not counted: an upper bound).
    flops_per_token = 8 * _linear_params(m, len(spec["vocab"]))
    step_tokens = round(sum(trl["tokens"]) / len(trl["tokens"]))
    peak = _matmul_peak_gflops(m, step_tokens, args.threads)
    achieved = {name: flops_per_token * sum(side["tokens"]) / sum(side["seconds"]) / 1e9
                for name, side in (("ours", ours), ("trl", trl))}
    ceiling = peak / achieved["trl"]
    print(f"compute: >= {flops_per_token / 1e6:.1f} MFLOP per token; achieved ours {achieved['ours']:.1f}, "
          f"TRL {achieved['trl']:.1f} GFLOP/s; fp32 GEMM peak here {peak:.1f} GFLOP/s on these shapes "
          f"(M={step_tokens}) -> no trainer doing this work can beat TRL by more than {ceiling:.2f}x on this machine")
    trl_step = statistics.median(trl["seconds"])
    print(f"floor: {GOAL:g}x TRL means a step in {trl_step / GOAL:.3f} s; one plain HF forward + backward of a "
          f"step's batch (no generation, no optimizer) takes {trl['hf_fwd_bwd_s']:.3f} s here")
    print(f"1-min load average on {os.cpu_count()} cores: "
          + ", ".join(f"{k} {v:.1f}" for k, v in load.items()))
    versions = {"ours": _versions_main(), "trl_side": trl["versions"]}
    print(f"versions: {versions}")
    figures = {"bench": "vs_trl", "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
               "prompts_per_step": tr["prompts_per_step"], "n": tr["n"],
               "max_new_tokens": tr["max_new_tokens"], "ours_tokens_per_s": round(rate["ours"]["sum"], 1),
               "trl_tokens_per_s": round(rate["trl"]["sum"], 1),
               "ratio": round(ratio["sum"], 2), "goal": GOAL}
    for k in ("median", "best", "cpu"):
        figures |= {f"ours_{k}_tokens_per_s": round(rate["ours"][k], 1),
                    f"trl_{k}_tokens_per_s": round(rate["trl"][k], 1), f"{k}_ratio": round(ratio[k], 2)}
    figures |= {"ours_s_per_step": [round(x, 3) for x in ours["seconds"]],
                "trl_s_per_step": [round(x, 3) for x in trl["seconds"]],
                "ours_tokens": sum(ours["tokens"]), "trl_tokens": sum(trl["tokens"]),
                "ours_stage_seconds": ours["stage_seconds"], "params": ours["params"],
                "probe_logits_max_abs_diff": trl["probe_logits_max_abs_diff"], "cores": os.cpu_count(),
                "flops_per_token": flops_per_token, "ours_gflops": round(achieved["ours"], 1),
                "trl_gflops": round(achieved["trl"], 1), "gemm_peak_gflops": round(peak, 1),
                "ceiling_ratio": round(ceiling, 2), "trl_median_step_s": round(trl_step, 4),
                "hf_fwd_bwd_s": round(trl["hf_fwd_bwd_s"], 4),
                "load_avg_1min": {k: round(v, 2) for k, v in load.items()}, "versions": versions}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
