"""store.py in one process: round trips, partial reads, tags and filters, claim, delete,
transactions, partitions and every error path."""

import pickle
import sqlite3

import numpy as np
import pytest
import torch

from megatron_dapo.queue import DuplicateKeyError, QueueKeyError, TransferQueue, UnknownPartitionError


@pytest.fixture
def q(tmp_path):
    queue = TransferQueue(tmp_path / "q.sqlite")
    yield queue
    queue.close()


def _prompts(q, uids, **tags):
    return q.put("train", uids, {"raw_prompt": [f"what is {u}?" for u in uids]}, tags)


def test_put_get_roundtrips_every_field_kind(q):
    keys = ["p1_0", "p1_1"]
    g = torch.Generator().manual_seed(0)
    fields = {
        "old_log_probs": torch.randn(2, 5, generator=g),  # batch tensor, row per key
        "hidden": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "responses": [torch.tensor([5, 6, 7]), torch.tensor([8])],  # ragged, per key
        "tokens": [[1, 2, 3], []],
        "rm_scores": [1.0, -1.0],
        "pred": ["42", "[INVALID]"],
        "extra": [{"acc": True, "overlong": 0}, {"acc": False, "overlong": 3}],
        "mask": np.array([[1, 0], [1, 1]], dtype=np.int8),
    }
    q.put("train", keys, fields, {"status": "done", "global_steps": 2})
    out = q.get("train", keys)
    assert sorted(out) == sorted(fields)
    for i in range(2):
        assert torch.equal(out["old_log_probs"][i], fields["old_log_probs"][i])
        assert out["hidden"][i].dtype == torch.bfloat16 and torch.equal(out["hidden"][i], fields["hidden"][i])
        assert out["mask"][i].dtype == np.int8 and np.array_equal(out["mask"][i], fields["mask"][i])
    assert [r.tolist() for r in out["responses"]] == [[5, 6, 7], [8]]
    assert out["tokens"] == [[1, 2, 3], []] and out["rm_scores"] == [1.0, -1.0]
    assert out["pred"] == ["42", "[INVALID]"] and out["extra"] == fields["extra"]


def test_get_returns_keys_order_and_stacks_on_request(q):
    q.put("train", ["a", "b", "c"], {"x": torch.arange(6.0).reshape(3, 2), "s": [1, 2, 3]})
    out = q.get("train", ["c", "a"], ["x", "s"], stack=True)
    assert torch.equal(out["x"], torch.tensor([[4.0, 5.0], [0.0, 1.0]])) and out["s"] == [3, 1]
    assert q.get("train", [], ["x"]) == {"x": []} and q.get("train", ["a"], []) == {}


def test_stack_rejects_differing_shapes_naming_the_field(q):
    q.put("train", ["a_0", "a_1"], {"responses": [torch.ones(2), torch.ones(3)]})
    with pytest.raises(ValueError, match="field 'responses' has differing"):
        q.get("train", ["a_0", "a_1"], ["responses"], stack=True)


def test_partial_reads_return_only_requested_fields(q):
    q.put(
        "train",
        ["p1_0"],
        {"prompts": [[1, 2]], "responses": [[3]], "raw_prompt": ["1+2"], "big": torch.ones(1, 64)},
    )
    assert q.get("train", ["p1_0"], ["responses", "raw_prompt"]) == {
        "responses": [[3]],
        "raw_prompt": ["1+2"],
    }


def test_put_fields_adds_and_overwrites_fields_and_sets_tags(q):
    q.put(
        "train", ["p1_0", "p1_1"], {"responses": [[1], [2]], "rm_scores": [0.0, 0.0]}, {"status": "running"}
    )
    q.put_fields("train", ["p1_1", "p1_0"], {"rm_scores": [1.0, -1.0], "acc": [True, False]}, status="done")
    out = q.get("train", ["p1_0", "p1_1"])
    assert out == {"acc": [False, True], "responses": [[1], [2]], "rm_scores": [-1.0, 1.0]}
    assert [t["status"] for t in q.get_tags("train", ["p1_0", "p1_1"])] == ["done", "done"]
    with pytest.raises(QueueKeyError, match=r"1 keys not present, e\.g\. \['p9_0'\]"):
        q.put_fields("train", ["p1_0", "p9_0"], {"rm_scores": [2.0, 2.0]})
    with pytest.raises(ValueError, match="status='finished'"):
        q.put_fields("train", ["p1_0"], {"rm_scores": [3.0]}, status="finished")
    assert q.get("train", ["p1_0"], ["rm_scores"]) == {"rm_scores": [-1.0]}  # both failures wrote nothing


