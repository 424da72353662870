"""Weight-sync bucketing and payloads, and the colocated /update_weights_from_tensor path end to end."""

import base64
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from megatron_dapo.rollout import sglang_weights as sw
from megatron_dapo.rollout.base import RolloutEngineError
from megatron_dapo.rollout.sglang_engine import EngineRequestError, SGLangEngine

from .sglang_protocol_server import ProtocolServer


def _named():
    # float32 sizes in bytes: a 400, b 400, c 1200 (larger than a 1000-byte bucket), d 200, e 800
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(10, 10, generator=g)),
        ("b", torch.randn(100, generator=g)),
        ("c", torch.randn(3, 100, generator=g)),
        ("d", torch.randn(50, generator=g)),
        ("e", torch.randn(2, 100, generator=g)),
    ]


def test_buckets_keep_order_stay_within_size_and_oversize_tensors_go_alone():
    buckets = list(sw.bucket_named_tensors(_named(), bucket_bytes=1000))
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d", "e"]]
    for b in buckets:
        size = sum(sw.tensor_nbytes(t) for _, t in b)
        assert size <= 1000 or len(b) == 1
    assert [[n for n, _ in b] for b in sw.bucket_named_tensors(_named(), bucket_bytes=10**6)] == [
        ["a", "b", "c", "d", "e"]
    ]
    assert list(sw.bucket_named_tensors([], bucket_bytes=10)) == []


def test_bucketing_rejects_duplicates_non_tensors_and_bad_sizes():
    with pytest.raises(ValueError, match=r"named_tensors\[1\]: parameter 'a' appears twice"):
        list(sw.bucket_named_tensors([("a", torch.ones(1)), ("a", torch.ones(1))], bucket_bytes=100))
    with pytest.raises(TypeError, match=r"named_tensors\[0\] \('a'\) is a list"):
        list(sw.bucket_named_tensors([("a", [1.0])], bucket_bytes=100))
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(sw.bucket_named_tensors([], bucket_bytes=0))


def test_dtype_names_read_back_with_getattr_torch():
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.float8_e4m3fn):
        assert getattr(torch, sw.dtype_name(dt)) is dt
    assert sw.dtype_name(torch.bfloat16) == "bfloat16"


def test_serialized_bucket_round_trips_through_forking_pickler():
    named = _named()[:2] + [("h", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t())]  # non-contiguous
    text = sw.serialize_named_tensors(named)
    back = ForkingPickler.loads(base64.b64decode(text, validate=True))
    assert [n for n, _ in back] == ["a", "b", "h"]
    for (_, want), (_, got) in zip(named, back, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_distributed_payload_lists_names_dtypes_shapes_in_bucket_order():
    bucket = [("w", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(3))]
    p = sw.distributed_update_payload(bucket, group_name="g", flush_cache=False, weight_version=None)
    assert p == {
        "names": ["w", "b"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[2, 3], [3]],
        "group_name": "g",
        "flush_cache": False,
        "weight_version": None,
    }


def test_weight_group_layout_gives_each_server_tp_rank_its_own_rank():
    assert sw.weight_group_layout([2, 2, 4]) == ([1, 3, 5], 9)
    assert sw.weight_group_layout([1]) == ([1], 2)
    with pytest.raises(ValueError, match=r"tp_sizes\[1\]"):
        sw.weight_group_layout([1, 0])


@pytest.mark.parametrize("tp_size", [1, 2])
def test_colocated_update_sends_size_bounded_buckets_and_the_version_last(tp_size):
    with ProtocolServer() as a, ProtocolServer() as b:
        for s in (a, b):
            s.state.tp_size = tp_size
        with SGLangEngine([a.url, b.url], tp_size=tp_size) as eng:
            eng.update_weights(_named(), policy_version=7, bucket_mb=1000 / sw.MIB)
            assert eng.policy_version == 7
        for s in (a, b):
            assert [[n for n, *_ in bk] for bk in s.state.tensor_buckets] == [["a", "b"], ["c"], ["d", "e"]]
            for bk in s.state.tensor_buckets:
                assert sum(nbytes for *_, nbytes in bk) <= 1000 or len(bk) == 1
            bodies = s.state.bodies("/update_weights_from_tensor")
            assert [len(x["serialized_named_tensors"]) for x in bodies] == [tp_size] * 3
            assert [x["flush_cache"] for x in bodies] == [False, False, True]
            assert [x["weight_version"] for x in bodies] == [None, None, "7"]
            for name, t in _named():
                assert torch.equal(s.state.weights[name], t)


def test_update_weights_dispatch_disk_version_only_and_order_checks():
    with ProtocolServer() as s, SGLangEngine([s.url], policy_version=2) as eng:
        eng.update_weights(model_path="/ckpt/step3", policy_version=3)
        assert s.state.bodies("/update_weights_from_disk") == [
            {"model_path": "/ckpt/step3", "weight_version": "3"}
        ]
        eng.update_weights(policy_version=4)  # weights pushed by the caller: only the version moves
        assert eng.policy_version == 4 and s.state.paths().count("/update_weights_from_tensor") == 0
        with pytest.raises(ValueError, match=r"policy_version must be an int >= 4 \(current\), got 3"):
            eng.update_weights(policy_version=3)
        with pytest.raises(RolloutEngineError, match="needs init_weights_update_group first"):
            eng.update_weights_from_distributed(_named(), bucket_mb=1, policy_version=5)
        with pytest.raises(ValueError, match="bucket_mb must be > 0"):
            eng.update_weights(_named(), policy_version=5, bucket_mb=0)


def test_a_server_rejecting_an_update_raises_naming_it():
    with ProtocolServer() as s, SGLangEngine([s.url], tp_size=2) as eng:
        # the server expects one entry per TP rank (1 here); the engine sends 2
        with pytest.raises(
            EngineRequestError, match=r"/update_weights_from_tensor: HTTP 400: .*one per TP rank"
        ):
            eng.update_weights(_named()[:1], policy_version=1, bucket_mb=1)
        assert eng.policy_version == 0  # a failed update leaves the version alone
