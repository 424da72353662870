"""The device slot of a CUDA IPC handle in a colocated weight update, read by the stand-in as SGLang
0.5.8-0.5.23 reads it (`_device_from_maybe_uuid`): an int is the server's own device index, a UUID is
looked up among the devices the server sees, and a UUID it does not see takes the server down naming
it. No CUDA here: the payloads are synthetic pickles of torch's `rebuild_cuda_tensor` call, and the
device lookup and the rebuild itself are replaced where a test needs them."""

import base64
import inspect
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch.multiprocessing import reductions

from megatron_dapo.rollout.sglang import weights as sw
from megatron_dapo.rollout.sglang.engine import EngineRequestError, SGLangEngine
from tests.standin import StandinServer
from tests.standin import weights as standin

# str(torch.cuda.get_device_properties(i).uuid) of two devices (torch prints 8-4-4-4-12 hex)
UUIDS = ["6f1c3a52-9e0b-4d7e-b1a4-0c2d8e5f7a91", "d0b7e2c4-31f8-4a6d-9c05-7e8a1b3f2d60"]


class _CudaHandle:
    """Pickles as torch's reduction of a CUDA tensor does: `rebuild_cuda_tensor(*args)`, with `device` in
    the storage-device slot and placeholders elsewhere."""

    def __init__(self, device):
        self.device = device

    def __reduce__(self):
        args = [f"<{name}>" for name in inspect.signature(reductions.rebuild_cuda_tensor).parameters]
        args[standin.DEVICE_SLOT] = self.device
        return reductions.rebuild_cuda_tensor, tuple(args)


def _entry(device) -> str:
    return base64.b64encode(ForkingPickler.dumps([("w", _CudaHandle(device))])).decode()


@pytest.fixture
def two_gpus(monkeypatch):
    """The server sees two devices; the rebuild records the arguments it was given."""
    calls = []
    monkeypatch.setattr(standin, "local_cuda_uuids", lambda: list(UUIDS))
    monkeypatch.setattr(standin, "_torch_rebuild_cuda_tensor", lambda *args: calls.append(args) or torch.zeros(1))
    return calls


def test_the_device_slot_is_torchs_storage_device_argument():
    assert standin.DEVICE_SLOT == 6   # where SGLang's patch (_REDUCE_TENSOR_ARG_DEVICE_INDEX) reads it


@pytest.mark.parametrize("sent, index", [(1, 1), (0, 0), (UUIDS[1], 1), (UUIDS[0], 0)])
def test_an_index_is_the_servers_own_device_and_a_uuid_the_index_it_has_there(two_gpus, sent, index):
    ((name, tensor),) = standin.deserialize(_entry(sent))
    assert name == "w" and torch.equal(tensor, torch.zeros(1))
    (args,) = two_gpus
    assert args[standin.DEVICE_SLOT] == index
    # every other argument reaches torch's rebuild untouched
    params = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert [a for i, a in enumerate(args) if i != standin.DEVICE_SLOT] == \
        [f"<{p}>" for i, p in enumerate(params) if i != standin.DEVICE_SLOT]


def test_a_uuid_the_server_does_not_see_is_an_error_naming_it_and_the_devices_it_sees(two_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    unseen = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
    with pytest.raises(ValueError) as e:
        standin.deserialize(_entry(unseen))
    assert str(e.value) == (f"Invalid device_uuid={unseen}: a CUDA IPC handle of a device this server does not "
                            f"see (its devices: 0={UUIDS[0]}, 1={UUIDS[1]}; CUDA_VISIBLE_DEVICES=4,5)")
    assert two_gpus == []   # nothing was opened
    with pytest.raises(TypeError, match="neither a device index nor a device UUID"):
        standin.deserialize(_entry(1.0))


def test_a_handle_of_a_device_the_server_cannot_see_takes_the_server_down_naming_the_uuid(tmp_path):
    """As SGLang's scheduler does on "Invalid device_uuid": the update's connection drops and the log says
    why. (The CPU stand-in sees no CUDA device, so every UUID is one it cannot see.)"""
    body = sw.tensor_update_payload([_entry(UUIDS[0])], flush_cache=True, weight_version="1")
    with StandinServer(toy=True, log_dir=tmp_path) as s, SGLangEngine([s.url], max_retries=0) as eng:
        with eng.weight_update_session(), pytest.raises(EngineRequestError, match="ConnectionError"):
            eng._post_update("/update_weights_from_tensor", [body])
        assert s.wait_exit() == 1
        assert f"Invalid device_uuid={UUIDS[0]}: a CUDA IPC handle of a device this server does not see" \
            in s.log_tail()
