"""Several real processes (and threads) on one store: exclusive claims, concurrent producers, and
a SIGKILL that loses exactly the uncommitted transaction.

Children are forked (fast: no re-import of torch); the claim test opens the store afresh in each
child, the producer test reuses the parent's already-connected object across fork.
"""

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from megatron_dapo.queue import TransferQueue

_CTX = mp.get_context("fork")
_JOIN_S = 30


def _claimer(path, barrier, out, batch):
    queue = TransferQueue(path)
    barrier.wait()
    claimed = []
    while meta := queue.claim("train", batch):
        claimed += meta.keys
        # Stand-in for generation work. Without it one process can win every claim: SQLite's busy
        # handler backs off by sleeping while the winner re-takes the lock at once.
        time.sleep(0.001)
    out.put(claimed)


def test_two_processes_never_claim_the_same_key(tmp_path):
    path = tmp_path / "q.sqlite"
    queue = TransferQueue(path)
    keys = [f"p{i}" for i in range(300)]
    queue.put("train", keys)
    barrier, out = _CTX.Barrier(2), _CTX.Queue()
    procs = [_CTX.Process(target=_claimer, args=(path, barrier, out, 2)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=_JOIN_S) for _ in procs]
    for p in procs:
        p.join(_JOIN_S)
        assert p.exitcode == 0
    union = results[0] + results[1]
    assert len(union) == len(set(union)) == len(keys) and set(union) == set(keys)
    assert all(results), "both claimers should have won some keys (otherwise nothing raced)"
    assert queue.count("train", status="running") == len(keys)


def _producer(queue, barrier, worker, n_puts):
    barrier.wait()
    for i in range(n_puts):
        key = f"w{worker}-{i}_0"
        queue.put(
            "train",
            [key],
            {"x": torch.full((1, 3), float(worker * 1000 + i)), "src": [worker]},
            {"status": "done", "global_steps": i},
        )


def test_four_producer_processes_put_concurrently_and_all_land(tmp_path):
    queue = TransferQueue(tmp_path / "q.sqlite")
    queue.create_partition("train")  # the parent's connection is open when the children fork
    n_workers, n_puts = 4, 50
    barrier = _CTX.Barrier(n_workers)
    procs = [_CTX.Process(target=_producer, args=(queue, barrier, w, n_puts)) for w in range(n_workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(_JOIN_S)
        assert p.exitcode == 0
    assert queue.count("train") == n_workers * n_puts
    keys = [f"w{w}-{i}_0" for w in range(n_workers) for i in range(n_puts)]
    out = queue.get("train", keys, stack=True)
    expected = torch.tensor([float(w * 1000 + i) for w in range(n_workers) for i in range(n_puts)])
    assert torch.equal(out["x"], expected[:, None].expand(-1, 3))
    assert out["src"] == [w for w in range(n_workers) for _ in range(n_puts)]
    assert [t["global_steps"] for t in queue.get_tags("train", keys)] == list(range(n_puts)) * n_workers


def test_threads_sharing_one_queue_object_claim_disjoint_keys(tmp_path):
    queue = TransferQueue(tmp_path / "q.sqlite")
    queue.put("train", [f"p{i}" for i in range(120)])
    results = [[] for _ in range(4)]

    def work(slot):
        while meta := queue.claim("train", 3):
            results[slot] += meta.keys

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_JOIN_S)
    union = [k for r in results for k in r]
    assert len(union) == len(set(union)) == 120


def _crashing_writer(path, conn, n_committed):
    queue = TransferQueue(path)
    for i in range(n_committed):
        queue.put("train", [f"c{i}"], {"x": torch.full((1, 4), float(i)), "tokens": [[i] * (i + 1)]})
    with queue.transaction():
        queue.put("train", [f"u{i}" for i in range(20)], {"x": torch.ones(20, 4), "tokens": [[7]] * 20})
        queue.update_tags("train", ["c0"], status="done")
        conn.send("holding an open transaction")
        time.sleep(_JOIN_S)  # killed here, before COMMIT
    conn.send("should never get here")


@pytest.mark.parametrize("durability", ["process", "power"])
def test_sigkill_keeps_every_committed_entry_and_no_partial_one(tmp_path, durability):
    path, n_committed = tmp_path / "q.sqlite", 25
    TransferQueue(path, durability=durability).close()
    parent_end, child_end = _CTX.Pipe()
    proc = _CTX.Process(target=_crashing_writer, args=(path, child_end, n_committed))
    proc.start()
    assert parent_end.poll(_JOIN_S) and parent_end.recv() == "holding an open transaction"
    # WAL: readers are not blocked by the open write, and do not see it.
    reader = TransferQueue(path, busy_timeout_s=5)
    assert reader.count("train") == n_committed
    reader.close()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(_JOIN_S)
    assert proc.exitcode == -signal.SIGKILL

    queue = TransferQueue(path, durability=durability)
    keys = [f"c{i}" for i in range(n_committed)]
    assert queue.list_keys("train") == keys
    out = queue.get("train", keys, stack=True)
    assert torch.equal(out["x"], torch.arange(n_committed, dtype=torch.float32)[:, None].expand(-1, 4))
    assert out["tokens"] == [[i] * (i + 1) for i in range(n_committed)]
    assert queue.get_tags("train", ["c0"])[0]["status"] == "pending"
    queue.put("train", ["u0"])  # the killed writer's lock is gone
    assert queue.count("train") == n_committed + 1
