"""Rank 0 at the recipe's volume: one generation batch of the sync trainer, from SGLang's replies to the
training batch on every rank, on 4 gloo processes, with replies in SGLang 0.5.23's wire format.

The recipes generate 1,536 prompts x 16 = 24,576 rows per generation batch, up to 20,480 response tokens
each, and rank 0 receives every reply. This runs a stated fraction of that batch (`--rows`, two sizes: the
costs are fitted linear in rows and extrapolated to 24,576, with the measured figures beside them).

The server side is a replay server in its own process: it answers /server_info and /model_info with the
replies a real SGLang 0.5.23 CPU server gave (benchmarks/assets, recorded by record_sglang_reply.py; the
context length raised to the recipe's) and /generate with synthetic replies in the recorded reply's exact
shape (every key of `meta_info` in its order, SGLang's compact JSON, full-precision log-probs). Response
lengths are lognormal (sigma `--sigma`), capped at `--max-len`, with mu set so that the capped mean is
`--mean-len` (the rows take its quantiles, so every size has the same mean); a request (one group of 16) is
answered when its longest response would end on KV-bound servers (`ReplayServer.schedule`), the last one
`--window-s-full` x rows / 24,576 seconds after the first request (a 20-minute generation batch at full
volume). The client therefore parses replies while later ones are still being generated, as in a run.

Every rank runs the trainer's own path: rank 0's `SGLangEngine` (the real client) behind `RankZeroEngine`,
`stages.generate` with the sync trainer's callback (rank 0 decodes each group with an HF fast tokenizer, the
project's character vocabulary, and scores it as its reply arrives, beside generation), `stages.score_streamed`
(the scores reach every rank; `BENCH_SCORE_AFTER=1`: the previous path, every rank scoring its share of the rows
after generation with `stages.score`),
`GroupBuffer` (dynamic sampling, a third of the prompts trained as in the recipe's 512 of 1,536) and
`share_kept_rows` (the training batch on every rank). Per phase it prints:

- serial seconds after the last reply (every GPU would wait): until rank 0's engine returned the batch, the
  batch on every rank, scored, dynamic sampling, the training batch on every rank;
- `score_local_s`: the slowest rank's own decode and reward seconds after generation (with
  `BENCH_SCORE_AFTER=1` the one part that divides by the ranks: `serial_s_at_128_ranks` is the serial time
  with that part at the recipe's 128 ranks); `score_beside_generation_s`: rank 0's scoring during generation;
- `gil_s_in_trainer`: CPU seconds the client's threads spent in rank 0's training process (request, reply
  read, parse, row building; Python holds the GIL for nearly all of it, except R3's routing decode, whose
  bulk releases it: bench_reply_parse.py splits a reply's parse by phase);
- peak resident memory above the start of the batch, per rank, beside the planner's figure for the same
  data path (`plan.host.data_path`: this size, the mean length, no step tensors, 1 text byte a token; with
  --r3 its routing terms: the routing of the rows the step trains, and the replies in parse);
- bytes between ranks (tensors and pickled objects rank 0 sent or received).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_rank0.py [--rows 768 1536] [--mean-len 6000]
        [--r3 LAYERS TOP_K EXPERTS]

`--r3` (rollout routing replay): every reply item also carries `meta_info.routed_experts` as SGLang sends
it (base64 of int32 [prompt + response - 1, layers, top-k], random ids below EXPERTS), the client asks for
and decodes it (rollout/sglang/routing.py) in its reply threads, and the rows keep it through dynamic
sampling (`routing_rows_held`: the rows whose routing rank 0 still held when generation ended, the groups
dynamic sampling drops and those past the ones the step takes being released as they are scored;
`routing_rows_kept`: the trained rows that hold it; `--constant-share` makes a share of
the groups constant, as dynamic sampling sees in a run, so that they are dropped). At the Qwen3-30B-A3B layout
(48 8 128) that is 2,048 bytes of JSON a token: run it at a smaller --mean-len on this machine.

BENCH_PROFILE=DIR writes each rank's cProfile of the phases after generation to DIR/rank<k>.prof.

It ends with one JSON line: `rows`, `mean_response_tokens`, `serial_s_after_last_reply`, `gil_s_in_trainer`,
`rank0_peak_gib`, `other_rank_peak_gib` extrapolated to 24,576 rows, and `measured` (each size's figures).
"""

