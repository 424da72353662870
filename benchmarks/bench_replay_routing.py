"""R3 at the step: the training rows' routing from rank 0 to the ranks that train them
(`trainer/replay.provide_rollout_routing`), on 4 gloo processes at the MoE recipe's TP 2 (DP 2 x TP 2 here).

The recipe trains 512 prompts x 16 = 8,192 rows a step; each row's routing is [48 MoE layers, prompt +
response - 1 tokens, top-8] uint8 (Qwen3-30B-A3B), ~7.2k routed tokens a row at a 6.2k response mean: 22.7 GB
a step. Rank 0 holds it all (it received it from the SGLang servers); every rank needs its data-parallel
replica's rows. This runs a stated fraction of the rows (`--rows`, two sizes: figures fitted linear in rows
and extrapolated to 8,192) with routed lengths spread +-50% around `--routed-tokens`, each rank's policies
standing in for the PolicyModels (the recipe's data-parallel dealing of rows, every MoE layer routed: PP 1).

Per size it prints: the seconds every rank spends in the call (the slowest rank's: the step waits for it),
bytes rank 0 sends, and each rank's peak resident memory above its start. Gloo over loopback on a 2-core
machine is not a cluster's network: the seconds say what rank 0's copies and sends cost here; the bytes are
exact at any scale.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_replay_routing.py [--rows 128 256]
        [--routed-tokens 7200] [--layers 48] [--top-k 8] [--experts 128]

It ends with one JSON line: `rows` (8,192), `serial_s`, `rank0_sent_gb`, `rank0_peak_gib`,
`other_rank_peak_gib` extrapolated, and `measured` (each size's figures).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD, TP, FULL_ROWS = 4, 2, 8192


class _Policy:
    """What provide_rollout_routing asks of a PolicyModel: the rows' dealing over data-parallel ranks and the
    model's router layout (every decoder layer a MoE layer, as Qwen3-30B-A3B)."""

    def __init__(self, dp_rank: int, dp_size: int, layers: int, top_k: int, experts: int):
        self.dp_rank, self.dp_size, self.layers = dp_rank, dp_size, layers
        config = types.SimpleNamespace(num_layers=layers, moe_layer_freq=1, num_moe_experts=experts,
                                       moe_router_topk=top_k)
        self.chunks = [types.SimpleNamespace(config=config)]
        self.given = None

    def row_groups(self, num_rows):
        return [list(range(num_rows))]

    def shard_rows(self, prompt_length, response_length, groups):
        every = [list(range(d, len(prompt_length), self.dp_size)) for d in range(self.dp_size)]
        return every, [every[self.dp_rank]]

    def routing_layers(self):
        return list(range(self.layers))

    def provide_routing(self, responses, rows, *, layers=None):
        self.given = rows