def test_missing_fields_are_named(q):
    q.put("train", ["p1"], {"raw_prompt": ["x"]})
    q.put("train", ["p1_0"], {"responses": [[1]]})
    with pytest.raises(QueueKeyError, match="field 'responses' is missing for 1 of 2 keys, e.g. \\['p1'\\]"):
        q.get("train", ["p1", "p1_0"], ["responses"])
    with pytest.raises(QueueKeyError, match="pass fields="):
        q.get("train", ["p1", "p1_0"])
    with pytest.raises(QueueKeyError, match="keys not present, e.g. \\['nope'\\]"):
        q.get("train", ["p1", "nope"])
    with pytest.raises(TypeError, match="list of names"):
        q.get("train", ["p1"], "raw_prompt")


def test_put_default_tags_follow_the_key_form(q):
    meta = q.put("train", ["p1", "p1_0"], tags=[{}, {"status": "done", "policy_version": 4}])
    assert [dict(t) for t in meta.tags] == [
        {"is_prompt": True, "status": "pending", "global_steps": 0, "policy_version": None},
        {"is_prompt": False, "status": "done", "global_steps": 0, "policy_version": 4},
    ]
    assert q.get_tags("train", ["p1_0", "p1"]) == [dict(meta.tags[1]), dict(meta.tags[0])]


def test_list_keys_filters_by_tags_in_insertion_order(q):
    _prompts(q, ["p3", "p1", "p2"], global_steps=1)
    q.put("train", ["p1_0", "p1_1", "p2_0"], tags=[{"status": "done", "policy_version": 2}] * 3)
    q.update_tags("train", ["p1"], status="running")
    q.update_tags("train", ["p2"], status="done", global_steps=2)
    assert q.list_keys("train") == ["p3", "p1", "p2", "p1_0", "p1_1", "p2_0"]
    assert q.list_keys("train", is_prompt=True, status=("pending", "running")) == ["p3", "p1"]
    assert q.list_keys("train", is_prompt=True, global_steps=2) == ["p2"]
    assert q.list_keys("train", is_prompt=False, prompt_uid="p1") == ["p1_0", "p1_1"]
    assert q.list_keys("train", policy_version=None) == ["p3", "p1", "p2"]
    assert q.list_keys("train", policy_version=(2, None), limit=4) == ["p3", "p1", "p2", "p1_0"]
    assert q.list_keys("train", status=()) == [] and q.list_keys("train", limit=0) == []
    assert q.count("train", is_prompt=False, status="done") == 3 and q.count("train") == 6


@pytest.mark.parametrize(
    "filters, fragment",
    [
        ({"colour": "red"}, "unknown filter 'colour'"),
        ({"status": "runing"}, "status='runing'"),
        ({"is_prompt": 1}, "is_prompt=1"),
        ({"global_steps": (1, -2)}, "global_steps=-2"),
        ({"limit": -1}, "limit"),
    ],
)
def test_list_keys_rejects_bad_filters_instead_of_matching_nothing(q, filters, fragment):
    _prompts(q, ["p1"])
    with pytest.raises(ValueError, match=fragment):
        q.list_keys("train", **filters)


def test_update_tags_is_conditional_and_atomic(q):
    _prompts(q, ["p1", "p2", "p3"])
    q.update_tags("train", ["p2"], status="running")
    changed = q.update_tags(
        "train", ["p1", "p2", "p3"], where={"status": "pending"}, status="done", policy_version=5
    )
    assert changed == 2
    assert [(t["status"], t["policy_version"]) for t in q.get_tags("train", ["p1", "p2", "p3"])] == [
        ("done", 5),
        ("running", None),
        ("done", 5),
    ]
    with pytest.raises(QueueKeyError, match="'zz'"):
        q.update_tags("train", ["p2", "zz"], status="consumed")
    assert q.get_tags("train", ["p2"])[0]["status"] == "running"
    with pytest.raises(ValueError, match="is_prompt follows the key form"):
        q.update_tags("train", ["p1"], is_prompt=False)
    with pytest.raises(ValueError, match="at least one"):
        q.update_tags("train", ["p1"])