from __future__ import annotations

import argparse
import base64
import http.server
import inspect
import json
import math
import os
import pathlib
import pickle
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ASSETS = ROOT / "benchmarks/assets"
WORLD, N, FULL_ROWS, RECIPE_WORLD = 4, 16, 24_576, 128
PROMPT_LEN = 256
EOS = 2


def prompt_ids(i: int) -> list[int]:
    """Prompt i's tokens (the ranks' records and the replay server's lengths agree on them)."""
    rng = random.Random(1_000 + i)
    return [rng.randrange(3, 18) for _ in range(PROMPT_LEN - i % 64)]


# -- the replay server ---------------------------------------------------------------------------------
def capped_lognormal_mu(mean: float, sigma: float, cap: float) -> float:
    """mu such that E[min(X, cap)] = mean for X ~ lognormal(mu, sigma) (bisection on the closed form)."""
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731

    def capped_mean(mu: float) -> float:
        z = (math.log(cap) - mu) / sigma
        return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))

    lo, hi = -10.0, math.log(cap) + 10
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped_mean(mid) < mean else (lo, mid)
    return (lo + hi) / 2


def row_lengths(rows: int, mean_len: int, sigma: float, max_len: int) -> list[int]:
    """Every size draws the same distribution exactly: the row lengths are the capped lognormal's quantiles at
    (i + 0.5) / rows, shuffled (seeded) over the groups."""
    dist = statistics.NormalDist(capped_lognormal_mu(mean_len, sigma, max_len), sigma)
    quantiles = [min(max(int(math.exp(dist.inv_cdf((i + 0.5) / rows))), 1), max_len) for i in range(rows)]
    random.Random(11).shuffle(quantiles)
    return quantiles


class ReplayServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048

    def __init__(self, port: int, *, rows: int, mean_len: int, sigma: float, max_len: int, window_s: float,
                 routing: tuple[int, int, int] | None = None):
        """routing: (layers, top-k, experts) of the MoE layout whose routed experts every item carries (R3), or
        None."""
        self.max_len, self.window_s, self.routing = max_len, window_s, routing
        self.mu, self.sigma = capped_lognormal_mu(mean_len, sigma, max_len), sigma
        info = json.loads((ASSETS / "sglang-0.5.23-server-info.json").read_text())
        # The recipe's context: prompt + max_response_length (the recorded tiny server had 66 positions).
        info.update(context_length=PROMPT_LEN + max_len + 2, max_req_input_len=PROMPT_LEN + max_len - 4,
                    max_running_requests=rows, enable_return_routed_experts=routing is not None)
        self.infos = {"/server_info": json.dumps(info).encode(),
                      "/model_info": (ASSETS / "sglang-0.5.23-model-info.json").read_bytes()}
        record = json.loads((ASSETS / "sglang-0.5.23-generate-reply.json").read_bytes())[0]
        self.meta_keys = [k for k in record["meta_info"] if k != "routed_experts" or routing is not None]
        # Entries are built from a table of recorded-looking triples: [logprob, token, null] with the
        # log-prob at full double precision, as SGLang's orjson writes it.
        rng = random.Random(5)
        self.table = [(t, repr(-rng.expovariate(1.2)), chr(ord("0") + t - 3) if t < 13 else "+-*= "[t - 13])
                      for t in range(3, 18) for _ in range(64)]
        self.t0: float | None = None
        self.lock = threading.Lock()
        # A group is found by its prompt (the ranks build the same ones).
        self.group_of = {tuple(prompt_ids(i)): i for i in range(rows // N)}
        self.quantiles = row_lengths(rows, mean_len, sigma, max_len)
        self.due = self.schedule(rows // N, window_s)
        # Every reply is built before the port opens: while the client parses, this process only writes bytes.
        self.replies = [self.build(g, prompt_ids(g)) for g in range(rows // N)]
        super().__init__(("127.0.0.1", port), ReplayHandler)

    def schedule(self, groups: int, window_s: float) -> list[float]:
        """When each group's reply is due (seconds after the first request). The servers are KV-bound: a
        sixteenth of the groups decode at once (the recipe: ~100 sequences of 8k per server, 16 servers,
        1,536 groups), each admitted in order as a slot frees and running as long as its longest response;
        the makespan is scaled to the window. The long responses therefore end spread over the window's
        last part, not all at its end."""
        slots = [0.0] * max(groups // 16, 1)
        finish = []
        for g in range(groups):
            k = min(range(len(slots)), key=slots.__getitem__)
            slots[k] += max(self.quantiles[g * N:(g + 1) * N])
            finish.append(slots[k])
        return [window_s * f / max(finish) for f in finish]

    def build(self, g: int, prompt: list[int]) -> tuple[list[tuple[bytes, bytes]], float]:
        """Group g's reply items, each split around its rid (known at request time only), and when the reply
        is due."""
        lengths = self.quantiles[g * N:(g + 1) * N]
        rng = random.Random(g)
        ids_rng = np.random.default_rng(g)
        items = []
        for L in lengths:
            picks = [self.table[rng.randrange(len(self.table))] for _ in range(L)]
            finish = {"type": "length", "length": L} if L == self.max_len else {"type": "stop", "matched": EOS}
            if finish["type"] == "stop":
                picks[-1] = (EOS, picks[-1][1], "")
            ids = [t for t, _, _ in picks]
            meta = {"id": "RID", "finish_reason": finish, "prompt_tokens": len(prompt), "weight_version": "0",
                    "num_retractions": 0, "input_token_logprobs": [], "output_token_logprobs": None,
                    "output_token_logprobs_length": L, "reasoning_tokens": 0, "completion_tokens": L,
                    "cached_tokens": 0, "weight_versions": [{"version": "0", "start": 0, "end": L}],
                    "cached_tokens_details": None, "dp_rank": None, "e2e_latency": 1.0,
                    "response_sent_to_client_ts": time.time()}
            if self.routing is not None:  # SGLang's R3 field: base64 of int32 [prompt + response - 1, layers, top-k]
                layers, top_k, experts = self.routing
                routed = ids_rng.integers(0, experts, size=(len(prompt) + L - 1) * layers * top_k, dtype="<i4")
                meta["routed_experts"] = base64.b64encode(routed.tobytes()).decode()
            meta = {k: meta[k] for k in self.meta_keys}
            head = json.dumps({"text": "".join(c for _, _, c in picks), "output_ids": ids, "meta_info": meta},
                              separators=(",", ":"))
            entries = "[" + ",".join(f"[{lp},{t},null]" for t, lp, _ in picks) + "]"
            item = head.replace('"output_token_logprobs":null', f'"output_token_logprobs":{entries}', 1).encode()
            before, after = item.split(b'"id":"RID"', 1)
            items.append((before + b'"id":"', b'"' + after))
        return items, self.due[g]

    def reply(self, body: dict) -> tuple[bytes, float]:
        """The reply bytes of one batched /generate (one group) and when it is due."""
        items, due = self.replies[self.group_of[tuple(body["input_ids"][0])]]
        rids = body["rid"]
        assert len(rids) == len(items), f"a request of {len(rids)} items; the bench sends one group of {N}"
        return b"[" + b",".join(b + rid.encode() + a for (b, a), rid in zip(items, rids, strict=True)) + b"]", due


class ReplayHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0]
        self._send(self.server.infos.get(path, b"{}"))

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/generate":
            self._send(b"{}")
            return
        with self.server.lock:
            if self.server.t0 is None:
                self.server.t0 = time.monotonic()
        data, due = self.server.reply(body)
        time.sleep(max(self.server.t0 + due - time.monotonic(), 0))
        self._send(data)


def _serve(port: int, rows: int, mean_len: int, sigma: float, max_len: int, window_s: float,
           routing: tuple[int, int, int] | None = None) -> None:
    ReplayServer(port, rows=rows, mean_len=mean_len, sigma=sigma, max_len=max_len, window_s=window_s,
                 routing=routing).serve_forever()


# -- the trainer ranks -----------------------------------------------------------------------------------
def _count_wire(counter: dict) -> None:
    """Count the bytes this rank puts on or takes off the gloo group (tensors and pickled objects)."""
    import torch.distributed as dist

    def tensors(name):
        fn = getattr(dist, name)

        def wrapped(tensor, *a, **k):
            counter["bytes"] += tensor.numel() * tensor.element_size()
            return fn(tensor, *a, **k)
        setattr(dist, name, wrapped)

    def objects(name, arg):
        fn = getattr(dist, name)

        def wrapped(*a, **k):
            counter["bytes"] += sum(len(pickle.dumps(o)) for o in (a[arg] if arg is not None else []) if o is not None) \
                if name == "broadcast_object_list" else len(pickle.dumps(a[arg]))
            return fn(*a, **k)
        setattr(dist, name, wrapped)

    for name in ("broadcast", "send", "recv", "isend", "irecv", "all_reduce"):
        tensors(name)
    objects("all_gather_object", 1)
    objects("gather_object", 0)
    objects("broadcast_object_list", 0)


def _worker(out: str, url: str, rows: int, max_len: int, routing: tuple[int, int, int] | None = None,
            constant_share: float = 0.0) -> None:
    import torch.distributed as dist

    from benchmarks._peak_rss import PeakRSS
    from megatron_dapo.data.dataset import PromptRecord
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.rewards.manager import RewardManager
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.ragged import share_kept_rows
    from megatron_dapo.rollout.rank0 import RankZeroEngine
    from megatron_dapo.rollout.sglang.engine import SGLangEngine
    from megatron_dapo.trainer import stages
    from megatron_dapo.trainer.dynamic_sampling import GroupBuffer, StopWhenFull

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    prompts = rows // N
    tokenizer = load_tokenizer(os.path.join(out, "tokenizer"))
    client_cpu = [0.0]
    held_routing = [0]  # rank 0: rows of the engine's returned batch that still hold R3 routing
    replies: list[float] = []
    engine = None
    if rank == 0:
        run_batch = SGLangEngine._run_batch

        def timed_run_batch(self, *a, **k):  # CPU seconds of the client's threads in this process
            t = time.thread_time()
            try:
                return run_batch(self, *a, **k)
            finally:
                client_cpu[0] += time.thread_time() - t
        SGLangEngine._run_batch = timed_run_batch
        from megatron_dapo.rollout.sglang.routing import RoutingLayout

        engine = SGLangEngine([url], max_concurrency=prompts, max_batch_size=N, health_check_interval_s=3600,
                              request_timeout_s=3600,
                              return_routed_experts=RoutingLayout(*routing) if routing is not None else None)
        post = engine._http.post

        def timed_post(*a, **k):  # the reply's headers are in when post returns
            r = post(*a, **k)
            replies.append(time.time())
            return r
        engine._http.post = timed_post
    try:  # what the trainer does once its parts are built (trainer/run.py)
        from megatron_dapo.trainer.run import freeze_startup_objects
    except ImportError:  # a trainer from before it
        freeze_startup_objects = None
    if freeze_startup_objects is not None:
        freeze_startup_objects()
    wire = {"bytes": 0}
    _count_wire(wire)
    driver = RankZeroEngine(engine, rank=rank, world_size=WORLD, group=group)
    records = [PromptRecord(uid=f"q{i}", prompt_ids=prompt_ids(i),
                            raw_prompt="q", ground_truth="const" if _constant(i, constant_share) else "even",
                            data_source="synthetic") for i in range(prompts)]
    sampling = SamplingParams(max_new_tokens=max_len, n=N, temperature=1.0, stop_token_ids=(EOS,))
    buffer = GroupBuffer(enable=True, metric="acc", max_num_gen_batches=0, on_exhausted="raise",
                         train_batch_size=prompts // 3, n=N, ppo_mini_batch_size=1, pad_id=0)

    def parity_reward(solution_str, ground_truth):  # about half the rows right: most groups informative
        if ground_truth == "const":  # --constant-share: every row of the group scores 0, dynamic sampling drops it
            return {"score": 0.0, "acc": False}
        ok = solution_str.count("7") % 2 == 0
        return {"score": float(ok), "acc": ok}

    marks: dict[str, float] = {}
    local = [0.0]  # this rank's own scoring work (decode + reward): it divides by the ranks, unlike the rest

    tokenizer.decode = timed_into(tokenizer.decode, local)
    with RewardManager(parity_reward, max_response_length=max_len, timeout_s=0) as rm:
        rm.score = timed_into(rm.score, local)
        import gc

        gc.collect()
        dist.barrier(group=group)
        rss = PeakRSS(0.005).start()
        if rank == 0:  # when rank 0's engine has the whole batch, before it goes to the other ranks
            def marking(call):
                def marked(*a, **k):
                    batch = call(*a, **k)
                    marks["engine_batch"] = time.time()
                    held_routing[0] = sum(r is not None for r in batch.routed_experts or [])
                    return batch
                return marked
            engine.generate_batch = marking(engine.generate_batch)
            engine.generate_batch_streaming = marking(engine.generate_batch_streaming)
        marks["start"] = time.time()
        # As fit._collect on SGLang servers: rank 0 scores each group as its reply arrives (the callback),
        # the reward stage after generation reuses those scores. The old path (every rank scores its rows
        # after generation) stays for comparison: BENCH_SCORE_AFTER=1.
        after = os.environ.get("BENCH_SCORE_AFTER") == "1" or not hasattr(StopWhenFull, "scoring_only")
        # As the trainer with dynamic sampling on: a constant group's R3 routing goes when it is scored, and
        # an informative one's once the groups the step takes before it are known (where the code does so).
        params = inspect.signature(StopWhenFull).parameters
        drops = {"drops_constant": True} if "drops_constant" in params else {}
        if "keep" in params:
            drops.update(keep=buffer.needed, positions={stages.group_id(r, "1.0"): i for i, r in enumerate(records)})
        stop = None if after else StopWhenFull.scoring_only(metric="acc", score_groups=stages.group_scorer(
            records, group_suffix="1.0", n=N, tokenizer=tokenizer, reward_manager=rm), **drops)
        rollout = stages.generate(driver, records, sampling, group_suffix="1.0", pad_id=0, max_response_length=max_len,
                                  on_groups_done=stop)
        marks["batch_on_every_rank"] = time.time()
        beside = local[0]  # scoring done during generation (rank 0's callback): not serial
        local[0] = 0.0
        profile = None
        if os.environ.get("BENCH_PROFILE"):  # where the serial seconds after generation go, per rank
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        if stop is None:
            scored = stages.score(rollout, records, n=N, tokenizer=tokenizer, reward_manager=rm, group=group)
        else:
            scored = stages.score_streamed(rollout, records, stop.scored, n=N, tokenizer=tokenizer, reward_manager=rm,
                                           group=group)
        marks["scored"] = time.time()
        buffer.add(scored)
        batch, _ = buffer.take()
        marks["dynamic_sampling"] = time.time()
        train = share_kept_rows(batch.rollout, group=group)
        marks["train_batch"] = time.time()
        if profile is not None:
            profile.disable()
            profile.dump_stats(os.path.join(os.environ["BENCH_PROFILE"], f"rank{rank}.prof"))
        peak = rss.stop()
    result = {"rank": rank, "peak_gib": peak / 2**30, "marks": marks, "wire_bytes": wire["bytes"],
              "client_cpu_s": client_cpu[0], "replies_held_max": engine._reply_slots.most if engine is not None else 0, "score_local_s": local[0],
              "score_beside_s": beside, "scored_after": stop is None, "last_reply": max(replies) if replies else None,
              "real_tokens": int(rollout.response_length.sum()), "train_rows": len(train),
              "routing_rows_kept": sum(r is not None for r in batch.rollout.routed_experts or []),
              "routing_rows_held": held_routing[0]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier(group=group)
    if engine is not None:
        engine.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PHASES = ("engine_batch", "batch_on_every_rank", "scored", "dynamic_sampling", "train_batch")


def _run(rows: int, args) -> dict:
    window = args.window_s_full * rows / FULL_ROWS
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r3 = [",".join(map(str, args.r3))] if args.r3 else []
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(rows), str(args.mean_len),
                               str(args.sigma), str(args.max_len), str(window), *r3], env=env)
    try:
        deadline = time.monotonic() + 900  # the server builds every reply before it listens
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        with tempfile.TemporaryDirectory() as out:
            from tests.sglang_real.model import write_char_tokenizer

            write_char_tokenizer(os.path.join(out, "tokenizer"))  # an HF fast tokenizer, as the recipe's
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr",
                   "127.0.0.1", "--master_port", str(_free_port()), __file__, "--worker", out,
                   f"http://127.0.0.1:{port}", str(rows), str(args.max_len), str(args.constant_share), *r3]
            r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=7200)
            if r.returncode:
                sys.exit(r.stdout[-4000:] + r.stderr[-4000:])
            ranks = [json.loads(pathlib.Path(out, f"rank{k}.json").read_text()) for k in range(WORLD)]
    finally:
        server.kill()
        server.wait()
    from megatron_dapo.plan.host import data_path

    planned0, planned = data_path(rows=rows, n=N, train_rows=ranks[0]["train_rows"],
                                  response_tokens=args.mean_len, max_response_length=args.max_len,
                                  max_prompt_length=PROMPT_LEN, world=WORLD, text_bytes_per_token=1.0, step_tensors=0,
                                  routing_ids_per_token=args.r3[0] * args.r3[1] if args.r3 else 0,
                                  routing_id_bytes=1 if not args.r3 or args.r3[2] <= 256 else 2)
    last = ranks[0]["last_reply"]
    phases, prev = {}, last
    for name in PHASES:  # each phase ends when the last rank is through it
        end = max(rk["marks"].get(name, 0.0) for rk in ranks)
        phases[name] = round(end - prev, 3)
        prev = end
    return {"rows": rows, "real_tokens": ranks[0]["real_tokens"], "window_s": round(window, 1),
            "mean_response_tokens": ranks[0]["real_tokens"] / rows, "train_rows": ranks[0]["train_rows"],
            "serial_s_after_last_reply": round(prev - last, 3), "phases_s": phases,
            "score_local_s": round(max(rk["score_local_s"] for rk in ranks), 3),
            "score_beside_generation_s": round(ranks[0].get("score_beside_s", 0.0), 2),
            "scored_after_generation": ranks[0].get("scored_after", True),
            "generation_s": round(last - ranks[0]["marks"]["start"], 1),
            "gil_s_in_trainer": round(ranks[0]["client_cpu_s"], 2),
            "rank0_peak_gib": round(ranks[0]["peak_gib"], 3),
            "other_rank_peak_gib": round(max(rk["peak_gib"] for rk in ranks[1:]), 3),
            "planned_rank0_gib": round(sum(planned0.values()) / 2**30, 3),
            "planned_other_gib": round(sum(planned.values()) / 2**30, 3),
            "replies_held_max": ranks[0]["replies_held_max"], "routing_rows_kept": ranks[0]["routing_rows_kept"],
            "routing_rows_held": ranks[0]["routing_rows_held"],
            "wire_bytes_rank0": ranks[0]["wire_bytes"], "wire_bytes_other_max": max(rk["wire_bytes"] for rk in ranks[1:])}


def timed_into(fn, total: list[float]):
    """fn, adding the seconds each call takes to total[0]."""
    def wrapped(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            total[0] += time.perf_counter() - t
    return wrapped


def extrapolate(a: dict, b: dict, key: str) -> float:
    """The value at FULL_ROWS of the line through the two measured sizes."""
    slope = (b[key] - a[key]) / (b["rows"] - a["rows"])
    return round(a[key] + slope * (FULL_ROWS - a["rows"]), 2)


def extrapolate_phases(a: dict, b: dict, names) -> dict[str, float]:
    """extrapolate() of each phase's seconds."""
    return {name: extrapolate({"rows": a["rows"], name: a["phases_s"][name]},
                              {"rows": b["rows"], name: b["phases_s"][name]}, name) for name in names}


def size_arguments(p: argparse.ArgumentParser, default_rows: list[int], rows_help: str) -> None:
    """The two measured sizes and the length distribution (both rank-0 benchmarks)."""
    p.add_argument("--rows", type=int, nargs=2, default=default_rows, help=rows_help)
    p.add_argument("--mean-len", type=int, default=6000)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--max-len", type=int, default=20480)


def check_sizes(p: argparse.ArgumentParser, rows: list[int], why: str = "") -> None:
    if any(r % N or r < 6 * N for r in rows) or rows[0] == rows[1]:
        p.error(f"--rows: two different sizes, multiples of {N} and at least {6 * N}{why}")


def _constant(i: int, share: float) -> bool:
    """Whether prompt i is one of the --constant-share prompts (spread evenly over the batch)."""
    return int((i + 1) * share) > int(i * share)


def _layout(arg: list[str]) -> tuple[int, int, int] | None:
    """The --r3 layout as the server and worker processes receive it ("layers,top_k,experts"), or None."""
    return tuple(int(x) for x in arg[0].split(",")) if arg else None


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        port, rows, mean_len, sigma, max_len, window = sys.argv[2:8]
        _serve(int(port), int(rows), int(mean_len), float(sigma), int(max_len), float(window), _layout(sys.argv[8:9]))
        return
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), _layout(sys.argv[7:8]),
                float(sys.argv[6]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size_arguments(p, [768, 1536], "two sizes (multiples of 16)")
    p.add_argument("--window-s-full", type=float, default=1200.0,
                   help="generation seconds of the full 24,576-row batch (scaled by rows)")
    p.add_argument("--r3", type=int, nargs=3, metavar=("LAYERS", "TOP_K", "EXPERTS"),
                   help="every reply carries its routed experts (R3) for this MoE layout, e.g. 48 8 128 "
                        "(Qwen3-30B-A3B: 2,048 bytes of base64 a token); the client decodes and keeps them")
    p.add_argument("--constant-share", type=float, default=0.0,
                   help="share of the prompts whose every response scores the same (dynamic sampling drops their "
                        "groups; the recipe generates 3x the prompts it trains for them), e.g. 0.6")
    args = p.parse_args()
    check_sizes(p, args.rows, " (a third of the groups is trained)")
    if not 0.0 <= args.constant_share <= 2 / 3:
        p.error("--constant-share: between 0 and 2/3 (a third of the prompts is trained)")
    figures = []
    for rows in args.rows:
        f = _run(rows, args)
        figures.append(f)
        print(f"{rows} rows, {f['real_tokens']:,} response tokens (mean {f['mean_response_tokens']:.0f}), "
              f"generation {f['generation_s']} s: serial after the last reply {f['serial_s_after_last_reply']} s "
              f"{f['phases_s']}; client CPU in the trainer {f['gil_s_in_trainer']} s; peak rank 0 "
              f"{f['rank0_peak_gib']} GiB, others {f['other_rank_peak_gib']} GiB (planned {f['planned_rank0_gib']}, "
              f"{f['planned_other_gib']}; replies held at once {f['replies_held_max']}); wire rank 0 "
              f"{f['wire_bytes_rank0'] / 2**20:.0f} MiB" + (f"; rows with R3 routing when generation ended "
              f"{f['routing_rows_held']}, trained {f['routing_rows_kept']}" if args.r3 else ""), flush=True)
    a, b = figures
    full = {k: extrapolate(a, b, k) for k in ("serial_s_after_last_reply", "gil_s_in_trainer", "rank0_peak_gib",
                                               "other_rank_peak_gib", "score_local_s")}
    # Each rank decodes and scores rows / world rows: at the recipe's 128 ranks that share is 4 / 128 of this
    # run's; every other phase is rank 0's work or a collective over all rows, kept as measured.
    # Scored beside generation (the trainer's path on SGLang), what is left after it is rank 0's: nothing divides.
    share = (1 - WORLD / RECIPE_WORLD) if a["scored_after_generation"] else 0.0
    full["serial_s_at_128_ranks"] = round(full["serial_s_after_last_reply"] - full["score_local_s"] * share, 2)
    phases = extrapolate_phases(a, b, PHASES)
    print(f"extrapolated to {FULL_ROWS} rows: {full}, phases {phases}")
    print(json.dumps({"trainer": "sync", "rows": FULL_ROWS, "mean_response_tokens": args.mean_len, "r3": args.r3,
                      "constant_share": args.constant_share,
                      "max_len": args.max_len, **full, "phases_s": phases, "extrapolated_from": [f["rows"] for f in figures],
                      "measured": figures}))


if __name__ == "__main__":
    main()
