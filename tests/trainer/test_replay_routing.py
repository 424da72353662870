"""trainer/replay.py: rank 0 sends each training row's routing (MoE layers only) to the ranks of the data-parallel
rank that trains it, over gloo on 3 processes (DP 2: ranks 0 and 2 hold DP rank 0, rank 1 DP rank 1).

Rank 0 sends DP rank 1's rows to its leader (rank 1) and forwards its own replica's rows to rank 2, which
routes only the second MoE layer (as a pipeline stage would) and gets only that one. Rows without routing
(an aborted request) arrive as None; a dense layer of SGLang's per-layer routing is left out; a row whose
routing has the wrong number of tokens is refused naming the row.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_dapo.rollout.base import RolloutBatch

WORLD, B, L_HF, K = 3, 6, 3, 2
MOE_FREQ = [1, 0, 1]  # SGLang sends a row per decoder layer: layer 1 is dense (zeros)
DP_OF = [0, 1, 0]
LAYERS_OF = [[0, 1], [0, 1], [1]]  # the MoE layers each rank routes (rank 2: a later pipeline stage's)


def _batch(with_routing: bool, *, bad_row: int | None = None) -> RolloutBatch:
    prompt_length = torch.tensor([3, 2, 4, 3, 2, 5])
    response_length = torch.tensor([4, 1, 2, 6, 3, 2])
    g = torch.Generator().manual_seed(0)
    routed = None
    if with_routing:
        routed = [torch.randint(0, 8, (L_HF, int(p + r - 1) + (row == bad_row), K), generator=g, dtype=torch.uint8)
                  for row, (p, r) in enumerate(zip(prompt_length.tolist(), response_length.tolist()))]
        routed[4] = None  # aborted
    z = torch.zeros(B, dtype=torch.long)
    return RolloutBatch(prompt_ids=torch.zeros(B, 5, dtype=torch.long), prompt_length=prompt_length,
                        responses=torch.zeros(B, 6, dtype=torch.long), response_mask=torch.zeros(B, 6),
                        rollout_log_probs=torch.zeros(B, 6), response_length=response_length, sample_index=z,
                        policy_version=z, aborted=torch.zeros(B, dtype=torch.bool), finish_reason=["stop"] * B,
                        index=[str(i) for i in range(B)], meta=[{}] * B, routed_experts=routed)


class _Policy:
    """What provide_rollout_routing asks of a PolicyModel: the DP dealing and the model's router layout."""

    def __init__(self, dp_rank: int, layers: list[int]):
        self.dp_rank, self.layers = dp_rank, layers
        config = types.SimpleNamespace(num_layers=L_HF, moe_layer_freq=MOE_FREQ, num_moe_experts=8, moe_router_topk=K)
        self.chunks = [types.SimpleNamespace(config=config)]
        self.given = None

    def row_groups(self, num_rows):
        return [list(range(num_rows))]

    def shard_rows(self, prompt_length, response_length, groups):
        every = [[0, 2, 5], [1, 3, 4]]
        return every, [every[self.dp_rank]]

    def routing_layers(self):
        return self.layers

    def provide_routing(self, responses, rows, *, layers=None):
        self.given = (responses, rows, layers)


def _worker(rank: int, init_file: str, out: str, bad_row, world: int) -> None:
    from megatron_dapo.trainer.replay import provide_rollout_routing

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    batch = _batch(rank == 0, bad_row=bad_row)
    pgs = types.SimpleNamespace(ctrl=dist.group.WORLD, dp_rank=DP_OF[rank])
    policies = [_Policy(DP_OF[rank], LAYERS_OF[rank]), _Policy(DP_OF[rank], LAYERS_OF[rank])]
    try:
        metrics = provide_rollout_routing(batch, policies, pgs=pgs)
        result = {"metrics": metrics, "rows": policies[1].given[1], "layers": policies[1].given[2],
                  "same_key": policies[0].given[0] is batch.responses}
    except ValueError as e:
        result = {"error": str(e)}
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_each_rank_gets_the_moe_layers_of_the_rows_its_dp_rank_trains(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rdv"), str(tmp_path / "out"), None, WORLD), nprocs=WORLD, join=True)
    full = _batch(True).routed_experts
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"out.{rank}", weights_only=False)
        assert got["same_key"] and got["metrics"] == {"router_replay/rows_with_routing": 5 / 6}
        rows = [[0, 2, 5], [1, 3, 4]][DP_OF[rank]]
        assert sorted(got["rows"]) == rows
        # ranks 0 and 1 lead their replicas: every MoE layer (decoder layers 0 and 2); rank 2 MoE layer 1 alone
        assert got["layers"] == (None if rank < 2 else [1])
        for row in rows:
            if full[row] is None:
                assert got["rows"][row] is None
            else:  # every routed position
                assert torch.equal(got["rows"][row], full[row][[0, 2] if rank < 2 else [2]]), (rank, row)


@pytest.mark.multiproc
def test_routing_of_the_wrong_length_is_refused_naming_the_row(tmp_path):
    """Rank 0 checks before sending (its own process, a world of one: the check comes first)."""
    mp.spawn(_worker, args=(str(tmp_path / "rdv"), str(tmp_path / "out"), 3, 1), nprocs=1, join=True)
    assert torch.load(tmp_path / "out.0", weights_only=False) == {
        "error": "actor.router_replay=r3: row 3: routing of shape (3, 9, 2), expected [3+ layers, 8 tokens, top-k 2]"}
