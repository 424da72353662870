"""The sync trainer against the queue trainer's async mode on two real SGLang servers, long-tailed lengths.

Two SGLang 0.5.23 servers on this CPU (fp32, no radix cache, the CPU settings of tests/sglang_real) serve
a tiny random Qwen2 (tests/sglang_real/model.py); each configuration trains `STEPS` steps in this process
against them from the same start: the sync trainer (`fit`), then the queue trainer at queue.max_staleness
1 and 2, each with weight pushes into running generation (queue.partial_rollout: paused in place) and
with drained pushes (the producers' claims finish first). Response lengths are roughly geometric (a
random model at temperature 1 ends at EOS about once in 18 tokens; rollout.min_new_tokens 8) with a tail
to max_response_length (256). Dynamic sampling is off: every step trains 8 prompts x 4 responses.

Figures over steps 2.. (step 1 pays one-off costs):

    samples_per_s    trained responses / the steps' wall time (timing_s/step summed)
    idle_frac        the trainer waiting for rollouts: (timing_s/gen + hold_s) / timing_s/step (the sync
                     trainer generates while the actor waits: all of its generation time counts)
    push_s           the weight push per step (timing_s/weight_sync)
    hold_s           async: the wait around the push per step, for the pause in place or for the drain
                     (the running claims to finish: the long tail)
    lag_hist         rows by lag = the actor's version - the oldest version that made a token of the row
    span_frac        rows whose tokens came from two or more weight versions

On 2 cores the servers and the trainer share the CPU, so overlap is bounded by the machine; the figures
compare configurations on one machine, not a speed claim for GPUs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_async_sglang.py [--steps N]

Prints human-readable lines, then one JSON object. Needs `make sglang-env` (or $MEGATRON_DAPO_SGLANG_PYTHON).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_streaming_sglang import PROMPT, RESPONSE, SHAPE  # noqa: E402
from tests.sglang_real.conftest import cpu_server_overrides, free_port_pair, model_overrides  # noqa: E402

ASYNC_SHAPE = [*SHAPE, "algorithm.filter_groups.enable=false", "data.gen_batch_size=null", "actor.entropy_coeff=0.01"]
CONFIGS = (("sync", []),
           ("s1_inplace", ["queue.enable=true", "queue.max_staleness=1", "queue.partial_rollout=true"]),
           ("s1_drain", ["queue.enable=true", "queue.max_staleness=1", "queue.partial_rollout=false"]),
           ("s2_inplace", ["queue.enable=true", "queue.max_staleness=2", "queue.partial_rollout=true"]),
           ("s2_drain", ["queue.enable=true", "queue.max_staleness=2", "queue.partial_rollout=false"]))


def launch(model_dir: str, tokenizer_dir: str, log_dir: pathlib.Path):
    """Two CPU servers without radix cache through the trainer's own launch path; (servers, seconds)."""
    from megatron_dapo.config import load_config
    from megatron_dapo.rollout.sglang.build import sglang_launch_plan
    from megatron_dapo.rollout.sglang.server import launch_servers

    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        *model_overrides(model_dir, tokenizer_dir), *cpu_server_overrides(), *SHAPE, "trainer.n_gpus_per_node=2",
        f"rollout.server_base_port={free_port_pair()}", f"trainer.output_dir={log_dir}"])
    specs, launcher, env = sglang_launch_plan(cfg)
    specs = [dataclasses.replace(s, context_length=PROMPT + RESPONSE + 2,
                                 extra_args=(*s.extra_args, "--disable-radix-cache")) for s in specs]
    t0 = time.perf_counter()
    servers = launch_servers(specs, log_dir=log_dir, timeout_s=600, launcher=launcher, env=env)
    return servers, time.perf_counter() - t0


