"""The stand-in server's shared state, its reply exception and the generation preconditions."""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import traceback
from typing import Any

from tests.standin.protocol import Protocol, value_error
from tests.standin.rwlock import RWLock

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
KNOBS = {"delay_s": 0.0, "token_delay_s": 0.0, "fail_next": 0, "fail_status": 503, "malform": None,
         "kill_after_tokens": None, "health_delay_s": 0.0}
MALFORMS = (None, "logprobs_short", "finish_reason", "output_ids", "not_list", "spec_negative")


class Reply(Exception):
    """Answer the request with `status` and `body` (JSON, or text when a str)."""

    def __init__(self, status: int, body: Any = None):
        super().__init__(status)
        self.status, self.body = status, body


class RankError(Exception):
    """An error on one TP receiver rank (weights.Ranks.run)."""

    def __init__(self, rank: int, error: Exception):
        super().__init__(f"TP rank {rank}: {type(error).__name__}: {error}")
        self.rank, self.error = rank, error


class State:
    """Everything the handlers share; `lock` guards the mutable records."""

    def __init__(self, args, proto: Protocol):
        self.args, self.proto = args, proto
        self.lock = threading.Lock()
        self.rw = RWLock()  # SGLang's model_update_lock: generate = reader, weight update = writer
        self.scheduler = threading.Lock()  # control requests run one at a time, as in the scheduler
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.model = None
        self.draft = None  # draft.DraftModel of an HF model served with --speculative-algorithm (toy: None)
        self.ranks = None
        self.roles = ["target"] + (["draft"] if args.speculative_algorithm else [])
        self.role_weights: dict[str, list[dict]] = {}
        self.requests: list = []
        self.ignored: dict[str, set[str]] = {}
        self.knobs = dict(KNOBS)
        self.inflight: dict[str, threading.Event] = {}
        self.generate_inflight = self.generate_max_inflight = 0
        self.tokens_generated = 0
        self.weight_version = "default"
        self.released: set[str] = set()
        self.stale: set[str] = set()
        self.session: dict | None = None
        self.rng = random.Random()
        self.start_time = time.time()

    def get_ranks(self):
        """The TP receiver ranks, made on the first weight route (a toy server never imports torch)."""
        with self.lock:
            if self.ranks is None:
                from tests.standin.weights import Ranks

                self.ranks = Ranks(self.args.tp_size, timeout_s=self.args.receive_timeout_s)
            return self.ranks

    @property
    def has_sessions(self) -> bool:
        return self.proto.has_route("/begin_weight_update", "POST")

    def record(self, path: str, body: Any) -> None:
        if isinstance(body, dict) and isinstance(body.get("serialized_named_tensors"), list):
            body = {**body, "serialized_named_tensors": [f"<{len(s)} base64 chars>" if isinstance(s, str) else s
                                                         for s in body["serialized_named_tensors"]]}
        with self.lock:
            self.requests.append([path, body])

    def crash(self, where: str, exc: BaseException) -> None:
        """What an exception in SGLang's scheduler does: log it and take the whole server down."""
        tb = "".join(traceback.format_exception(exc))
        print(f"[{where}] Scheduler hit an exception: {tb}", file=sys.stderr, flush=True)
        os._exit(1)


def check_can_generate(st: State, what: str = "generate") -> None:
    """Before a forward (a /generate request, or the one-token generation of /health).

    With --enable-memory-saver, released weights or KV cache kill the server, as on a GPU under SGLang
    0.5.23: a release does not pause the scheduler (scheduler_components/weight_updater.py:337-378), so the
    request is scheduled and its forward reads weights and writes KV in address ranges torch_memory_saver
    unmapped without a CPU copy; CUDA reports an illegal memory access and the scheduler process dies,
    taking the server with it."""
    if st.released:
        st.crash(what, RuntimeError(
            f"CUDA error: an illegal memory access was encountered (a forward while {sorted(st.released)} are "
            "released by /release_memory_occupation)"))
    if st.stale:
        raise value_error(f"the weights were resumed without --enable-weights-cpu-backup and {len(st.stale)} "
                          f"tensors were not updated since (e.g. {sorted(st.stale)[:3]}); update every weight first")
