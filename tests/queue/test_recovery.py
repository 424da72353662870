"""recovery.py: reissue_inflight_prompts resets exactly the pending/running prompts, deletes exactly
their trajectories, leaves everything else alone, and is a no-op in sync mode."""

import multiprocessing as mp
import os
import signal

import pytest
import torch

from megatron_dapo.queue import TransferQueue, reissue_inflight_prompts, trajectory_key

_CTX = mp.get_context("fork")


@pytest.fixture
def q(tmp_path):
    queue = TransferQueue(tmp_path / "q.sqlite")
    # prompt uid -> (status, number of trajectories already written)
    layout = {
        "pA": ("pending", 0),
        "pB": ("running", 2),
        "pC": ("done", 3),
        "pD": ("consumed", 1),
        "pE": ("running", 1),
        "pB1": ("done", 2),
    }  # pB1: prefix of its keys starts with "pB"
    for uid, (status, n_traj) in layout.items():
        queue.put(
            "train",
            [uid],
            {"raw_prompt": [f"q-{uid}"]},
            {"status": status, "global_steps": 1, "policy_version": 0},
        )
        keys = [trajectory_key(uid, i) for i in range(n_traj)]
        queue.put(
            "train",
            keys,
            {"responses": torch.arange(n_traj * 2).reshape(n_traj, 2)},
            {"status": "consumed" if status == "consumed" else "done", "global_steps": 1},
        )
    queue.put("val", ["vX", "vX_0"], tags=[{"status": "running"}, {"status": "done"}])
    yield queue
    queue.close()


def _snapshot(queue, partition):
    keys = queue.list_keys(partition)
    return keys, queue.get_tags(partition, keys)


def test_reissue_resets_inflight_prompts_and_deletes_only_their_trajectories(q):
    untouched = ["pC", "pC_0", "pC_1", "pC_2", "pD", "pD_0", "pB1", "pB1_0", "pB1_1"]
    before = dict(zip(untouched, q.get_tags("train", untouched), strict=True))
    val_before = _snapshot(q, "val")

    n, meta = reissue_inflight_prompts(q, "train", global_steps=5, sync_mode=False)

    assert n == 3 and meta.partition_id == "train" and meta.keys == ("pA", "pB", "pE")
    expected_tags = {"is_prompt": True, "status": "pending", "global_steps": 5, "policy_version": 0}
    assert [dict(t) for t in meta.tags] == [expected_tags] * 3
    assert q.get_tags("train", ["pA", "pB", "pE"]) == [expected_tags] * 3
    assert q.count("train", prompt_uid=("pA", "pB", "pE"), is_prompt=False) == 0  # pB_0, pB_1, pE_0 gone
    assert q.get("train", ["pA", "pB", "pE"]) == {"raw_prompt": ["q-pA", "q-pB", "q-pE"]}  # prompt data kept
    assert dict(zip(untouched, q.get_tags("train", untouched), strict=True)) == before
    assert torch.equal(q.get("train", ["pC_2"])["responses"][0], torch.tensor([4, 5]))
    assert q.count("train") == 6 + 3 + 1 + 2  # prompts + pC_* + pD_0 + pB1_*
    assert _snapshot(q, "val") == val_before  # other partitions are not touched


def test_reissue_is_idempotent(q):
    first = reissue_inflight_prompts(q, "train", global_steps=5, sync_mode=False)
    state = _snapshot(q, "train")
    second = reissue_inflight_prompts(q, "train", global_steps=5, sync_mode=False)
    assert second == first and _snapshot(q, "train") == state


def test_sync_mode_returns_zero_and_changes_nothing(q):
    state = _snapshot(q, "train")
    n, meta = reissue_inflight_prompts(q, "train", global_steps=5, sync_mode=True)
    assert n == 0 and len(meta) == 0 and meta.partition_id == "train"
    assert _snapshot(q, "train") == state


def test_unknown_or_settled_partition_has_nothing_to_reissue(q):
    assert reissue_inflight_prompts(q, "fresh", global_steps=0, sync_mode=False)[0] == 0
    assert "fresh" not in q.partitions()  # recovery does not create partitions
    q.put("done-only", ["p1", "p1_0"], tags=[{"status": "done"}, {"status": "done"}])
    assert reissue_inflight_prompts(q, "done-only", global_steps=0, sync_mode=False)[0] == 0


def test_reissue_is_one_transaction(q, monkeypatch):
    state = _snapshot(q, "train")

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(q, "update_tags", fail)  # fails after the trajectories were deleted
    with pytest.raises(OSError, match="disk full"):
        reissue_inflight_prompts(q, "train", global_steps=5, sync_mode=False)
    assert _snapshot(q, "train") == state  # the deletion was rolled back


def test_reissue_rejects_bad_global_steps(q):
    with pytest.raises(ValueError, match="global_steps=-1"):
        reissue_inflight_prompts(q, "train", global_steps=-1, sync_mode=False)


def _generate_then_crash(path, conn):
    queue = TransferQueue(path)
    meta = queue.claim("train", 2)  # pending -> running
    uid = meta.keys[0]
    queue.put(
        "train", [trajectory_key(uid, 0)], {"responses": [[1, 2, 3]]}, {"status": "done"}
    )  # 1 of 2 written
    conn.send(list(meta.keys))
    os.kill(os.getpid(), signal.SIGKILL)


def test_crash_mid_generation_then_reissue_leaves_no_partial_group(tmp_path):
    path = tmp_path / "q.sqlite"
    queue = TransferQueue(path)
    queue.put("train", ["p1", "p2", "p3"], {"raw_prompt": ["a", "b", "c"]}, {"global_steps": 4})
    parent_end, child_end = _CTX.Pipe()
    proc = _CTX.Process(target=_generate_then_crash, args=(path, child_end))
    proc.start()
    assert parent_end.poll(30) and parent_end.recv() == ["p1", "p2"]
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    assert (
        queue.list_keys("train", status="running") == ["p1", "p2"]
        and queue.count("train", is_prompt=False) == 1
    )

    n, meta = reissue_inflight_prompts(queue, "train", global_steps=7, sync_mode=False)

    assert n == 3 and meta.keys == ("p1", "p2", "p3")
    assert queue.list_keys("train") == ["p1", "p2", "p3"]
    assert {(t["status"], t["global_steps"]) for t in queue.get_tags("train", meta.keys)} == {("pending", 7)}
    assert queue.claim("train", 3).keys == ("p1", "p2", "p3")  # generation can restart for all three
