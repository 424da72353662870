"""Rank 0 at the recipe's volume, queue trainer (async mode): the serial seconds of one local update, from
the moment its groups are done in the queue to the training batch on every rank, on 4 gloo processes.

The recipe's update trains 512 prompts x 16 = 8,192 rows out of a 1,536-prompt generation batch (24,576
rows, responses up to 20,480 tokens, lognormal lengths of mean `--mean-len` as in bench_rank0.py). This
runs a stated fraction (`--rows`: generated rows, two sizes, a third of the prompts trained), fitted linear
in rows and extrapolated to 24,576.

Set-up (not timed: the producers' work, beside generation): rank 0 fills a real TransferQueue (SQLite) with
the generation batch's prompts and lets the trainer's own `Producer` claim them in claims of 64 prompts,
"generate" them with an engine that returns the lengths' synthetic samples, and write them (trajectories in
the project's codec; with the reward stage in the producer, scored before the write as the trainer's
producers do). What each rank then times is the trainer's own code, `QueueTrainer._next_batch` through
`_rank0` (rank 0: the done groups, reward where the trainer still scores, dynamic sampling, the batch read
back from the queue; the result reaching every rank) and the dense training batch on every rank
(`_share_batch`, or the `to_dense` of a trainer that pickles the whole batch). The trainer object is made
without its actor (`QueueTrainer.__new__` and the attributes these methods read): nothing here trains.

It prints per phase the serial seconds (each phase ends when the last rank is through it), the producers'
reward seconds per claim (`reward_s_in_producers`: work that runs beside generation, in the producer
threads of rank 0's process on SGLang), peak resident memory per rank and bytes between ranks, and ends
with one JSON line (`serial_s_per_update`, `rank0_peak_gib`, `other_rank_peak_gib`, `reward_s_in_producers`
extrapolated to 24,576 generated rows; `measured`: each size). The step's commit (the consumed prompts'
fates, one transaction on rank 0 while the other ranks wait) is timed as the last phase.

`--r3 LAYERS TOP_K EXPERTS` (actor.router_replay=r3): every sample carries its routing (uint8 [LAYERS,
prompt + response - 1, TOP_K], random ids below EXPERTS) and the producer writes it into the queue with its
claim; it then prints the producers' seconds writing claims (`write_s_in_producers`, beside generation) and
the queue's bytes per generated row, and rank 0 reads the trained rows' routing back with the batch and drops
the consumed groups' at the commit. (The routing's send to the ranks that train each row is the sync
trainer's, bench_replay_routing.py.) At the MoE recipe's 48 x 8 ids a token that is ~2.5 MB a row at a 6k
mean: run it at a smaller --mean-len on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_queue_rank0.py [--rows 1536 3072] [--mean-len 6000]
        [--r3 LAYERS TOP_K EXPERTS]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_rank0 import (  # noqa: E402
    EOS,
    FULL_ROWS,
    WORLD,
    N,
    _count_wire,
    check_sizes,
    extrapolate,
    extrapolate_phases,
    prompt_ids,
    row_lengths,
    size_arguments,
    timed_into,
)

CLAIM = 64
PHASES = ("rank0_batch", "train_batch", "commit")


class LengthsEngine:
    """Samples of the given lengths (char-vocabulary tokens, stop at EOS unless capped): what a producer's
    engine call returns, without a server (generation is not part of the timed update)."""

    def __init__(self, lengths: dict[tuple[int, ...], list[int]], max_len: int, r3: tuple[int, int, int] | None):
        self.lengths, self.max_len, self.r3, self.policy_version = lengths, max_len, r3, 0

    def generate(self, prompts, sampling):
        import torch

        from megatron_dapo.rollout.base import Sample

        out = []
        for p in prompts:
            rng = random.Random(hash(p.token_ids) & 0xFFFF)
            for j, L in enumerate(self.lengths[p.token_ids]):
                toks = [rng.randrange(3, 18) for _ in range(L)]
                finish = "length" if L == self.max_len else "stop"
                if finish == "stop":
                    toks[-1] = EOS
                routing = None
                if self.r3:
                    layers, top_k, experts = self.r3
                    routing = torch.randint(0, experts, (layers, len(p.token_ids) + L - 1, top_k), dtype=torch.uint8)
                out.append(Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids,
                                  response_token_ids=tuple(toks), rollout_log_probs=tuple(-0.5 for _ in toks),
                                  finish_reason=finish, policy_version=0, routed_experts=routing))
        return out


def parity_reward(solution_str, ground_truth):  # about half the rows right: most groups informative
    ok = solution_str.count("7") % 2 == 0
    return {"score": float(ok), "acc": ok}


def _fill_queue(path: str, rows: int, args, tokenizer, rm) -> dict:
    """Rank 0, untimed: the generation batch's groups done in the queue, as the producers leave them."""
    from megatron_dapo.queue import TransferQueue
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.trainer import producer as producer_mod
    from megatron_dapo.trainer.queue_trainer import TRAIN

    prompts = rows // N
    lengths = row_lengths(rows, args.mean_len, args.sigma, args.max_len)
    by_prompt = {tuple(prompt_ids(i)): lengths[i * N:(i + 1) * N] for i in range(prompts)}
    q = TransferQueue(path)
    q.create_partition(TRAIN)
    keys = [f"q{i}@1.0" for i in range(prompts)]
    q.put(TRAIN, keys, {"prompts": [prompt_ids(i) for i in range(prompts)], "raw_prompt": ["q"] * prompts,
                        "ground_truth": ["even"] * prompts, "data_source": ["synthetic"] * prompts,
                        "uid": [f"q{i}" for i in range(prompts)], "seed": [1] * prompts}, {"global_steps": 1})
    sampling = SamplingParams(max_new_tokens=args.max_len, n=N, temperature=1.0, stop_token_ids=(EOS,))
    kwargs = {}
    scored_in_producer = "scorer" in inspect.signature(producer_mod.Producer).parameters
    if scored_in_producer:
        from megatron_dapo.trainer.claim_reward import ClaimScorer

        kwargs["scorer"] = ClaimScorer(tokenizer, rm)
    if args.r3:
        kwargs["routing"] = True
    producer = producer_mod.Producer(q, LengthsEngine(by_prompt, args.max_len, args.r3), sampling=sampling,
                                     producer_id="bench", **kwargs)
    reward_s, write_s = [0.0], [0.0]
    if scored_in_producer:
        kwargs["scorer"].score = timed_into(kwargs["scorer"].score, reward_s)
    producer._write = timed_into(producer._write, write_s)
    while producer.run_once(CLAIM):
        pass
    q.close()
    from megatron_dapo.queue.spool import spool_dir

    db = sum(os.path.getsize(path + suffix) for suffix in ("", "-wal") if os.path.exists(path + suffix))
    if os.path.isdir(spool_dir(path)):  # R3: the routing files beside it
        db += sum(e.stat().st_size for e in os.scandir(spool_dir(path)))
    return {"reward_s_in_producers": reward_s[0], "scored_in_producer": scored_in_producer,
            "write_s_in_producers": write_s[0], "queue_bytes_per_row": db / rows}


