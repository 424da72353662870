"""Host memory per rank and per node of the sync trainer's data path at a recipe's numbers.

Each term is a tensor or list the code holds, at the size the recipe gives it (worst case: every response
`response_tokens` long, by default max_response_length; `--mean-response-tokens` plans a typical step).
Rank 0 drives the SGLang servers (rollout/rank0.py); the other ranks hold their share of the rows.

rank 0, per generation batch of R rows of L tokens (R = gen_batch_size x n):
- generation batch: R x L x 8 B (int32 ids, float32 log-probs: rollout.ragged.TOKEN_DTYPE) twice: the rows'
  tensors as each reply is parsed, and the batch's arena they are written into (`rollout.ragged.RowArena`;
  the parsed tensors are freed into the process's heap, which keeps them, so the resident peak counts both);
- replies read and not yet rows: REPLIES_HELD replies of n rows (the engine's bound), 150 B a token (the
  JSON body and the parsed lists), and the JSON parser's transient of the one reply it parses at a time;
- texts: every row's decoded text gathered for the dumps (`text_bytes_per_token`, 4 for a BPE vocabulary);
- kept rows: the groups dynamic sampling keeps wait ragged (a copy of their rows), and the step's batch
  is taken from them (another copy): twice train rows x L x 8 B;
- r3 routing when actor.router_replay = r3 (memory.py's figure: the rows one step trains at the longest
  sequence; and on the other ranks, the replica's rows with every MoE layer a replica's first rank receives
  at the step). The data-path terms at a stated length (`data_path(routing_ids_per_token=...)`,
  bench_rank0.py --r3): the routing of the train rows (uint8 / int16 ids [L, P + R - 1, K]; rank 0 scores
  each group as it completes and releases the routing of a dropped group and of an informative one with
  the step's groups before it, so at most the step's groups hold it: a bound, memory.py), and the replies
  in parse carrying it: R3_REPLY_BYTES_PER_ID per id (the JSON body's base64, the int32 ids decoded from
  it and their narrowed copy).
every rank:
- its rows: R / world x L x 8 B and their texts (rank 0 holds every row already);
- the kept rows as they arrive (int32 ids + float32 log-probs; the ids stay so in the training batch);
- the training batch: B x T x 8 B dense (float32 log-probs and mask; rollout.ragged.TRAINING_DENSE) + its
  prompts' ids, ragged int32 (at most B x P x 4 B), then the
  step's per-token float32 tensors (loss mask, old log-probs and their squared-probability sums, token-level
  rewards, advantages, returns; reference log-probs with a KL term);
- with trainer.async_save the checkpoint's staged copy of its shards (params + optimizer state); with
  actor.offload_optimizer the pinned buffers holding the optimizer state between steps;
- a process allowance (libraries, CUDA's host state): PROCESS_BYTES, an allowance, not a measurement.

`benchmarks/bench_rank0.py` prints this plan's data-path figures beside its measured peaks.

Disk: the queue trainer with R3 keeps each issued, not yet consumed row's routing in a file beside its queue
(queue/spool.py): at most (max_staleness + 1) x parameter_sync_step generation batches of rows, each
(max_prompt_length + response_tokens - 1) x MoE layers x top-k ids (memory.py's id width; SGLang's routing
has a row for every decoder layer, equal where every layer routes, as in the MoE recipe): the `disk:` line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2**30
PROCESS_BYTES = 4 * GIB
"""Per training process, beyond its data: Python, torch, Megatron, CUDA's host state (an allowance)."""
REPLIES_HELD = 4
"""Replies read and not yet made rows at once on rank 0: the engine's bound (rollout/sglang/client.py,
REPLIES_AT_ONCE; a reply waits for a slot before its body is read), whatever the requests in flight."""
REPLY_BYTES_PER_TOKEN = 150
"""A reply held in parse: its JSON body (33 B a token) and what orjson returns for it (121 B: the
[logprob, id, null] lists, their floats and ints), measured with tracemalloc on a 16-row reply in SGLang's
wire format (bench_reply_parse.one_reply) at 700 and 6,000 tokens."""
JSON_PARSE_BYTES_PER_TOKEN = 400
"""orjson's transient while it parses a reply, above what it returns (its peak is 520 B a token, same
measurement); the parse holds the GIL, so one reply of rank 0's is in it at a time."""
R3_REPLY_BYTES_PER_ID = 6
"""A reply held in parse with R3 routing, per expert id: the base64 of the int32 in its body (16/3 B, kept
with the reply until its rows are made; the JSON parser never sees it, sglang.routing.cut_routed_experts),
and a row's decode at a time (the int32, the narrowed copy and its layer-first copy: 6 B an id of one of
the reply's n rows, under 1 B an id of the reply)."""


