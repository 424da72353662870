"""Streaming dynamic sampling on real SGLang servers, off against on, at a long-tailed length distribution.

Two SGLang 0.5.23 servers on this CPU (fp32, the venv of `make sglang-env`, the CPU settings of
tests/sglang_real) serve a tiny random Qwen2 (tests/sglang_real/model.py); the trainer runs `STEPS`
steps of `DAPOTrainer.fit` in this process against them (rollout.sglang_urls), once without and once
with algorithm.filter_groups.streaming, from the same start. A random model at temperature 1 ends a
response at EOS about once in 18 tokens, so lengths are roughly geometric (mean ~18) with a tail to
max_response_length (256; rollout.min_new_tokens 8): without streaming every generation batch waits for
its longest group. Dynamic sampling on seq_reward with an overlong buffer of 240 tokens (a penalty
from 16 tokens on), so most groups are informative and the step needs far fewer than a batch.
Figures are means over steps 2.. (step 1 pays one-off costs):

    gen_tokens_per_trained_token  every response token generated / response tokens trained on
    step_s, gen_s                 perf/time_per_step and timing_s/gen
    cut_groups                    groups streaming cut per step
    kept_len, finished_len        mean response length of the trained rows / of every finished row

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_streaming_sglang.py [--steps N]

Prints human-readable lines, then one JSON object. Needs `make sglang-env` (or $MEGATRON_DAPO_SGLANG_PYTHON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_streaming import _means  # noqa: E402
from tests.sglang_real.conftest import cpu_server_overrides, free_port_pair, model_overrides  # noqa: E402

PROMPT, RESPONSE = 24, 256
SHAPE = ["rollout.engine=sglang", "rollout.mode=disaggregate", "rollout.require_memory_saver=false",
         "trainer.sft_warmup_steps=0", "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=-1",
         "trainer.logger=[tensorboard]", "data.arithmetic.num_train=2000", "data.arithmetic.num_val=8",
         f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}", "rollout.min_new_tokens=8",
         "rollout.temperature=1.0", "rollout.top_k=4", "data.train_batch_size=8", "data.gen_batch_size=32", "rollout.n=4",
         "actor.ppo_mini_batch_size=8", "algorithm.filter_groups.metric=seq_reward",
         "reward.overlong_buffer.len=240", "actor.lr=1e-6", "rollout.weight_sync_bucket_mb=1"]


def launch(model_dir: str, tokenizer_dir: str, log_dir: pathlib.Path):
    """Two CPU servers through the trainer's own launch path; returns (servers, seconds to start)."""
    from megatron_dapo.config import load_config
    from megatron_dapo.rollout.sglang.build import sglang_launch_plan
    from megatron_dapo.rollout.sglang.server import launch_servers

    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        *model_overrides(model_dir, tokenizer_dir), *cpu_server_overrides(), *SHAPE, "trainer.n_gpus_per_node=2",
        f"rollout.server_base_port={free_port_pair()}", f"trainer.output_dir={log_dir}"])
    specs, launcher, env = sglang_launch_plan(cfg)
    t0 = time.perf_counter()
    servers = launch_servers([dataclasses.replace(s, context_length=PROMPT + RESPONSE + 2) for s in specs],
                             log_dir=log_dir, timeout_s=600, launcher=launcher, env=env)
    return servers, time.perf_counter() - t0


def bench(out: pathlib.Path, steps: int) -> dict[str, float]:
    import logging

    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.run import run
    from tests.sglang_real.model import write_tiny_qwen2

    logging.disable(logging.INFO)
    model_dir, tokenizer_dir = write_tiny_qwen2(str(out / "model"))
    servers, start_s = launch(model_dir, tokenizer_dir, out / "servers")
    figures = {"server_start_s": start_s}
    try:
        urls = ",".join(s.url for s in servers)
        for label, streaming in (("off", "false"), ("on", "true")):
            cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
                *model_overrides(model_dir, tokenizer_dir), *SHAPE, "model.params_dtype=fp32",
                f"rollout.sglang_urls=[{urls}]", f"data.max_response_length={RESPONSE}",
                f"trainer.output_dir={out}", f"trainer.experiment_name=streaming_{label}",
                f"trainer.total_training_steps={steps}", f"algorithm.filter_groups.streaming={streaming}"])
            t0 = time.perf_counter()
            run(cfg)
            figures[f"{label}_wall_s"] = time.perf_counter() - t0
            figures.update({f"{label}_{k}": v for k, v in _means(out / f"streaming_{label}").items()})
    finally:
        for s in servers:
            s.stop()
    return figures


def main(argv: list[str]) -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--steps", type=int, default=5)
    a = args.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        f = bench(pathlib.Path(tmp), a.steps)
    print(f"2 real SGLang 0.5.23 CPU servers (up in {f['server_start_s']:.0f} s), random tiny Qwen2, responses "
          f"<= {RESPONSE} tokens, {a.steps} steps, means over steps 2..{a.steps}:")
    print(f"  {'streaming':10s} {'gen tok/trained tok':>20s} {'step s':>8s} {'gen s':>8s} {'cut groups':>11s} "
          f"{'kept len':>9s} {'finished len':>13s} {'gen batches':>12s}")
    for label in ("off", "on"):
        print(f"  {label:10s} {f[f'{label}_gen_tokens_per_trained_token']:20.3f} {f[f'{label}_step_s']:8.2f} "
              f"{f[f'{label}_gen_s']:8.2f} {f[f'{label}_cut_groups']:11.1f} {f[f'{label}_kept_len']:9.2f} "
              f"{f[f'{label}_finished_len']:13.2f} {f[f'{label}_gen_batches']:12.2f}")
    figures = {"steps": a.steps, "response_length": RESPONSE, **f}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main(sys.argv[1:])