def _batch(rows: int, routed: int, layers: int, top_k: int, experts: int, with_routing: bool):
    import torch

    from megatron_dapo.rollout.base import RolloutBatch

    g = torch.Generator().manual_seed(0)
    spread = torch.randint(-routed // 2, routed // 2 + 1, (rows,), generator=g)
    prompt_length = torch.full((rows,), 1024, dtype=torch.int64)
    response_length = routed + spread - 1024 + 1
    routing = None
    if with_routing:  # [L, S, K] uint8 per row, S = prompt + response - 1
        routing = [torch.randint(0, experts, (layers, int(p + r - 1), top_k), generator=g, dtype=torch.uint8)
                   for p, r in zip(prompt_length.tolist(), response_length.tolist())]
    z = torch.zeros(rows, dtype=torch.long)
    return RolloutBatch(prompt_ids=torch.zeros(rows, 1, dtype=torch.long), prompt_length=prompt_length,
                        responses=torch.zeros(rows, 1, dtype=torch.long), response_mask=torch.zeros(rows, 1),
                        rollout_log_probs=torch.zeros(rows, 1), response_length=response_length, sample_index=z,
                        policy_version=z, aborted=torch.zeros(rows, dtype=torch.bool), finish_reason=["stop"] * rows,
                        index=[str(i) for i in range(rows)], meta=[{}] * rows, routed_experts=routing)


def _worker(out: str, rows: int, routed: int, layers: int, top_k: int, experts: int) -> None:
    import torch.distributed as dist

    from benchmarks._peak_rss import PeakRSS
    from megatron_dapo.trainer import replay

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp_rank, dp_size = rank // TP, WORLD // TP  # Megatron's order: TP fastest
    batch = _batch(rows, routed, layers, top_k, experts, rank == 0)
    sent = [0]
    send = dist.send

    def counted(tensor, *a, **k):
        sent[0] += tensor.numel() * tensor.element_size()
        return send(tensor, *a, **k)

    dist.send = counted
    pgs = types.SimpleNamespace(ctrl=dist.group.WORLD, dp_rank=dp_rank)
    import megatron_dapo.models.forward  # noqa: F401  (the call's lazy imports: a trainer has them already)
    import megatron_dapo.workers.routing  # noqa: F401

    dist.all_gather_object([None] * WORLD, rank)  # the object collectives' first-use setup, untimed
    policies = [_Policy(dp_rank, dp_size, layers, top_k, experts) for _ in range(2)]  # actor, reference
    dist.barrier()
    rss = PeakRSS(0.005).start()
    t0 = time.perf_counter()
    replay.provide_rollout_routing(batch, policies, pgs=pgs)
    took = time.perf_counter() - t0
    peak = rss.stop()
    got = policies[0].given
    bytes_held = sum(t.numel() for t in got.values() if t is not None)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "seconds": took, "sent": sent[0], "peak_gib": peak / 2**30,
                   "rows": len(got), "held_bytes": bytes_held}, f)
    dist.barrier()
    dist.destroy_process_group()


def _run(rows: int, args) -> dict:
    import subprocess

    from benchmarks.bench_rank0 import _free_port

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr",
               "127.0.0.1", "--master_port", str(_free_port()), __file__, "--worker", out, str(rows),
               str(args.routed_tokens), str(args.layers), str(args.top_k), str(args.experts)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if r.returncode:
            sys.exit(r.stdout[-4000:] + r.stderr[-4000:])
        ranks = [json.loads(pathlib.Path(out, f"rank{k}.json").read_text()) for k in range(WORLD)]
    return {"rows": rows, "serial_s": round(max(rk["seconds"] for rk in ranks), 3),
            "rank0_sent_gb": round(ranks[0]["sent"] / 1e9, 4),
            "sent_gb_by_rank": [round(rk["sent"] / 1e9, 4) for rk in ranks],
            "routing_gb": round(sum(rk["held_bytes"] for rk in ranks[::TP]) / 1e9, 4),
            "rank0_peak_gib": round(ranks[0]["peak_gib"], 3),
            "other_rank_peak_gib": round(max(rk["peak_gib"] for rk in ranks[1:]), 3)}


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        out, *nums = sys.argv[2:]
        _worker(out, *map(int, nums))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs=2, default=[128, 256])
    p.add_argument("--routed-tokens", type=int, default=7200)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    args = p.parse_args()
    if args.rows[0] == args.rows[1] or min(args.rows) < WORLD:
        p.error("--rows: two different sizes, at least 4")
    figures = []
    for rows in args.rows:
        f = _run(rows, args)
        figures.append(f)
        print(f"{rows} rows ({f['routing_gb']} GB of routing): {f['serial_s']} s in the call (slowest rank); rank 0 "
              f"sent {f['rank0_sent_gb']} GB (by rank {f['sent_gb_by_rank']}); peak rank 0 {f['rank0_peak_gib']} GiB, "
              f"others {f['other_rank_peak_gib']} GiB", flush=True)
    a, b = figures

    def at_full(key):
        slope = (b[key] - a[key]) / (b["rows"] - a["rows"])
        return round(a[key] + slope * (FULL_ROWS - a["rows"]), 2)

    full = {k: at_full(k) for k in ("serial_s", "rank0_sent_gb", "rank0_peak_gib", "other_rank_peak_gib")}
    print(f"extrapolated to {FULL_ROWS} rows: {full}")
    print(json.dumps({"rows": FULL_ROWS, "routed_tokens": args.routed_tokens,
                      "layout": [args.layers, args.top_k, args.experts], "world": WORLD, "tp": TP, **full,
                      "extrapolated_from": args.rows, "measured": figures}))


if __name__ == "__main__":
    main()