def test_claim_takes_oldest_matching_entries_once(q):
    _prompts(q, ["p1", "p2", "p3", "p4"])
    q.put("train", ["p1_0"])  # a pending trajectory: not a prompt, not claimed by default
    first = q.claim("train", 3)
    assert first.keys == ("p1", "p2", "p3") and {t["status"] for t in first.tags} == {"running"}
    assert q.claim("train", 3).keys == ("p4",)
    assert len(q.claim("train", 3)) == 0 and len(q.claim("train", 0)) == 0
    assert q.claim("train", 5, is_prompt=None).keys == ("p1_0",)
    done = q.claim("train", 2, from_status="running", to_status="done")
    assert done.keys == ("p1", "p2") and q.count("train", status="done") == 2
    with pytest.raises(ValueError, match="from_status"):
        q.claim("train", 1, status="pending")
    with pytest.raises(ValueError, match="n must be an int"):
        q.claim("train", -1)


def test_put_of_existing_key_is_refused_whole_unless_overwrite(q):
    q.put("train", ["p1_0"], {"responses": [[1]], "rm_scores": [1.0]})
    with pytest.raises(DuplicateKeyError, match="\\['p1_0'\\].*overwrite=True"):
        q.put("train", ["p1_1", "p1_0"], {"responses": [[2], [3]]})
    assert q.list_keys("train") == ["p1_0"]  # p1_1 was not written either
    q.put("train", ["p1_0"], {"responses": [[9]]}, {"status": "done"}, overwrite=True)
    assert q.get("train", ["p1_0"]) == {"responses": [[9]]}  # old rm_scores gone with the old entry
    assert q.get_tags("train", ["p1_0"])[0]["status"] == "done"


@pytest.mark.parametrize(
    "keys, fields, tags, exc, fragment",
    [
        (["a_b_1"], None, None, ValueError, "key 'a_b_1'"),
        (["p1", "p1"], None, None, ValueError, "duplicate keys ['p1']"),
        ("p1", None, None, TypeError, "keys must be a sequence"),
        (["p1", "p2"], {"x": [1]}, None, ValueError, "field 'x': expected 2 values"),
        (["p1"], {"x": [object()]}, None, TypeError, "field 'x' of key 'p1'"),
        (["p1"], {"": [1]}, None, ValueError, "field name ''"),
        (["p1_0"], None, {"is_prompt": True}, ValueError, "key 'p1_0': tag is_prompt=True contradicts"),
        (["p1"], None, {"status": "finished"}, ValueError, "status='finished' (key 'p1')"),
        (["p1"], None, {"colour": 1}, ValueError, "unknown tag 'colour'"),
        (["p1", "p2"], None, [{}], ValueError, "a list of 2 dicts"),
        (["p1", "p2"], None, "ab", ValueError, "tags for key 'p1': expected a dict, got str"),
    ],
)
def test_bad_puts_name_the_offender_and_write_nothing(q, keys, fields, tags, exc, fragment):
    with pytest.raises(exc) as err:
        q.put("train", keys, fields, tags)
    assert fragment in str(err.value)
    assert "train" not in q.partitions()


def test_delete_removes_entries_and_fields(q):
    q.put("train", ["p1_0", "p1_1"], {"responses": [[1], [2]]})
    assert q.delete("train", ["p1_0"]) == 1
    with pytest.raises(QueueKeyError, match="cannot delete missing keys \\['p1_0'\\]"):
        q.delete("train", ["p1_1", "p1_0"])
    assert q.list_keys("train") == ["p1_1"]  # the failed delete changed nothing
    assert q.delete("train", ["p1_1", "p1_0"], missing_ok=True) == 1
    q.put("train", ["p1_0"], {"rm_scores": [0.5]})  # re-put: no stale fields come back
    assert q.get("train", ["p1_0"]) == {"rm_scores": [0.5]}


