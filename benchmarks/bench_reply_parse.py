"""What parsing one SGLang /generate reply costs rank 0's training process: CPU a token, by phase.

The client's reply threads run in the training process, so what matters there is the time they hold the
GIL (every other thread of the process waits for it), not their CPU. One reply of 16 rows in SGLang
0.5.23's exact wire format (bench_rank0.ReplayServer: the recorded reply's keys, log-prob entries at full
precision, lognormal response lengths of mean `--mean-len`; with the MoE layout of `--r3`,
`meta_info.routed_experts` as SGLang sends it, base64 of int32 [prompt + response - 1, layers, top-k]) goes
through the engine's own parse path (sglang.engine._run_batch), three ways:

- `no_routing`: a reply without routing (a dense model, or R3 off);
- `routing_in_json`: with routing, the whole body through the JSON parser (the routing strings become
  Python str objects, then decoded): the client before the cut;
- `routing_cut`: with routing, the strings cut from the bytes (sglang.routing.cut_routed_experts) and
  decoded from them: the client now.

Per way and phase, CPU microseconds per routed token (prompt + response - 1 positions; `time.process_time`,
one thread, the least of three loops of `--seconds` / 3 a phase):

- `cut`: cut_routed_experts over the body (memchr-speed finds, one copy of the rest): GIL held;
- `json`: orjson.loads of what is parsed: GIL held;
- `fields`: payloads.parse_generate_output's checks and tensors of tokens and log-probs: GIL held;
- `routing`: sglang.routing.decode_routed_experts per row: pybase64's decode and numpy's checks and copies,
  which release the GIL for the bulk (Python holds it for a few statements a row);
- `whole`: the engine's parse from the body to the rows, all of the above (and the allocator's work for
  what they make and free, which the phases alone miss).

`gil_us` is whole minus routing: the time the parse holds the GIL, taking the decode's bulk as released.
At the recipe's volume (24,576 rows a generation batch, prompts of ~256 and responses of 6k: about 147 M
routed positions) each microsecond a routed token is about 147 s a batch. (A thread spinning beside the
parse does not measure the GIL on this machine: it also slows beside pybase64's GIL-free decode, to 74% of
its rate, so its loss mixes the GIL with what the VM's two CPUs share.)

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_reply_parse.py [--mean-len 700] [--r3 48 8 128]
        [--seconds 3]

It ends with one JSON line: `rows`, `mean_response_tokens`, `routed_tokens`, `reply_mb`, and per way
`cpu_us` (phase -> us a routed token) and `gil_us`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from benchmarks.bench_rank0 import N, ReplayServer, prompt_ids  # noqa: E402
from megatron_dapo.rollout.sglang.payloads import parse_generate_output  # noqa: E402
from megatron_dapo.rollout.sglang.routing import (  # noqa: E402
    META_KEY,
    RoutingLayout,
    cut_routed_experts,
    decode_routed_experts,
    routed_tokens,
)

MAX_LEN = 20480


def one_reply(mean_len: int, routing: tuple[int, int, int] | None) -> tuple[bytes, list[int]]:
    """One group's /generate reply body (N rows) and its response lengths."""
    server = ReplayServer(0, rows=N, mean_len=mean_len, sigma=0.3, max_len=MAX_LEN, window_s=1.0, routing=routing)
    try:
        body, _ = server.reply({"input_ids": [prompt_ids(0)] * N, "rid": [f"bench-0.0.{j:02d}" for j in range(N)]})
        return body, list(server.quantiles)
    finally:
        server.server_close()


def phases(body: bytes, layout: RoutingLayout | None, cut: bool) -> dict:
    """The engine's parse of `body` (sglang.engine._run_batch) as its phases, each a function of nothing that
    repeats it, and `whole`: the phases in one."""
    prompt_len = len(prompt_ids(0))
    request = dict(request="bench", max_new_tokens=MAX_LEN)
    data, values = cut_routed_experts(body) if cut else (body, None)
    items = orjson.loads(data)
    assert len(items) == N

    def routing():
        fresh = list(values) if cut else None  # each cut value is taken once
        for item, n in zip(items, lengths, strict=True):
            meta = item["meta_info"]
            decode_routed_experts(meta[META_KEY], num_layers=layout.num_layers, top_k=layout.top_k,
                                  num_experts=layout.num_experts, num_tokens=routed_tokens(prompt_len, n),
                                  where="bench", cut=fresh)

    def whole():
        data, values = cut_routed_experts(body) if cut else (body, None)
        return [parse_generate_output(item, **request, routing=layout, prompt_len=prompt_len, cut=values)
                for item in orjson.loads(data)]

    lengths = [len(item["output_ids"]) for item in items]
    out = {"json": lambda: orjson.loads(data),
           "fields": lambda: [parse_generate_output(item, **request) for item in items]}
    if cut:
        out["cut"] = lambda: cut_routed_experts(body)
    if layout is not None:
        out["routing"] = routing
    out["whole"] = whole
    return out


def cpu_per_call(fn, seconds: float, rounds: int = 3) -> float:
    """The least CPU seconds a call of `fn` took over `rounds` loops of seconds / rounds (the first call,
    which warms the allocator, not timed)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t, n = time.process_time(), 0
        while time.process_time() - t < seconds / rounds:
            fn()
            n += 1
        best = min(best, (time.process_time() - t) / n)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mean-len", type=int, default=700, help="mean response tokens of the reply's rows")
    p.add_argument("--r3", type=int, nargs=3, default=[48, 8, 128], metavar=("LAYERS", "TOP_K", "EXPERTS"),
                   help="the MoE layout of the routing (default: Qwen3-30B-A3B's 48 8 128)")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds each phase loops")
    args = p.parse_args()
    layout = RoutingLayout(*args.r3)
    plain, lengths = one_reply(args.mean_len, None)
    routed, _ = one_reply(args.mean_len, tuple(args.r3))
    tokens = sum(routed_tokens(len(prompt_ids(0)), n) for n in lengths)
    ways = {"no_routing": phases(plain, None, False), "routing_in_json": phases(routed, layout, False),
            "routing_cut": phases(routed, layout, True)}
    for a, b in zip(ways["routing_in_json"]["whole"](), ways["routing_cut"]["whole"](), strict=True):
        assert a.token_ids.equal(b.token_ids) and a.routed_experts.equal(b.routed_experts)
    print(f"one reply of {N} rows, {sum(lengths)} response tokens, {tokens} routed positions, "
          f"{len(routed) / 1e6:.1f} MB with routing ({len(plain) / 1e6:.2f} MB without); us a routed token:")
    cpu, gil = {}, {}
    for name, fns in ways.items():
        cpu[name] = {phase: round(cpu_per_call(fn, args.seconds) / tokens * 1e6, 3) for phase, fn in fns.items()}
        gil[name] = round(cpu[name]["whole"] - cpu[name].get("routing", 0.0), 3)
        print(f"{name:>16}: " + ", ".join(f"{k} {v:.3f}" for k, v in cpu[name].items())
              + f"; GIL held {gil[name]:.3f} (about {gil[name] * 147:.0f} s a recipe batch)")
    print(json.dumps({"rows": N, "mean_response_tokens": round(sum(lengths) / N), "routed_tokens": tokens,
                      "layout": args.r3, "reply_mb": round(len(routed) / 1e6, 2), "cpu_us": cpu, "gil_us": gil}))


if __name__ == "__main__":
    main()