@dataclass(frozen=True)
class HostPlan:
    rows: int
    train_rows: int
    response_tokens: int
    world: int
    ranks_per_node: int
    node_memory: int
    rank0: dict[str, int] = field(default_factory=dict)
    other: dict[str, int] = field(default_factory=dict)
    spool_rows: int = 0
    """The queue trainer with R3: rows whose routing files its spool holds at most (0: no spool)."""
    spool: int = 0
    """Bytes of those files on rank 0's node's disk (queue.path's directory), at response_tokens."""

    @property
    def rank0_total(self) -> int:
        return sum(self.rank0.values())

    @property
    def other_total(self) -> int:
        return sum(self.other.values())

    @property
    def node0_total(self) -> int:
        """The node holding rank 0: rank 0 and its node's other ranks."""
        return self.rank0_total + (min(self.ranks_per_node, self.world) - 1) * self.other_total


def data_path(*, rows: int, n: int, train_rows: int, response_tokens: int, max_response_length: int,
              max_prompt_length: int, world: int, text_bytes_per_token: float = 4.0,
              step_tensors: int = 6, routing_ids_per_token: int = 0,
              routing_id_bytes: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """(rank 0's terms, another rank's terms) of one step's data path, bytes (module docstring).

    routing_ids_per_token: R3's expert ids per routed token (num_hidden_layers x top-k; 0: R3 off), each of
    `routing_id_bytes`; a row has max_prompt_length + response_tokens - 1 routed tokens."""
    L, T, P = response_tokens, max_response_length, max_prompt_length
    tokens, kept = rows * L, train_rows * L
    own = math.ceil(rows / world) * L
    dense = train_rows * T * 8 + train_rows * P * 4 + step_tensors * train_rows * T * 4
    rank0 = {"generation batch": tokens * 8 * 2,
             "replies in parse": REPLIES_HELD * n * L * REPLY_BYTES_PER_TOKEN + n * L * JSON_PARSE_BYTES_PER_TOKEN,
             "texts": int(tokens * text_bytes_per_token), "kept rows": kept * 8 * 2, "training batch": dense}
    if routing_ids_per_token:
        routed = P + L - 1
        rank0["r3 routing"] = train_rows * routed * routing_ids_per_token * routing_id_bytes
        rank0["r3 replies in parse"] = REPLIES_HELD * n * routed * routing_ids_per_token * R3_REPLY_BYTES_PER_ID
    other = {"its rows": own * (8 + int(text_bytes_per_token)), "kept rows": kept * 8,
             "training batch": dense}
    return rank0, other


def plan_host(cfg, *, memory_plan=None, response_tokens: int | None = None,
              text_bytes_per_token: float = 4.0) -> HostPlan:
    """The host plan of a resolved Config; memory_plan: memory.py's MemoryPlan (staging, offload, r3 figures)."""
    d, r = cfg.data, cfg.rollout
    rows = d.effective_gen_batch_size * r.n
    train_rows = d.train_batch_size * r.n
    L = response_tokens or d.max_response_length
    step_tensors = 6 + int(cfg.needs_reference)
    rank0, other = data_path(rows=rows, n=r.n, train_rows=train_rows, response_tokens=L,
                             max_response_length=d.max_response_length, max_prompt_length=d.max_prompt_length,
                             world=cfg.trainer.world_size, text_bytes_per_token=text_bytes_per_token,
                             step_tensors=step_tensors)
    every: dict[str, int] = {}
    if memory_plan is not None:
        if cfg.trainer.async_save:
            every["async-save staging"] = memory_plan.actor_params + memory_plan.actor_optimizer
        if memory_plan.offload_optimizer:
            every["pinned optimizer"] = memory_plan.actor_optimizer
        if memory_plan.router_replay_host:
            every["routing records"] = memory_plan.router_replay_host
        if memory_plan.router_replay_rank0:
            rank0["r3 routing"] = memory_plan.router_replay_rank0
        if memory_plan.router_replay_received:  # a replica's first rank at the step (rank 0 sends views)
            other["r3 rows received"] = memory_plan.router_replay_received
    every["process"] = PROCESS_BYTES
    spool_rows = spool = 0
    if cfg.queue.enable and memory_plan is not None and memory_plan.router_replay_rank0:
        # the queue trainer keeps each issued, not yet consumed row's routing in a file (queue/spool.py); the
        # admission window bounds those rows: (max_staleness + 1) x parameter_sync_step generation batches
        per_token = memory_plan.router_replay_rank0 // (train_rows * memory_plan.max_seq_len)  # MoE layers x K x B
        spool_rows = (cfg.queue.max_staleness + 1) * cfg.queue.parameter_sync_step * rows
        spool = spool_rows * (d.max_prompt_length + L - 1) * per_token
    return HostPlan(rows=rows, train_rows=train_rows, response_tokens=L, world=cfg.trainer.world_size,
                    ranks_per_node=cfg.trainer.n_gpus_per_node,
                    node_memory=int(cfg.trainer.host_memory_gib_per_node * GIB),
                    rank0={**rank0, **every}, other={**other, **every}, spool_rows=spool_rows, spool=spool)


def format_host(plan: HostPlan) -> str:
    """The `host:` lines: rank 0, another rank, rank 0's node, against the node's memory."""
    def terms(d: dict[str, int]) -> str:
        return ", ".join(f"{k} {v / GIB:.1f}" for k, v in d.items() if v)

    disk = [f"disk: rank 0's node {plan.spool / GIB:.1f} GiB: the queue's R3 routing files (queue.path's "
             f"directory; {plan.spool_rows:,} issued, not yet consumed rows at most)"] if plan.spool else []
    return "\n".join([
        f"host: rank 0 {plan.rank0_total / GIB:.1f} GiB ({terms(plan.rank0)})",
        f"host: other ranks {plan.other_total / GIB:.1f} GiB each ({terms(plan.other)})",
        f"host: rank 0's node {plan.node0_total / GIB:.1f} GiB of {plan.node_memory / GIB:.0f} GiB "
        f"({min(plan.ranks_per_node, plan.world)} ranks; {plan.rows:,} rows of {plan.response_tokens:,} tokens "
        f"per generation batch, {plan.train_rows:,} trained)", *disk])


def check_host(plan: HostPlan) -> str | None:
    """Why rank 0's node would run out of host memory (trainer.host_memory_gib_per_node), or None."""
    if plan.node0_total <= plan.node_memory:
        return None
    top = sorted(plan.rank0.items(), key=lambda kv: -kv[1])[:3]
    return (f"host memory of rank 0's node: {plan.node0_total / GIB:.1f} GiB > trainer.host_memory_gib_per_node="
            f"{plan.node_memory / GIB:g} GiB (rank 0 {plan.rank0_total / GIB:.1f} GiB, largest: "
            + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in top) + f"; {min(plan.ranks_per_node, plan.world) - 1} "
            f"other ranks {plan.other_total / GIB:.1f} GiB each)")
