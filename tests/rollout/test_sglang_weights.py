"""Weight-sync bucketing and payloads, and the colocated /update_weights_from_tensor path end to end
against the SGLang stand-in (its own process, 0.5.23's protocol, TP receiver ranks)."""

import base64
import os
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as tmp

from megatron_dapo.rollout.base import RolloutEngineError
from megatron_dapo.rollout.sglang import weights as sw
from megatron_dapo.rollout.sglang.engine import EngineRequestError, SGLangEngine
from tests.standin import StandinServer, expected_checksums

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_a_flattened_bucket_is_its_tensors_bytes_end_to_end_and_reads_back_as_sglang_cuts_it():
    """weights.flattened_bytes / flattened_entry against the stand-in's reading of SGLang's flattened_bucket
    (tests/standin/weights.py: byte slices viewed as each dtype and shape, metadata as SimpleNamespace)."""
    from tests.standin.weights import deserialize

    named = _named()[:2] + [("h", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t())]  # non-contiguous
    flat = sw.flattened_bytes([t for _, t in named])
    assert flat.dtype == torch.uint8 and flat.numel() == 400 + 400 + 12
    assert torch.equal(flat[400:800].view(torch.float32), named[1][1])
    entry = sw.flattened_entry([(n, tuple(t.shape), t.dtype) for n, t in named], flat)
    assert [(m.name, m.start_idx, m.end_idx) for m in entry["metadata"]] == [("a", 0, 400), ("b", 400, 800),
                                                                             ("h", 800, 812)]
    back = deserialize(sw.serialize_flattened(entry), load_format=sw.FLATTENED_BUCKET)
    assert [n for n, _ in back] == ["a", "b", "h"]
    for (_, want), (_, got) in zip(named, back, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    # A float32 after an odd number of bf16 values would sit at an offset 4 does not divide: SGLang refuses
    # to view it, so that bucket goes tensor by tensor.
    assert sw.flattened_bytes([torch.ones(3, dtype=torch.bfloat16), torch.ones(2)]) is None
    assert sw.flattened_bytes([torch.ones(2), torch.ones(3, dtype=torch.bfloat16)]) is not None
    with pytest.raises(ValueError, match="holds 8 bytes, its tensors 4"):
        sw.flattened_entry([("x", (1,), torch.float32)], torch.zeros(8, dtype=torch.uint8))


def test_the_standin_fails_a_flattened_update_where_sglang_does():
    from tests.standin.weights import deserialize

    named = _named()[:1]  # alive while the server side opens it (a shared-memory file)
    plain = sw.serialize_named_tensors(named)
    with pytest.raises(TypeError):  # a list where SGLang indexes ["flattened_tensor"]
        deserialize(plain, load_format=sw.FLATTENED_BUCKET)
    with pytest.raises(NotImplementedError, match="Unknown load_format=bogus"):
        deserialize(plain, load_format="bogus")


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


@pytest.fixture
def file_system_sharing():
    """CPU tensors shared through named shared-memory files, which any process on the node can open
    (CUDA IPC plays this part on a GPU node); the default (file descriptors) opens only in the sender's
    multiprocessing children."""
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    yield
    tmp.set_sharing_strategy(before)


def test_a_cpu_tensor_pickled_by_file_descriptor_kills_a_server_process(tmp_path):
    """Why the client never sends one: a ForkingPickler CPU tensor under the default strategy points at
    the sender's resource_sharer, which only its multiprocessing children may contact. SGLang's scheduler
    dies on it (measured on a real 0.5.23 server), and so does the stand-in."""
    import io

    assert tmp.get_sharing_strategy() == "file_descriptor"
    buf = io.BytesIO()
    ForkingPickler(buf).dump(_named()[:1])
    body = sw.tensor_update_payload([base64.b64encode(buf.getvalue()).decode()], flush_cache=True, weight_version="1")
    with StandinServer(toy=True, log_dir=tmp_path) as s, SGLangEngine([s.url], max_retries=0) as eng:
        with eng.weight_update_session(), pytest.raises(EngineRequestError, match="ConnectionError"):
            eng._post_update("/update_weights_from_tensor", [body])
        assert s.wait_exit() == 1
        assert "AuthenticationError: digest sent was rejected" in s.log_tail()


def test_colocated_cpu_tensors_travel_by_file_name_whatever_the_process_sharing_strategy(tmp_path):
    """The trainer runs with torch's default strategy (file descriptors); the engine's payloads still
    carry shared-memory file names, which the server process opens, and the strategy is left as it was."""
    assert tmp.get_sharing_strategy() == "file_descriptor"
    with StandinServer(toy=True, log_dir=tmp_path) as s, SGLangEngine([s.url], max_retries=0) as eng:
        eng.update_weights(_named(), policy_version=1, bucket_mb=1)
        assert s.checksums() == [expected_checksums(_named())] and s.stats()["weight_version"] == "1"
    assert tmp.get_sharing_strategy() == "file_descriptor"


@pytest.mark.parametrize("tp_size", [1, 2])
def test_colocated_update_sends_size_bounded_buckets_in_one_session_and_the_version_last(
        tmp_path, file_system_sharing, tp_size):
    with StandinServer(toy=True, tp_size=tp_size, log_dir=tmp_path) as a, \
            StandinServer(toy=True, tp_size=tp_size, log_dir=tmp_path) as b:
        with SGLangEngine([a.url, b.url], tp_size=tp_size) as eng:
            eng.update_weights(_named(), policy_version=7, bucket_mb=1000 / sw.MIB)
            assert eng.policy_version == 7
        for s in (a, b):
            weight_paths = [p for p in s.paths() if "weight" in p]
            assert weight_paths == ["/begin_weight_update"] + ["/update_weights_from_tensor"] * 3 + ["/end_weight_update"]
            bodies = s.requests("/update_weights_from_tensor")
            assert [len(x["serialized_named_tensors"]) for x in bodies] == [tp_size] * 3
            assert [x["flush_cache"] for x in bodies] == [False, False, True]
            assert [x["weight_version"] for x in bodies] == [None, None, "7"]
            assert {x["selector"] for x in bodies} == {"all"}
            assert s.stats()["weight_version"] == "7"
            # every TP rank opened its own entry and holds every tensor, byte for byte
            assert s.checksums() == [expected_checksums(_named())] * tp_size
            assert s.ignored_fields() == {}


def test_update_weights_dispatch_disk_version_only_and_order_checks(tmp_path):
    with StandinServer(toy=True, log_dir=tmp_path) as s, SGLangEngine([s.url], policy_version=2) as eng:
        eng.update_weights(model_path="/ckpt/step3", policy_version=3)
        assert s.requests("/update_weights_from_disk") == [{"model_path": "/ckpt/step3", "weight_version": "3"}]
        assert "/begin_weight_update" not in s.paths()  # disk updates need no session in 0.5.23
        eng.update_weights(policy_version=4)  # weights pushed by the caller: only the version moves
        assert eng.policy_version == 4 and s.paths().count("/update_weights_from_tensor") == 0
        with pytest.raises(ValueError, match=r"policy_version must be an int >= 4 \(current\), got 3"):
            eng.update_weights(policy_version=3)
        with pytest.raises(RolloutEngineError, match="needs init_weights_update_group first"):
            eng.update_weights_from_distributed(_named(), bucket_mb=1, policy_version=5)
        with pytest.raises(ValueError, match="bucket_mb must be > 0"):
            eng.update_weights(_named(), policy_version=5, bucket_mb=0)


def test_a_server_rejecting_an_update_raises_naming_it(tmp_path, file_system_sharing):
    # 0.5.23 refuses a tensor update outside a weight-update session; this engine opens none
    with StandinServer(toy=True, log_dir=tmp_path) as s, SGLangEngine([s.url], open_weight_sessions=False) as eng:
        with pytest.raises(EngineRequestError, match=r"/update_weights_from_tensor: HTTP 400: .*"
                                                     r"must run between begin_weight_update\(\) and end_weight_update"):
            eng.update_weights(_named()[:1], policy_version=1, bucket_mb=1)
        assert eng.policy_version == 0  # a failed update leaves the version alone
        with eng.weight_update_session():  # the caller's session: now it lands
            eng.update_weights(_named()[:1], policy_version=1, bucket_mb=1)
        assert eng.policy_version == 1 and s.checksums() == [expected_checksums(_named()[:1])]


def test_servers_that_answer_but_never_join_fail_the_group_fast_and_the_sender_exits(tmp_path):
    """A server answering /init_weights_update_group with 200 without joining (another address, port or
    group) fails the set-up after JOIN_AFTER_REPLY_S with the group and address named, not after the
    600 s timeout, and the sender's process exits right after. Both sides are processes of their own (the
    server a plain HTTP responder)."""
    import subprocess
    import sys
    import time

    from tests.standin import free_port

    port = free_port()
    script = ("import http.server as h\n"
              "class H(h.BaseHTTPRequestHandler):\n"
              "    def do_POST(self):\n"
              "        self.rfile.read(int(self.headers['Content-Length'] or 0))\n"
              "        self.send_response(200); self.send_header('Content-Length', '2'); self.end_headers()\n"
              "        self.wfile.write(b'{}')\n"
              "    def log_message(self, *a): pass\n"
              f"h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        import socket

        deadline = time.monotonic() + 120
        while True:  # until the responder listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the responder did not start"
                time.sleep(0.1)
        # The sender in a process of its own: the error comes fast, and the process then exits at once
        # (the join thread, still blocked on the store, must not hold the interpreter's exit).
        sender = ("import sys\n"
                  "from megatron_dapo.rollout.sglang import sync as s\n"
                  "s.JOIN_AFTER_REPLY_S = 1.0\n"
                  f"servers = s.ServerSet(urls=('http://127.0.0.1:{port}',), tp_sizes=(1,))\n"
                  "try:\n"
                  "    s._open_group(servers, host='127.0.0.1', group_name='g_never', backend='gloo', timeout_s=600)\n"
                  "except s.WeightSyncError as e:\n"
                  "    print('WeightSyncError:', e, flush=True)\n"
                  "    sys.exit(3)\n")
        start = time.monotonic()
        r = subprocess.run([sys.executable, "-c", sender], capture_output=True, text=True, timeout=400,
                           cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert r.returncode == 3, r.stdout + r.stderr[-3000:]
        assert "replied to /init_weights_update_group but they did not join" in r.stdout and "g_never" in r.stdout
        assert time.monotonic() - start < 300  # far below the 600 s timeout (no tighter bound: slow CI machines)
    finally:
        proc.kill()


def test_a_sync_into_paused_generation_keeps_the_cache_but_still_sets_the_version(tmp_path):
    """SGLangWeightSync.sync(v, flush_cache=False), the push into generation paused in place (SGLang fails
    a flush while requests run): its last body asks for no flush and carries str(v); the default flushes.
    A tiny model over a weight-update group (gloo) to the stand-in, inside a 0.5.23 weight-update session."""
    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_model
    from megatron_dapo.models.config_arch import model_arch
    from megatron_dapo.parallel import init_parallel
    from megatron_dapo.rollout.sglang.build import session_hook as _session_hook
    from megatron_dapo.rollout.sglang.sync import ServerSet, SGLangWeightSync

    pgs = init_parallel()
    arch = model_arch(load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml")), vocab_size=16)
    model = build_gpt_model(arch, pgs=pgs, seed=0)
    with StandinServer(toy=True, log_dir=tmp_path) as s, SGLangEngine([s.url]) as eng:
        sync = SGLangWeightSync(ServerSet(urls=(s.url,), tp_sizes=(1,), nodes=(0,)), pgs=pgs, chunks=[model],
                                arch=arch, transport="distributed", bucket_bytes=1 << 30, host="127.0.0.1",
                                session=_session_hook(eng))
        sync.setup()
        try:
            sync.sync(1)
            assert s.stats()["weight_version"] == "1"
            sync.sync(2, flush_cache=False)
            assert s.stats()["weight_version"] == "2"
        finally:
            sync.close()
        bodies = s.requests("/update_weights_from_distributed")
        # per sync: one bucket of every tensor (the bucket holds the whole model), then the empty final body
        assert [bool(b["names"]) for b in bodies] == [True, False, True, False]
        assert [(b["flush_cache"], b["weight_version"]) for b in bodies] == [
            (False, None), (True, "1"), (False, None), (False, "2")]
        assert s.ignored_fields() == {}
