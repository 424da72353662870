"""Host memory per rank of one generation batch through generate -> score -> dynamic sampling, on 4 gloo
processes, as the sync trainer runs it against SGLang (rank 0 drives the engine, rollout/rank0.py).

Rank 0's engine returns synthetic samples with a long-tailed length distribution (lognormal, median
500 tokens, sigma 1, capped at --max-len = max_response_length: about 5 % reach the cap), random tokens
and log-probs. Each rank then runs the trainer's own stages: `stages.generate` (the batch reaches every
rank), `stages.score` (each rank decodes and scores its share of the rows, results all-gathered) and
`GroupBuffer.add` (dynamic sampling keeps the informative groups). A thread samples the process's
resident memory every 2 ms; the figure is its peak above the resident memory just before generation.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_host_memory.py [--rows 512 2048] [--max-len 4096]

Per batch size it prints each rank's peak in MiB beside two references: `dense_mib`, what a [rows,
max_len] int64 + float32 + float32 (tokens, log-probs, mask) copy of the batch takes, and
`real_mib`, the same for the real tokens only; then one JSON object. Rank 0 also holds the engine's
Python samples (its own row); ranks 1 to 3 show what the data path itself costs a trainer rank.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORLD, N, VOCAB = 4, 16, 64


def _worker(out: str, rows: int, max_len: int) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks._peak_rss import PeakRSS
    from megatron_dapo.data.dataset import PromptRecord
    from megatron_dapo.rewards.manager import RewardManager
    from megatron_dapo.rollout.base import RolloutEngine, Sample, SamplingParams
    from megatron_dapo.rollout.rank0 import RankZeroEngine
    from megatron_dapo.trainer import stages
    from megatron_dapo.trainer.dynamic_sampling import GroupBuffer

    class LongTailEngine(RolloutEngine):
        """Synthetic responses: lognormal lengths capped at the limit, random tokens (rank 0 only)."""

        def generate(self, prompts, sampling):
            g = torch.Generator().manual_seed(7)
            lengths = torch.exp(torch.randn(len(prompts) * sampling.n, generator=g) + torch.log(torch.tensor(500.0)))
            lengths = lengths.clamp(1, sampling.max_new_tokens).long().tolist()
            out, k = [], 0
            for p in prompts:
                for j in range(sampling.n):
                    L = lengths[k]
                    k += 1
                    toks = torch.randint(2, VOCAB, (L,), generator=g).tolist()
                    out.append(Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids,
                                      response_token_ids=tuple(toks), rollout_log_probs=tuple([-0.5] * L),
                                      finish_reason="length" if L == sampling.max_new_tokens else "stop",
                                      policy_version=0))
            return out

        def update_weights(self, named_tensors=None, *, policy_version, **kw):
            pass

        def abort(self):
            pass

        def release_memory(self):
            pass

        def resume_memory(self):
            pass

        def health(self):
            return {}

        @property
        def policy_version(self):
            return 0

    class CharTokenizer:
        pad_id, eos_id, vocab_size = 0, 1, VOCAB

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    def last_char_reward(solution_str, ground_truth):
        return {"score": float(solution_str[-1:] == ground_truth), "acc": solution_str[-1:] == ground_truth}

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    engine = RankZeroEngine(LongTailEngine() if rank == 0 else None, rank=rank, world_size=WORLD, group=group)
    records = [PromptRecord(uid=f"q{i}", prompt_ids=list(range(2, 2 + 64 + i % 64)), raw_prompt="q",
                            ground_truth="abcd"[i % 4], data_source="synthetic") for i in range(rows // N)]
    sampling = SamplingParams(max_new_tokens=max_len, n=N, temperature=1.0)
    buffer = GroupBuffer(enable=True, metric="acc", max_num_gen_batches=0, on_exhausted="raise",
                         train_batch_size=len(records), n=N, ppo_mini_batch_size=1, pad_id=0)
    with RewardManager(last_char_reward, max_response_length=max_len, timeout_s=0) as rm:  # in-process
        import gc

        gc.collect()
        dist.barrier(group=group)
        rss = PeakRSS(0.002).start()
        t0 = time.perf_counter()
        rollout = stages.generate(engine, records, sampling, group_suffix="1.0", pad_id=0, max_response_length=max_len)
        scored = stages.score(rollout, records, n=N, tokenizer=CharTokenizer(), reward_manager=rm, group=group)
        buffer.add(scored)
        seconds = time.perf_counter() - t0
        peak = rss.stop()
        real = int(rollout.response_length.sum())
    result = {"rank": rank, "peak_mib": peak / 2**20, "seconds": seconds, "real_tokens": real,
              "kept_prompts": buffer.num_prompts}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier(group=group)
    dist.destroy_process_group()


def _run(rows: int, max_len: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr",
               "127.0.0.1", "--master_port", str(port), __file__, "--worker", out, str(rows), str(max_len)]
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if r.returncode:
            sys.exit(r.stdout[-4000:] + r.stderr[-4000:])
        ranks = [json.loads(pathlib.Path(out, f"rank{k}.json").read_text()) for k in range(WORLD)]
    real = ranks[0]["real_tokens"]
    return {"rows": rows, "max_len": max_len, "real_tokens": real,
            "dense_mib": rows * max_len * 16 / 2**20, "real_mib": real * 16 / 2**20,
            "peak_mib_per_rank": [round(r["peak_mib"], 1) for r in ranks],
            "seconds": round(max(r["seconds"] for r in ranks), 2)}


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--max-len", type=int, default=4096)
    args = p.parse_args()
    figures = []
    for rows in args.rows:
        f = _run(rows, args.max_len)
        figures.append(f)
        print(f"{rows} rows x max {args.max_len} ({f['real_tokens']:,} real tokens): peak per rank "
              f"{f['peak_mib_per_rank']} MiB; dense copy {f['dense_mib']:.0f} MiB, real tokens {f['real_mib']:.0f} "
              f"MiB; {f['seconds']} s")
    print(json.dumps({"world": WORLD, "n": N, "batches": figures}))


if __name__ == "__main__":
    main()