def _worker(out: str, rows: int, args) -> None:
    import gc

    import torch.distributed as dist

    from benchmarks._peak_rss import PeakRSS
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.metrics import StageTimer
    from megatron_dapo.queue import TransferQueue
    from megatron_dapo.rewards.manager import RewardManager
    from megatron_dapo.trainer.queue_trainer import QueueTrainer

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    prompts = rows // N
    tokenizer = load_tokenizer(os.path.join(out, "tokenizer"))
    qpath = os.path.join(out, "queue.sqlite")
    with RewardManager(parity_reward, max_response_length=args.max_len, timeout_s=0) as rm:
        fill = _fill_queue(qpath, rows, args, tokenizer, rm) if rank == 0 else {}
        try:
            from megatron_dapo.trainer.run import freeze_startup_objects

            freeze_startup_objects()
        except ImportError:
            pass
        wire = {"bytes": 0}
        _count_wire(wire)
        t = QueueTrainer.__new__(QueueTrainer)  # the methods below, without an actor (module docstring)
        t.cfg = SimpleNamespace(
            algorithm=SimpleNamespace(filter_groups=SimpleNamespace(enable=True, metric="acc", max_num_gen_batches=0,
                                                                     on_exhausted="raise")),
            queue=SimpleNamespace(max_staleness=1, stale_policy="drop"), actor=SimpleNamespace(ppo_mini_batch_size=1),
            data=SimpleNamespace(max_response_length=args.max_len))
        t.p = SimpleNamespace(tokenizer=tokenizer, reward_manager=rm, pgs=SimpleNamespace(ctrl=group))
        t.sync_mode, t.P, t.n, t.tbs, t.gbs, t.world, t.is_rank0 = False, 1, N, prompts // 3, prompts, WORLD, rank == 0
        t.r3 = bool(args.r3)
        t.queue = TransferQueue(qpath) if rank == 0 else None
        t.policy_version, t._pool, t._filtered, t._seen, t._stale_dropped = 0, [], [], set(), 0
        t._reward_keys, t._last_issue, t._row_info, t._held, t._min_versions = (), None, False, None, None
        t.producers, t.pool = SimpleNamespace(check=lambda: None), None
        t._top_up = lambda step: None  # the generation batch is in the queue already
        gc.collect()
        dist.barrier(group=group)
        rss = PeakRSS(0.005).start()
        marks = {"start": time.time()}
        keys, batch, min_versions, _ = t._rank0(lambda: t._next_batch(1, StageTimer(), first=True))
        marks["rank0_batch"] = time.time()
        if hasattr(t, "_share_batch"):
            batch = t._share_batch(batch)
        else:  # a trainer that pickles the whole batch to every rank
            import dataclasses

            from megatron_dapo.rollout.ragged import to_dense

            batch = dataclasses.replace(batch, rollout=to_dense(batch.rollout))
        marks["train_batch"] = time.time()
        t._rank0(lambda: t._commit(1, keys, last=False))
        marks["commit"] = time.time()
        peak = rss.stop()
    result = {"rank": rank, "peak_gib": peak / 2**30, "marks": marks, "wire_bytes": wire["bytes"],
              "train_rows": len(batch.rollout), "train_tokens": int(batch.rollout.response_length.sum()), **fill}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier(group=group)
    if t.queue is not None:
        t.queue.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rows: int, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as out:
        from tests.sglang_real.model import write_char_tokenizer

        write_char_tokenizer(os.path.join(out, "tokenizer"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr",
               "127.0.0.1", "--master_port", str(_free_port()), __file__, "--worker", out, str(rows),
               str(args.mean_len), str(args.sigma), str(args.max_len), ",".join(map(str, args.r3 or ()))]
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=7200)
        if r.returncode:
            sys.exit(r.stdout[-4000:] + r.stderr[-4000:])
        ranks = [json.loads(pathlib.Path(out, f"rank{k}.json").read_text()) for k in range(WORLD)]
    phases, prev = {}, min(rk["marks"]["start"] for rk in ranks)
    start = prev
    for name in PHASES:
        end = max(rk["marks"][name] for rk in ranks)
        phases[name] = round(end - prev, 3)
        prev = end
    return {"rows": rows, "train_rows": ranks[0]["train_rows"], "train_tokens": ranks[0]["train_tokens"],
            "serial_s_per_update": round(prev - start, 3), "phases_s": phases,
            "reward_s_in_producers": round(ranks[0]["reward_s_in_producers"], 2),
            "write_s_in_producers": round(ranks[0]["write_s_in_producers"], 2),
            "queue_bytes_per_row": round(ranks[0]["queue_bytes_per_row"]),
            "scored_in_producer": ranks[0]["scored_in_producer"],
            "rank0_peak_gib": round(ranks[0]["peak_gib"], 3),
            "other_rank_peak_gib": round(max(rk["peak_gib"] for rk in ranks[1:]), 3),
            "wire_bytes_rank0": ranks[0]["wire_bytes"]}


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        out, rows, mean_len, sigma, max_len, r3 = sys.argv[2:8]
        _worker(out, int(rows), SimpleNamespace(mean_len=int(mean_len), sigma=float(sigma), max_len=int(max_len),
                                                r3=tuple(map(int, r3.split(","))) if r3 else None))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size_arguments(p, [1536, 3072], "two generated sizes (multiples of 16)")
    p.add_argument("--r3", type=int, nargs=3, metavar=("LAYERS", "TOP_K", "EXPERTS"),
                   help="every row carries R3 routing of this layout (e.g. 48 8 128), written to and read from the "
                        "queue")
    args = p.parse_args()
    check_sizes(p, args.rows)
    figures = []
    for rows in args.rows:
        f = _run(rows, args)
        figures.append(f)
        print(f"{rows} generated rows, {f['train_rows']} trained ({f['train_tokens']:,} tokens): serial per update "
              f"{f['serial_s_per_update']} s {f['phases_s']}; reward in the producers {f['reward_s_in_producers']} s "
              f"(scored there: {f['scored_in_producer']}), writes {f['write_s_in_producers']} s, queue "
              f"{f['queue_bytes_per_row'] / 1024:.1f} KiB a row; peak rank 0 {f['rank0_peak_gib']} GiB, others "
              f"{f['other_rank_peak_gib']} GiB; wire rank 0 {f['wire_bytes_rank0'] / 2**20:.0f} MiB", flush=True)
    a, b = figures
    full = {k: extrapolate(a, b, k) for k in ("serial_s_per_update", "rank0_peak_gib", "other_rank_peak_gib",
                                               "reward_s_in_producers", "write_s_in_producers")}
    phases = extrapolate_phases(a, b, PHASES)
    print(f"extrapolated to {FULL_ROWS} generated rows: {full}, phases {phases}")
    print(json.dumps({"trainer": "queue", "rows": FULL_ROWS, "mean_response_tokens": args.mean_len, "r3": args.r3,
                      "max_len": args.max_len, **full, "phases_s": phases,
                      "extrapolated_from": [f["rows"] for f in figures], "measured": figures}))


if __name__ == "__main__":
    main()
