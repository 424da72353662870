"""TransferQueue throughput (put / claim / get / put_fields) and the queue trainer's step time against the
sync trainer on the tiny CPU config.

Queue part: the shapes of a DAPO run with 512-token responses. `PROMPTS` prompts are put in generation
batches of 24 (token ids and text), claimed 6 at a time (pending -> running, one transaction each),
their 4 trajectories each written in one transaction per claim (responses int64 [512], rollout
log-probs fp32 [512], small JSON fields) with the prompts marked done, then read back 16 groups at a
time (responses + log-probs) and given rm_scores with put_fields. Rates are keys per second.

Producer part: 1 and 4 producer processes claim prompts and write 1024-token trajectories at once;
trajectories per second and the latency of one group's write transaction (p50, p99).

Trainer part: `DAPOTrainer.fit` and the queue trainer (sync mode, and async mode with one producer
process) run `STEPS` steps of the tiny config in this process; the time per step is the mean of
`perf/time_per_step` over steps 2.. (step 1 pays one-off start-up costs). With 2 shared CPU cores
async mode cannot overlap much; the figure is for comparison across commits, not a speed claim.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_queue.py [--quick]

Prints human-readable lines, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
N, RESP, CLAIM, GEN_BATCH, READ_GROUPS = 4, 512, 6, 24, 16
TINY = ["data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
        "data.max_response_length=6", "reward.overlong_buffer.len=4", "algorithm.filter_groups.metric=seq_reward",
        "data.arithmetic.num_train=200", "data.arithmetic.num_val=8", "trainer.sft_warmup_steps=0",
        "trainer.test_freq=0", "trainer.val_before_train=false", "actor.lr=1e-3", "actor.adam_beta2=0.999",
        "trainer.logger=[tensorboard]",
        "trainer.save_freq=-1"]


def bench_queue(path: str, prompts: int) -> dict[str, float]:
    from megatron_dapo.queue import TransferQueue

    q = TransferQueue(path)
    gen = torch.Generator().manual_seed(0)
    keys = [f"p{i}@1.{i // GEN_BATCH}" for i in range(prompts)]
    t0 = time.perf_counter()
    for s in range(0, prompts, GEN_BATCH):
        chunk = keys[s:s + GEN_BATCH]
        q.put("train", chunk, {"prompts": [list(range(64))] * len(chunk), "raw_prompt": ["x" * 200] * len(chunk)})
    put_s = time.perf_counter() - t0

    claim_s = write_s = 0.0
    while True:
        t0 = time.perf_counter()
        meta = q.claim("train", CLAIM)
        claim_s += time.perf_counter() - t0
        if not len(meta):
            break
        tkeys = [f"{k}_{j}" for k in meta.keys for j in range(N)]
        fields = {"responses": torch.randint(0, 50_000, (len(tkeys), RESP), generator=gen),
                  "rollout_log_probs": -torch.rand(len(tkeys), RESP, generator=gen),
                  "finish_reason": ["stop"] * len(tkeys), "min_policy_version": [0] * len(tkeys)}
        t0 = time.perf_counter()
        with q.transaction():
            q.put("train", tkeys, fields, {"status": "done"})
            q.update_tags("train", meta.keys, status="done")
        write_s += time.perf_counter() - t0

    get_s = score_s = 0.0
    for s in range(0, prompts, READ_GROUPS):
        tkeys = [f"{k}_{j}" for k in keys[s:s + READ_GROUPS] for j in range(N)]
        t0 = time.perf_counter()
        q.get("train", tkeys, ["responses", "rollout_log_probs"])
        get_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        q.put_fields("train", tkeys, {"rm_scores": [1.0] * len(tkeys)})
        score_s += time.perf_counter() - t0
    q.close()
    traj = prompts * N
    return {"queue_put_prompts_per_s": prompts / put_s, "queue_claim_prompts_per_s": prompts / claim_s,
            "queue_write_trajectories_per_s": traj / write_s, "queue_get_trajectories_per_s": traj / get_s,
            "queue_put_fields_trajectories_per_s": traj / score_s, "queue_claims": prompts / CLAIM}


def _producer(path: str, producer: int, groups: int, resp: int, out, ready, go) -> None:
    """One producer process: claim one prompt at a time and write its N trajectories, timing each write."""
    from megatron_dapo.queue import TransferQueue

    q = TransferQueue(path)
    q.count("train")  # open the connection before the clock starts
    ready.put(producer)
    go.wait()
    gen = torch.Generator().manual_seed(producer)
    lat = []
    first = time.time()
    while len(lat) < groups:
        meta = q.claim("train", 1)
        if not len(meta):
            break
        tkeys = [f"{meta.keys[0]}_{j}" for j in range(N)]
        fields = {"responses": torch.randint(0, 50_000, (N, resp), generator=gen),
                  "rollout_log_probs": -torch.rand(N, resp, generator=gen)}
        t0 = time.perf_counter()
        with q.transaction():
            q.put("train", tkeys, fields, {"status": "done"})
            q.update_tags("train", meta.keys, status="done")
        lat.append(time.perf_counter() - t0)
    q.close()
    out.put((first, time.time(), lat))


def bench_producers(tmp: str, producers: int, groups_per_producer: int = 100, resp: int = 1024) -> dict[str, float]:
    """Trajectories of `resp` tokens written by `producers` processes at once: throughput and latency."""
    import multiprocessing as mp

    from megatron_dapo.queue import TransferQueue

    path = f"{tmp}/producers{producers}.sqlite"
    q = TransferQueue(path)
    total = producers * groups_per_producer
    q.put("train", [f"q{i}@1.0" for i in range(total)], {"prompts": [list(range(64))] * total})
    q.close()
    ctx = mp.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_producer, args=(path, i, groups_per_producer, resp, out, ready, go))
             for i in range(producers)]
    for pr in procs:
        pr.start()
    for _ in procs:  # all producers imported and connected: start together
        ready.get(timeout=600)
    go.set()
    results = [out.get(timeout=600) for _ in procs]
    # From the first claim to the last write (process start-up and imports excluded), wall-clock.
    wall = max(r[1] for r in results) - min(r[0] for r in results)
    lat = sorted(x for r in results for x in r[2])
    for pr in procs:
        pr.join()
    traj = len(lat) * N
    return {f"producers{producers}_trajectories_per_s": traj / wall,
            f"producers{producers}_write_latency_p50_ms": 1e3 * lat[len(lat) // 2],
            f"producers{producers}_write_latency_p99_ms": 1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))]}


def _step_time(run_dir: pathlib.Path) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    times = [e.value for e in acc.Scalars("perf/time_per_step") if e.step >= 2]
    return statistics.mean(times)


def bench_trainers(out: pathlib.Path, steps: int, with_async: bool) -> dict[str, float]:
    import logging

    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.run import run

    logging.disable(logging.INFO)
    cfg = lambda name, *extra: load_config(str(ROOT / "configs/tiny_cpu.yaml"), TINY + [  # noqa: E731
        f"trainer.output_dir={out}", f"trainer.experiment_name={name}", f"trainer.total_training_steps={steps}",
        *extra])
    figures = {}
    runs = [("sync_trainer", run, cfg("fit")), ("queue_trainer_sync", run, cfg("qsync", "queue.enable=true"))]
    if with_async:
        runs.append(("queue_trainer_async", run, cfg("qasync", "queue.enable=true", "queue.max_staleness=1")))
    for label, fn, c in runs:
        t0 = time.perf_counter()
        fn(c)
        figures[f"{label}_wall_s"] = time.perf_counter() - t0
        figures[f"{label}_step_s"] = _step_time(out / c.trainer.experiment_name)
    return figures


def main(argv: list[str]) -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--quick", action="store_true", help="fewer prompts and steps, no async run")
    a = args.parse_args(argv)
    prompts, steps = (240, 3) if a.quick else (1200, 6)
    with tempfile.TemporaryDirectory() as tmp:
        q = bench_queue(str(pathlib.Path(tmp) / "bench.sqlite"), prompts)
        print(f"queue ({prompts} prompts x {N} trajectories of {RESP} tokens, claims of {CLAIM}):")
        for k in ("put_prompts", "claim_prompts", "write_trajectories", "get_trajectories", "put_fields_trajectories"):
            print(f"  {k.replace('_', ' '):28s} {q[f'queue_{k}_per_s']:10.0f} /s")
        groups = 25 if a.quick else 100
        for producers in (1, 4):
            pr = bench_producers(tmp, producers, groups_per_producer=groups)
            q.update(pr)
            print(f"  {producers} producer process(es), 1024-token trajectories: "
                  f"{pr[f'producers{producers}_trajectories_per_s']:8.0f} /s, write latency p50 "
                  f"{pr[f'producers{producers}_write_latency_p50_ms']:.1f} ms, p99 "
                  f"{pr[f'producers{producers}_write_latency_p99_ms']:.1f} ms")
        t = bench_trainers(pathlib.Path(tmp), steps, with_async=not a.quick)
    print(f"trainer step time on the tiny config ({steps} steps, mean over steps 2..{steps}):")
    for label in ("sync_trainer", "queue_trainer_sync", "queue_trainer_async"):
        if f"{label}_step_s" in t:
            print(f"  {label:22s} {t[f'{label}_step_s'] * 1000:8.1f} ms/step   (whole run {t[f'{label}_wall_s']:.1f} s)")
    figures = {"prompts": prompts, "steps": steps, "threads": torch.get_num_threads(), **q, **t}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main(sys.argv[1:])