def test_delete_trajectories_matches_the_exact_prompt_id(q):
    _prompts(q, ["p1", "p10"])
    q.put("train", ["p1_0", "p1_1", "p10_0", "p10_11"], {"r": [[0]] * 4})
    assert q.delete_trajectories("train", "p1") == 2
    assert q.list_keys("train") == ["p1", "p10", "p10_0", "p10_11"]
    assert q.delete_trajectories("train", ["p10", "p99"]) == 2 and q.list_keys("train") == ["p1", "p10"]
    with pytest.raises(ValueError, match="'p1_0' is a trajectory key"):
        q.delete_trajectories("train", ["p1_0"])


def test_unknown_partition_reads_raise_and_put_creates(q):
    for call in (
        lambda: q.list_keys("val"),
        lambda: q.count("val"),
        lambda: q.get("val", ["p1"]),
        lambda: q.get_tags("val", []),
        lambda: q.claim("val", 1),
        lambda: q.drop_partition("val"),
        lambda: q.update_tags("val", ["p1"], status="done"),
    ):
        with pytest.raises(UnknownPartitionError, match="partition 'val' does not exist"):
            call()
    q.create_partition("val")
    q.create_partition("val")  # idempotent
    assert q.list_keys("val") == [] and q.partitions() == ["val"]
    _prompts(q, ["p1"])
    q.put("val", ["p1"], {"raw_prompt": ["other"]})  # same key, other partition: independent
    assert q.get("val", ["p1"]) == {"raw_prompt": ["other"]} and q.partitions() == ["train", "val"]
    assert q.drop_partition("val") == 1 and q.partitions() == ["train"]
    assert q.get("train", ["p1"]) == {"raw_prompt": ["what is p1?"]}


def test_transaction_commits_all_or_nothing(q):
    _prompts(q, ["p1", "p2"])
    with pytest.raises(RuntimeError, match="boom"):
        with q.transaction():
            q.claim("train", 2)
            q.put("train", ["p1_0"], {"r": [[1]]})
            raise RuntimeError("boom")
    assert q.list_keys("train", status="pending") == ["p1", "p2"] and q.count("train") == 2
    with q.transaction():
        meta = q.claim("train", 1)
        with pytest.raises(ValueError, match="status='bogus'"):
            # writes the field, then fails on the tag: undone alone (a savepoint), the claim stands
            q.put_fields("train", ["p2"], {"x": [1]}, status="bogus")
        q.update_tags("train", meta.keys, policy_version=3)
    assert q.get_tags("train", ["p1"])[0] == {
        "is_prompt": True,
        "status": "running",
        "global_steps": 0,
        "policy_version": 3,
    }
    assert q.get("train", ["p2"]) == {"raw_prompt": ["what is p2?"]}


def test_reopen_and_pickle_see_the_same_store(q, tmp_path):
    _prompts(q, ["p1"])
    clone = pickle.loads(pickle.dumps(q))
    assert clone.path == q.path and clone.get("train", ["p1"]) == {"raw_prompt": ["what is p1?"]}
    clone.put("train", ["p1_0"])
    again = TransferQueue(tmp_path / "q.sqlite")
    assert again.list_keys("train") == ["p1", "p1_0"]
    clone.close()
    again.close()


def test_store_is_wal_with_chosen_durability(tmp_path):
    path = tmp_path / "d.sqlite"
    for durability, level in (("process", 1), ("power", 2)):  # PRAGMA synchronous: 1 NORMAL, 2 FULL
        queue = TransferQueue(path, durability=durability)
        assert queue._conn().execute("PRAGMA synchronous").fetchone()[0] == level  # per connection
        queue.close()
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with pytest.raises(ValueError, match="durability='disk'"):
        TransferQueue(path, durability="disk")
    with pytest.raises(ValueError, match="expected a file path"):
        TransferQueue(":memory:")


def test_closed_queue_and_foreign_schema_fail_loudly(tmp_path):
    path = tmp_path / "s.sqlite"
    queue = TransferQueue(path)
    queue.close()
    with pytest.raises(RuntimeError, match="is closed"):
        queue.list_keys("train")
    con = sqlite3.connect(path)
    con.execute("UPDATE meta SET value = '99' WHERE name = 'schema_version'")
    con.commit()
    con.close()
    with pytest.raises(RuntimeError, match="schema version '99'"):
        TransferQueue(path)
