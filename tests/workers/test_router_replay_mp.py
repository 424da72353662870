"""Router replay at the MoE recipe's layout scaled down: TP 2 x EP 2 (sequence parallel), PP 2 x EP 2 with full
recompute, and PP 2 x EP 2 with 2 virtual stages per rank, on 4 gloo processes, against one process on the same weights (tests/workers/_mp_replay.py runs the layouts).

On every rank and every MoE layer it holds: the update routed every real position of every row it trains
exactly to the recorded experts (forward hooks on the routers, sequence shards included); the records
equal the one-process records of the same rows and layers; engaged_layers is the model's 4 and the drift
(mismatch_frac) is the one-process figure; replaying a chosen routing gives the one-process log-probs.
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.standin import free_port
from tests.workers._actor_cases import random_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]

REPLAY_OVERRIDES = {"model.arch": "tiny_moe", "actor.router_replay": "r2", "actor.ppo_mini_batch_size": 4,
                    "actor.max_tokens_per_microbatch": 24, "data.max_prompt_length": 4,
                    "data.max_response_length": 8, "reward.overlong_buffer.len": 4}
"""One mini-batch (Megatron's aux loss is per micro-batch: after a step the layouts would differ by design);
24 tokens per micro-batch: several micro-batches per rank, so the records cross micro-batch boundaries."""


def replay_batch() -> dict:
    raw = random_batch(seed=23, B=16, P=4, T=8)
    raw["prompt_length"] = torch.full((16,), 3)
    raw["response_length"] = torch.tensor([8, 8, 2, 3, 7, 1, 1, 2, 1, 2, 2, 1, 8, 7, 8, 7])
    raw["response_mask"] = (torch.arange(8)[None] < raw["response_length"][:, None]).float()
    return raw


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from megatron_dapo.config import load_config
    from megatron_dapo.models.forward import unwrap_model
    from megatron_dapo.models.weights import gather_canonical_state
    from megatron_dapo.parallel import init_parallel
    from megatron_dapo.workers.build import build_actor
    from tests.workers._actor_cases import PAD, VOCAB, overrides
    from tests.workers._mp_replay import replay_case

    out = tmp_path_factory.mktemp("replay")
    pgs = init_parallel()
    actor = build_actor(load_config("configs/tiny_cpu.yaml", overrides(**REPLAY_OVERRIDES)), pgs, vocab_size=VOCAB,
                        pad_id=PAD)
    init = {name: t.clone() for name, t, _ in gather_canonical_state(unwrap_model(actor.policy.chunks[0]), pgs=pgs)}
    torch.save(init, out / "init.pt")
    return out, replay_case(actor, replay_batch())


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["tp2_ep2", "pp2_ep2", "pp2_vpp2_ep2"])
def test_replay_at_the_moe_layout_routes_every_rank_and_layer_as_recorded(one_process, layout):
    out, ref = one_process
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr",
                        "127.0.0.1", "--master_port", str(port), str(ROOT / "tests/workers/_mp_replay.py"), layout,
                        str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = torch.load(out / f"{layout}.pt", weights_only=False)
    raw = replay_batch()
    mask = raw["response_mask"]
    real = int((raw["prompt_length"] + raw["response_length"]).sum())
    assert ref["compared"] == real * 4 and ref["mismatched"] == 0

    if layout == "tp2_ep2":
        assert all(rk["sequence_parallel"] for rk in ranks)
    seen: dict[tuple[int, int], int] = {}
    for rk in ranks:
        stage = {"tp2_ep2": [[0, 1, 2, 3]] * 2, "pp2_ep2": [[0, 1], [2, 3]], "pp2_vpp2_ep2": [[0, 2], [1, 3]]}
        assert rk["moe_index"] == stage[layout][rk["pp_rank"]]
        # the update routed as recorded, everywhere this rank looked
        assert rk["compared"] > 0 and rk["mismatched"] == 0, rk["rank"]
        # memory: 1 byte per (real position, own layer, k), own rows only (the planner's formula, at real lengths)
        positions = sum(int(raw["prompt_length"][row] + raw["response_length"][row]) for row in rk["record"])
        assert sum(t.numel() * t.element_size() for t in rk["record"].values()) == positions * len(rk["moe_index"]) * 2
        for row, rec in rk["record"].items():
            assert rec.dtype == torch.uint8
            for j, layer in enumerate(rk["moe_index"]):
                assert torch.equal(rec[j], ref["record"][row][layer]), (rk["rank"], row, layer)
                seen[row, layer] = seen.get((row, layer), 0) + 1
        m = rk["metrics"]
        assert m["router_replay/engaged_layers"] == 4
        assert m["router_replay/mismatch_frac"] == pytest.approx(ref["metrics"]["router_replay/mismatch_frac"],
                                                                  abs=0.01)
        assert rk["replay_metrics"]["router_replay/engaged_layers"] == 4
        torch.testing.assert_close(rk["old_log_probs"] * mask, ref["old_log_probs"] * mask, atol=1e-5, rtol=0)
        torch.testing.assert_close(rk["replayed"] * mask, ref["replayed"] * mask, atol=1e-5, rtol=0)
        assert m["actor/pg_loss"] == pytest.approx(ref["metrics"]["actor/pg_loss"], rel=1e-5, abs=1e-7)
    # every (row, layer) is recorded somewhere, by the TP ranks of one DP rank (they train the same rows)
    assert set(seen) == {(row, layer) for row in range(16) for layer in range(4)}
    assert set(seen.values()) == {2 if layout == "tp2_ep2" else 1}
    # the hooks looked at every real position of every layer: TP shards split the positions, PP stages layers;
    # with full recompute (pp2_ep2) twice, the recomputed forwards included
    assert sum(rk["compared"] for rk in ranks) == real * 4 * (2 if layout == "pp2_ep2" else 1)
    assert all((rk["recomputed"] > 0) == (layout == "pp2_ep2") for rk in ranks)
    assert 0.2 < ref["metrics"]["router_replay/mismatch_frac"] < 1
