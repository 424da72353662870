"""The queue trainer's SGLang producers at the recipe's volume: what one generation batch's client work costs
the training process (async mode on SGLang).

A replay server in its own process (bench_rank0.ReplayServer: SGLang 0.5.23's exact wire format, lognormal
response lengths of mean `--mean-len` capped at `--max-len`, replies spread over a generation window of
`--window-s-full` x rows / 24,576 seconds) serves a generation batch of `rows` / 16 prompts, put pending in
a real TransferQueue (SQLite) as the trainer issues them. The trainer's producers generate it: claims of
`queue.claim_prompts` (64) prompts, as many threads as `queue.num_producers=0` starts (a generation batch in
flight), each claim scored by the reward stage (the project's RewardManager with a parity reward, the HF
fast tokenizer's decode) and written to the queue. `--where`:

- `process`: the trainer's path, `ProducerProcess` (trainer/server_producers.py): the threads, a follower of
  rank 0's engine and the reward stage in a process beside the training process;
- `threads`: the path before it, `ServerProducers` threads inside the training process over rank 0's engine.

Per size it prints the CPU seconds of the training process's threads other than its main thread (this
process: the producers' client work, reward and queue writes with `threads`; with `process`, the two
threads that send the servers' states and read the process's reports) as `gil_s_in_trainer` (Python holds
the GIL for nearly all of it), the producer process's own CPU seconds, the seconds from the start to the
last group written (the generation window plus the process's start), and the training process's peak
resident memory. It
ends with one JSON line, the figures extrapolated linearly in rows to 24,576 (`measured`: each size).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_queue_producers.py [--rows 1536 3072] [--where process]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_rank0 import (  # noqa: E402
    EOS,
    FULL_ROWS,
    PROMPT_LEN,
    N,
    check_sizes,
    extrapolate,
    prompt_ids,
    size_arguments,
)

REWARD = '''
def parity(data_source, solution_str, ground_truth, extra_info=None):
    ok = solution_str.count("7") % 2 == 0  # about half the rows right: most groups informative
    return {"score": float(ok), "acc": ok}
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rows: int, args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    window = args.window_s_full * rows / FULL_ROWS
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    server = subprocess.Popen([sys.executable, str(ROOT / "benchmarks/bench_rank0.py"), "--serve", str(port), str(rows),
                               str(args.mean_len), str(args.sigma), str(args.max_len), str(window)], env=env)
    deadline = time.monotonic() + 900  # the server builds every reply before it listens
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("the replay server did not start") from None
            time.sleep(0.1)


def _config(out: str, max_len: int):
    from megatron_dapo.config import load_config
    from tests.sglang_real.model import write_char_tokenizer

    write_char_tokenizer(os.path.join(out, "tokenizer"))  # an HF fast tokenizer, as the recipe's
    pathlib.Path(out, "reward.py").write_text(REWARD)
    return load_config(overrides=[f"data.tokenizer={out}/tokenizer", f"data.max_response_length={max_len}",
                                  f"actor.max_tokens_per_microbatch={PROMPT_LEN + max_len}",
                                  f"data.max_prompt_length={PROMPT_LEN}",
                                  f"reward.custom_function.path={out}/reward.py", "reward.custom_function.name=parity"])


def _run(rows: int, args) -> dict:
    from benchmarks._peak_rss import PeakRSS
    from megatron_dapo.queue import TransferQueue
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.sglang.engine import SGLangEngine
    from megatron_dapo.trainer.queue_trainer import TRAIN, producer_layout
    from megatron_dapo.trainer.server_producers import ProducerProcess, ServerProducers

    prompts = rows // N
    server, url = _serve(rows, args)
    try:
        with tempfile.TemporaryDirectory() as out:
            cfg = _config(out, args.max_len)
            num, claim = producer_layout(cfg.queue, gen_batch=prompts, on_servers=True)
            queue = TransferQueue(os.path.join(out, "queue.sqlite"))
            keys = [f"q{i}@1.0" for i in range(prompts)]
            queue.put(TRAIN, keys, {"prompts": [prompt_ids(i) for i in range(prompts)], "seed": [None] * prompts,
                                    "ground_truth": ["even"] * prompts, "data_source": ["synthetic"] * prompts,
                                    "extra_info": [{}] * prompts},
                      {"global_steps": 1})
            sampling = SamplingParams(max_new_tokens=args.max_len, n=N, temperature=1.0, stop_token_ids=(EOS,))
            engine = SGLangEngine([url], max_concurrency=prompts, max_batch_size=N, health_check_interval_s=3600,
                                  request_timeout_s=3600)
            if args.where == "threads":
                from megatron_dapo.data.tokenizer import load_tokenizer
                from megatron_dapo.rewards.build import build_reward_manager
                from megatron_dapo.trainer.claim_reward import ClaimScorer

                rewards = build_reward_manager(cfg)
                producers = ServerProducers(queue.path, engine, sampling=sampling, num=num, claim_size=claim,
                                            scorer=ClaimScorer(load_tokenizer(cfg.data.tokenizer), rewards))
            else:
                rewards = None
                producers = ProducerProcess(queue, engine, sampling=sampling, num=num, claim_size=claim,
                                            global_steps=lambda: 1, cfg=cfg)
            import gc

            gc.collect()
            rss = PeakRSS(0.5).start()  # seldom: its own samples count as the trainer's CPU
            cpu0, main0 = _cpu_s(), time.thread_time()
            t0 = time.monotonic()
            producers.start()
            done_at = {}
            while len(done_at) < prompts:  # the trainer's wait for done groups (queue_collect)
                time.sleep(0.05)
                for k in queue.list_keys(TRAIN, is_prompt=True, status="done"):
                    done_at.setdefault(k, time.monotonic())
                if hasattr(producers, "process"):
                    producers.check()
            end = max(done_at.values())
            trainer_cpu = _cpu_s() - cpu0 - (time.thread_time() - main0)
            producer_cpu = trainer_cpu
            if hasattr(producers, "process"):
                import psutil

                t = psutil.Process(producers.process.pid).cpu_times()
                producer_cpu = t.user + t.system + t.children_user + t.children_system
            peak = rss.stop()
            producers.close()
            if rewards is not None:
                rewards.close()
            engine.close()
            written = queue.count(TRAIN, is_prompt=False)
            queue.close()
    finally:
        server.kill()
        server.wait()
    assert written == rows, f"{written} trajectories written of {rows}"
    return {"rows": rows, "producers": num, "claim_prompts": claim, "where": args.where,
            "window_s": round(args.window_s_full * rows / FULL_ROWS, 1), "generation_s": round(end - t0, 1),
            "gil_s_in_trainer": round(trainer_cpu, 2), "producer_cpu_s": round(producer_cpu, 2),
            "trainer_peak_gib": round(peak / 2**30, 3)}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size_arguments(p, [1536, 3072], "generated rows at each of the two sizes")
    p.add_argument("--where", choices=("process", "threads"), default="process")
    p.add_argument("--window-s-full", type=float, default=1200.0,
                   help="generation window at 24,576 rows (seconds); scaled to each size")
    args = p.parse_args()
    check_sizes(p, args.rows)
    measured = []
    for rows in args.rows:
        r = _run(rows, args)
        print(f"{rows} rows ({args.where}): client CPU in the training process {r['gil_s_in_trainer']} s, producer "
              f"CPU {r['producer_cpu_s']} s, generation {r['generation_s']} s, trainer peak "
              f"{r['trainer_peak_gib']} GiB", flush=True)
        measured.append(r)
    a, b = measured
    full = {k: extrapolate(a, b, k) for k in ("gil_s_in_trainer", "producer_cpu_s")}
    print(json.dumps({"trainer": "queue", "where": args.where, "rows": FULL_ROWS, "mean_response_tokens": args.mean_len,
                      "max_len": args.max_len, "prompt_len": PROMPT_LEN, **full, "measured": measured,
                      "extrapolated_from": args.rows}))


if __name__ == "__main__":
    main()
