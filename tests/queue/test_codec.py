"""codec.py: every field kind round-trips exactly; unsupported values and pickles are refused."""

import pickle

import numpy as np
import pytest
import torch

from megatron_dapo.queue import codec


def _roundtrip(value):
    kind, blob = codec.encode_value(value, field="f", key="k")
    assert isinstance(blob, bytes)
    return kind, codec.decode_value(kind, blob, field="f", key="k")


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
        torch.randn(2, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        torch.arange(-3, 4, dtype=torch.int64) * (2**40),
        torch.tensor(2.5),  # 0-dim
        torch.zeros(0, 3),  # empty
        torch.tensor([True, False, True]),
        torch.tensor([[1, 2], [3, 255]], dtype=torch.uint8),
        torch.tensor([0.1, -0.0, float("inf"), float("nan")], dtype=torch.float16),
        torch.arange(24, dtype=torch.int32).reshape(2, 3, 4),
    ],
    ids=["fp32", "bf16", "int64", "scalar", "empty", "bool", "uint8", "fp16-special", "int32-3d"],
)
def test_tensor_roundtrip_preserves_dtype_shape_and_bits(tensor):
    kind, out = _roundtrip(tensor)
    assert kind == codec.KIND_TENSOR
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    torch.testing.assert_close(out, tensor, rtol=0, atol=0, equal_nan=True)


def test_non_contiguous_and_grad_tensors_store_their_values():
    base = torch.arange(12.0).reshape(3, 4)
    _, out = _roundtrip(base.t())  # a strided view
    assert torch.equal(out, base.t()) and out.is_contiguous()
    _, out = _roundtrip(torch.ones(2, requires_grad=True) * 3)
    assert not out.requires_grad and torch.equal(out, torch.full((2,), 3.0))


def test_decoded_tensor_is_writable_and_owns_its_memory():
    _, out = _roundtrip(torch.arange(4.0))
    out.add_(1)  # would raise or warn on a read-only buffer
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_ndarray_roundtrip_stays_ndarray():
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    kind, out = _roundtrip(arr)
    assert kind == codec.KIND_NDARRAY and isinstance(out, np.ndarray)
    assert out.dtype == np.int16 and np.array_equal(out, arr)


@pytest.mark.parametrize(
    "value",
    [
        [151644, 8948, 198, 0, 2**40],  # token list
        [],
        None,
        True,
        0,
        -(2**62),
        0.1,
        -0.0,
        "Answer: \\boxed{42} -- naive \u00e9",
        {"acc": True, "pred": "42", "score": 1.0, "nested": {"x": [1, 2.5, None]}},
        [[1, 2], [3]],
    ],
)
def test_json_values_roundtrip_with_types_kept(value):
    kind, out = _roundtrip(value)
    assert kind == codec.KIND_JSON
    assert out == value and type(out) is type(value)
    if isinstance(value, float):
        assert repr(out) == repr(value)  # -0.0 keeps its sign, floats are exact


def test_json_keeps_nan_and_inf_and_turns_tuples_into_lists():
    _, out = _roundtrip([float("nan"), float("inf"), -float("inf")])
    assert np.isnan(out[0]) and out[1:] == [float("inf"), -float("inf")]
    _, out = _roundtrip((1, 2, (3,)))
    assert out == [1, 2, [3]]


def test_numpy_scalars_are_stored_as_python_scalars():
    _, out = _roundtrip({"a": np.int64(7), "b": np.float32(0.5), "c": [np.bool_(True)]})
    assert out == {"a": 7, "b": 0.5, "c": [True]}
    assert type(out["a"]) is int and type(out["c"][0]) is bool


@pytest.mark.parametrize(
    "value, fragment",
    [
        (object(), "value is of unsupported type object"),
        ({1: "a"}, "value key 1 is a int dict key"),
        ([1, {"x": {2.0: 1}}], "value[1]['x'] key 2.0"),
        ([1, torch.ones(2)], "value[1] is of unsupported type Tensor"),
        ({"s": {1, 2}}, "value['s'] is of unsupported type set"),
        (b"raw", "unsupported type bytes"),
        (torch.ones(2, 2).to_sparse(), "only dense tensors"),
        (np.array(["a", None], dtype=object), "cannot encode ndarray of dtype object"),
    ],
)
def test_unsupported_values_raise_typeerror_naming_field_and_key(value, fragment):
    with pytest.raises(TypeError) as err:
        codec.encode_value(value, field="rm_extra", key="p7_3")
    msg = str(err.value)
    assert "field 'rm_extra' of key 'p7_3'" in msg and fragment in msg


def test_decoding_a_pickle_never_runs_it(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = pickle.dumps(Evil())
    for kind in codec.KINDS:
        with pytest.raises(Exception):  # noqa: B017 - any parse error is fine; running it is not
            codec.decode_value(kind, payload, field="f", key="k")
    assert not marker.exists()
    with pytest.raises(ValueError, match="stored kind 'pickle'"):
        codec.decode_value("pickle", payload, field="f", key="k")


def test_split_field_gives_one_value_per_key():
    keys = ["a", "b", "c"]
    rows = codec.split_field("x", torch.arange(6).reshape(3, 2), keys)
    assert [r.tolist() for r in rows] == [[0, 1], [2, 3], [4, 5]]
    assert codec.split_field("y", ("u", "v", "w"), keys) == ["u", "v", "w"]
    rows = codec.split_field("z", np.arange(3), keys)
    assert all(isinstance(r, np.ndarray) and r.shape == () for r in rows)  # not numpy scalars
    assert [_roundtrip(r)[1].item() for r in rows] == [0, 1, 2]


@pytest.mark.parametrize(
    "values, exc, fragment",
    [
        (torch.zeros(2, 4), ValueError, "first dimension len(keys)=3, got shape (2, 4)"),
        (torch.tensor(1.0), ValueError, "got shape ()"),
        ([1, 2], ValueError, "expected 3 values (one per key), got 2"),
        ("abc", TypeError, "got str"),
        (5, TypeError, "got int"),
    ],
)
def test_split_field_rejects_wrong_lengths_naming_the_field(values, exc, fragment):
    with pytest.raises(exc) as err:
        codec.split_field("responses", values, ["a", "b", "c"])
    assert "field 'responses'" in str(err.value) and fragment in str(err.value)
