"""Rank-0-driven rollout on 2 gloo processes: rank 1 waits on the control group, not on a timed
collective; the batch arrives as tensors equal to rank 0's; an engine error on rank 0 becomes the same
DriverError on both ranks; rewards are scored once (sharded and gathered) and agree on both ranks even
when only rank 1's reward calls time out."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from megatron_dapo.rollout.base import PromptInput, Sample, samples_to_batch
from megatron_dapo.rollout.ragged import AbsentRowError, to_dense, to_ragged
from megatron_dapo.rollout.rank0 import decode_batch, encode_batch, rows_of, shard_tokens
from tests.standin import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_wire_round_trip_gives_each_rank_its_own_rows_ragged():
    prompts = [PromptInput(prompt_id="a", token_ids=(5, 6)), PromptInput(prompt_id="b", token_ids=(7,))]
    samples = [Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids,
                      response_token_ids=tuple(range(2 + j)), rollout_log_probs=tuple([-0.5 - j] * (2 + j)),
                      finish_reason=("stop", "abort")[j], policy_version=3, meta={"k": j} if j else {})
               for p in prompts for j in range(2)]
    batch = samples_to_batch(samples, pad_id=0, max_response_length=5)
    ragged = to_ragged(batch, pad_id=0)
    for rank in (0, 1):
        wire = {**encode_batch(ragged), **shard_tokens(ragged, rank, 2)}
        mine = rows_of(rank, 2, len(batch))
        assert wire["tokens"].numel() == int(batch.response_length[mine].sum())  # its rows, no padding
        back = decode_batch(wire, prompts, 2, pad_id=0, max_response_length=5, rank=rank, world=2)
        assert back.responses.present.tolist() == [r % 2 == rank for r in range(4)]
        for r in mine.tolist():
            n = int(batch.response_length[r])
            assert torch.equal(back.responses.row(r), batch.responses[r, :n])
            assert torch.equal(back.rollout_log_probs.row(r), batch.rollout_log_probs[r, :n])
        with pytest.raises(AbsentRowError, match="not held"):
            back.responses.row(1 - rank)
        assert back.response_mask is None and torch.equal(back.prompt_ids.dense(), batch.prompt_ids)
    # one process: every row, and the dense form is the engine's batch
    wire = {**encode_batch(ragged), **shard_tokens(ragged, 0, 1)}
    back = to_dense(decode_batch(wire, prompts, 2, pad_id=0, max_response_length=5))
    for name, value in vars(batch).items():
        got = getattr(back, name)
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, name


@pytest.mark.multiproc
def test_rank0_drives_the_engine_and_every_rank_gets_the_same_batch_errors_and_rewards(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / "tests/rollout/_mp_rank0.py"), str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    b0, b1 = (torch.load(tmp_path / f"batch{k}.pt", weights_only=True) for k in (0, 1))
    # rank 1 held its own rows' tokens only until the kept rows were shared
    assert b0.pop("held_rows") == list(range(12)) and b1.pop("held_rows") == list(range(1, 12, 2))
    assert b0.pop("ragged_ids") == b1.pop("ragged_ids") == [True, True, False]
    held0, held1 = b0.pop("held_values"), b1.pop("held_values")
    assert held1 == 2 * int(b0["response_length"][1::2].sum()) < held0 == 2 * int(b0["response_length"].sum())
    for name, value in b0.items():  # rank 0 waited 6 s in its engine; the default group times out after 3 s
        assert torch.equal(b1[name], value) if isinstance(value, torch.Tensor) else b1[name] == value, name
    assert b0["finish_reason"].count("abort") == 3 and b0["meta"][1] == {"spec_verify_ct": 1}
    e0, e1 = ((tmp_path / f"error{k}.txt").read_text() for k in (0, 1))
    assert e0 == e1 and "ConnectionError" in e0 and "10.0.0.7:30000" in e0
    s0, s1 = (torch.load(tmp_path / f"scored{k}.pt", weights_only=True) for k in (0, 1))
    assert torch.equal(s0["scores"], s1["scores"]) and torch.equal(s0["rewards"], s1["rewards"])
    assert s0["extra"] == s1["extra"]
    # rows on rank 1 (odd) timed out there and got error_score; rank 0's rows were scored normally
    assert s0["scores"][1::2].tolist() == [-1.0] * 6 and all(e for e in s0["extra"]["error"][1::2])
    assert not any(s0["extra"]["error"][0::2])
    # texts are gathered to rank 0 only (the tokenizer maps id i to chr(97 + i % 26))
    want = ["".join(chr(97 + t % 26) for t in b0["responses"][r, : int(b0["response_length"][r])].tolist())
            for r in range(len(b0["index"]))]
    assert s0["texts"] == want and any(want) and not any(s1["texts"])
    # streaming: groups p1 and p2 were scored in rank 0's callback (p0 has an aborted row: scored after),
    # all on rank 0, so no row timed out; rank 1 held no token until the rows were shared
    t0, t1 = (torch.load(tmp_path / f"streamed{k}.pt", weights_only=True) for k in (0, 1))
    assert t0["in_callback"] == ["p1@s", "p2@s"] and t0["held_rows"] == list(range(12)) and t1["held_rows"] == []
    assert torch.equal(t0["scores"], t1["scores"]) and t0["extra"] == t1["extra"]
    assert not any(t0["extra"]["error"]) and -1.0 not in t0["scores"].tolist()
    assert t0["scores"].tolist() == [float(len(t) % 3 == 0) for t in t0["texts"]] and not any(t1["texts"])
    assert torch.equal(t0["responses"], t1["responses"])


def test_a_row_generated_with_other_weights_is_a_named_error():
    """stages.generate checks every row's policy version (the server-reported weight_version) against the
    last sync: a server that missed a sync is named by its row and group, not trained on."""
    from megatron_dapo.data.dataset import PromptRecord
    from megatron_dapo.rollout.base import RolloutEngine, SamplingParams
    from megatron_dapo.trainer.stages import PolicyVersionError, generate

    class Stale(RolloutEngine):
        def generate(self, prompts, sampling):
            return [Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids,
                           response_token_ids=(3,), rollout_log_probs=(-0.1,), finish_reason="stop",
                           policy_version=4 if (i, j) != (1, 0) else 3)
                    for i, p in enumerate(prompts) for j in range(sampling.n)]

        def update_weights(self, named_tensors=None, *, policy_version, **kw): ...
        def abort(self): ...
        def release_memory(self): ...
        def resume_memory(self): ...
        def health(self): return {"healthy": True, "policy_version": 4}

        @property
        def policy_version(self):
            return 4

    records = [PromptRecord(uid=f"u{i}", prompt_ids=[5, 6], raw_prompt="q", ground_truth="g", data_source="t")
               for i in range(2)]
    sampling = SamplingParams(max_new_tokens=4, n=2)
    ok = generate(Stale(), records[:1], sampling, group_suffix="1.0", pad_id=0, max_response_length=4,
                  expect_policy_version=4)
    assert ok.policy_version.tolist() == [4, 4]
    with pytest.raises(PolicyVersionError, match=r"row 2 \(group 'u1@1.0'\).*version 3, expected 4"):
        generate(Stale(), records, sampling, group_suffix="1.0", pad_id=0, max_response_length=4,
                 expect_policy_version=4)
