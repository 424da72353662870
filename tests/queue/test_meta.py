"""meta.py: the key rule (prompt id = part before `_`), tag checks, and KVBatchMeta helpers."""

import dataclasses

import numpy as np
import pytest

from megatron_dapo.queue import KVBatchMeta, parse_key, prompt_uid_of, trajectory_key
from megatron_dapo.queue.meta import check_tag


@pytest.mark.parametrize(
    "key, parsed",
    [
        ("p1", ("p1", None)),
        ("p1_0", ("p1", 0)),
        ("p10_12", ("p10", 12)),
        ("3f2a-9c.ds:aime/2024#7", ("3f2a-9c.ds:aime/2024#7", None)),
        ("3f2a-9c_15", ("3f2a-9c", 15)),
    ],
)
def test_parse_key_splits_prompt_id_and_trajectory_index(key, parsed):
    assert parse_key(key) == parsed
    assert prompt_uid_of(key) == parsed[0]


@pytest.mark.parametrize("key", ["", "a_b_1", "p_", "_1", "p_01", "p_-1", "p 1", "p\n", "p_x", "\u00e9"])
def test_parse_key_rejects_ambiguous_or_malformed_keys_naming_them(key):
    with pytest.raises(ValueError) as err:
        parse_key(key)
    assert repr(key) in str(err.value) and "part before '_'" in str(err.value)


def test_parse_key_rejects_non_strings():
    with pytest.raises(TypeError, match="key 5: expected str"):
        parse_key(5)


def test_trajectory_key_is_inverse_of_parse_key():
    assert trajectory_key("p1", 0) == "p1_0"
    assert parse_key(trajectory_key("uid-9", 31)) == ("uid-9", 31)
    with pytest.raises(ValueError, match="itself a trajectory key"):
        trajectory_key("p1_0", 1)
    with pytest.raises(ValueError, match="expected an int >= 0"):
        trajectory_key("p1", -1)
    with pytest.raises(ValueError, match="expected an int >= 0"):
        trajectory_key("p1", True)


def test_check_tag_accepts_numpy_scalars_and_rejects_bad_values():
    assert check_tag("global_steps", np.int64(3)) == 3 and type(check_tag("global_steps", np.int64(3))) is int
    assert check_tag("is_prompt", np.bool_(True)) is True
    assert check_tag("policy_version", None) is None
    for name, value in [
        ("status", "runing"),
        ("status", None),
        ("global_steps", -1),
        ("global_steps", True),
        ("global_steps", None),
        ("global_steps", 1.0),
        ("is_prompt", 1),
        ("color", "red"),
    ]:
        with pytest.raises(ValueError, match=name):
            check_tag(name, value, key="p1")


def _meta(keys=("a", "b", "c")):
    return KVBatchMeta(
        "train", keys, tuple({"status": "pending", "global_steps": i} for i in range(len(keys)))
    )


def test_meta_select_and_concat_keep_keys_aligned_with_tags():
    meta = _meta()
    picked = meta.select([2, 0])
    assert picked.keys == ("c", "a") and [t["global_steps"] for t in picked.tags] == [2, 0]
    assert meta.select(slice(1, None)).keys == ("b", "c")
    joined = KVBatchMeta.concat([meta.select([0]), meta.select([1, 2])])
    assert joined == meta and len(joined) == 3


def test_meta_concat_rejects_mixed_partitions_and_repeated_keys():
    with pytest.raises(ValueError, match="different partitions"):
        KVBatchMeta.concat([_meta(), KVBatchMeta("val", ("x",), ({},))])
    with pytest.raises(ValueError, match="duplicate keys \\['a'\\]"):
        KVBatchMeta.concat([_meta(), _meta(("a",))])
    with pytest.raises(ValueError, match="at least one"):
        KVBatchMeta.concat([])


def test_meta_json_roundtrip_is_identity():
    meta = _meta(("p1", "p1_0"))
    again = KVBatchMeta.from_json(meta.to_json())
    assert (
        again == meta
        and again.keys == ("p1", "p1_0")
        and dict(again.tags[1]) == {"status": "pending", "global_steps": 1}
    )
    with pytest.raises(ValueError, match="partition_id, keys, tags"):
        KVBatchMeta.from_json('{"keys": []}')


def test_meta_is_immutable_and_validated():
    meta = _meta()
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.keys = ("z",)
    with pytest.raises(TypeError):
        meta.tags[0]["status"] = "done"  # tags are read-only mappings
    with pytest.raises(ValueError, match="2 keys but 1 tag dicts"):
        KVBatchMeta("train", ("a", "b"), ({},))
    with pytest.raises(ValueError, match="duplicate keys"):
        KVBatchMeta("train", ("a", "a"), ({}, {}))
    with pytest.raises(ValueError, match="partition ''"):
        KVBatchMeta.empty("")
    assert len(KVBatchMeta.empty("train")) == 0
    assert _meta().prompt_uids == ("a", "b", "c") and _meta(("p1_0", "p2")).prompt_uids == ("p1", "p2")