def figures_of(run_dir: pathlib.Path, dumps: pathlib.Path, steps: int) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    s = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    later = range(2, steps + 1)
    step_s = sum(s["timing_s/step"][k] for k in later)
    gen_s = sum(s["timing_s/gen"].get(k, 0.0) for k in later)
    sync_s = sum(s["timing_s/weight_sync"][k] for k in later)
    push = s.get("timing_s/weight_sync_paused", {})
    hold_s = sum(push[k] for k in later) - sync_s if push else 0.0  # waiting for the pause or the drain
    rows = [json.loads(x) for k in later for x in (dumps / f"step_{k}.jsonl").read_text().splitlines()]
    steps_of = [k for k in later for _ in (dumps / f"step_{k}.jsonl").read_text().splitlines()]
    lags = collections.Counter((k - 1) - r.get("min_policy_version", r["policy_version"])
                               for k, r in zip(steps_of, rows, strict=True))
    spans = sum(r.get("min_policy_version", r["policy_version"]) != r["policy_version"] for r in rows)
    return {"samples_per_s": len(rows) / step_s, "step_s": step_s / len(later), "idle_frac": (gen_s + hold_s) / step_s,
            "push_s": sync_s / len(later), "hold_s": hold_s / len(later),
            "lag_hist": {str(k): v for k, v in sorted(lags.items())}, "span_frac": spans / len(rows),
            "mean_len": sum(s["response_length/mean"][k] for k in later) / len(later),
            "max_len": max(s["response_length/max"][k] for k in later)}


def bench(out: pathlib.Path, steps: int) -> dict:
    import logging

    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.run import run
    from tests.sglang_real.model import write_tiny_qwen2

    logging.disable(logging.INFO)
    model_dir, tokenizer_dir = write_tiny_qwen2(str(out / "model"))
    servers, start_s = launch(model_dir, tokenizer_dir, out / "servers")
    results: dict = {"server_start_s": start_s}
    try:
        urls = ",".join(s.url for s in servers)
        for label, more in CONFIGS:
            dumps = out / f"dumps_{label}"
            cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
                *model_overrides(model_dir, tokenizer_dir), *ASYNC_SHAPE, "model.params_dtype=fp32",
                f"rollout.sglang_urls=[{urls}]", f"data.max_response_length={RESPONSE}", f"trainer.output_dir={out}",
                f"trainer.experiment_name={label}", f"trainer.total_training_steps={steps}",
                f"trainer.rollout_data_dir={dumps}", *more])
            t0 = time.perf_counter()
            run(cfg)
            results[label] = {"wall_s": time.perf_counter() - t0, **figures_of(out / label, dumps, steps)}
    finally:
        for s in servers:
            s.stop()
    return results


def main(argv: list[str]) -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--steps", type=int, default=12)
    a = args.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        f = bench(pathlib.Path(tmp), a.steps)
    print(f"2 real SGLang 0.5.23 CPU servers (up in {f['server_start_s']:.0f} s), random tiny Qwen2, responses "
          f"<= {RESPONSE} tokens, 8 prompts x 4 per step, {a.steps} steps, figures over steps 2..{a.steps}:")
    print(f"  {'trainer':11s} {'samples/s':>9s} {'vs sync':>8s} {'step s':>7s} {'idle':>6s} {'push s':>7s} "
          f"{'hold s':>7s} {'mean len':>9s} {'spanning':>9s}  lag histogram (rows)")
    base = f["sync"]["samples_per_s"]
    for label, _ in CONFIGS:
        r = f[label]
        print(f"  {label:11s} {r['samples_per_s']:9.2f} {r['samples_per_s'] / base:7.2f}x {r['step_s']:7.2f} "
              f"{r['idle_frac']:6.2f} {r['push_s']:7.2f} {r['hold_s']:7.2f} {r['mean_len']:9.1f} "
              f"{r['span_frac']:9.2f}  {r['lag_hist']}")
    print(json.dumps({"steps": a.steps, "response_length": RESPONSE, **{
        k: ({kk: round(vv, 4) if isinstance(vv, float) else vv for kk, vv in v.items()} if isinstance(v, dict)
            else round(v, 4)) for k, v in f.items()}}))


if __name__ == "__main__":
    main(sys.argv[1:])
