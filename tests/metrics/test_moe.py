"""MoELoadBalanceAccumulator: masked counting, accumulation, reset, counts path, errors.

The hand-made routing: B=2, T=2, L=2 layers, K=2, E=4; token (1, 1) is padding (mask 0) and
holds -1 ids, which must be ignored.

    token   layer 0   layer 1
    (0,0)   0 1       2 3
    (0,1)   0 2       3 0
    (1,0)   0 3       1 2
Layer 0 counts [3, 1, 1, 1]: max 3, mean 1.5, imbalance 2.
Layer 1 counts [1, 1, 2, 2]: max 2, mean 1.5, imbalance 4/3.
"""

import pytest
import torch

from megatron_dapo.metrics.moe import MoELoadBalanceAccumulator

ROUTED = torch.tensor(
    [
        [[[0, 1], [2, 3]], [[0, 2], [3, 0]]],
        [[[0, 3], [1, 2]], [[-1, -1], [-1, -1]]],
    ]
)  # [B=2, T=2, L=2, K=2]
MASK = torch.tensor([[1, 1], [1, 0]])
COUNTS = torch.tensor([[3, 1, 1, 1], [1, 1, 2, 2]])

EXPECTED = {
    "moe/layer_0/max_load": 3.0,
    "moe/layer_0/mean_load": 1.5,
    "moe/layer_0/imbalance": 2.0,
    "moe/layer_1/max_load": 2.0,
    "moe/layer_1/mean_load": 1.5,
    "moe/layer_1/imbalance": 4.0 / 3.0,
    "moe/load_imbalance/mean": (2.0 + 4.0 / 3.0) / 2.0,
    "moe/load_imbalance/max": 2.0,
    "moe/load_imbalance/min": 4.0 / 3.0,
    "moe/num_layers": 2.0,
    "moe/num_experts": 4.0,
    "moe/num_assignments": 12.0,
    "moe/num_tokens": 3.0,
}


def test_masked_tokens_are_not_counted_and_metrics_match_hand_values():
    acc = MoELoadBalanceAccumulator(num_experts=4)
    acc.update(ROUTED, MASK)
    assert torch.equal(acc.counts, COUNTS)
    assert acc.compute() == pytest.approx(EXPECTED)


def test_inferred_num_experts_is_max_id_plus_one():
    acc = MoELoadBalanceAccumulator()
    acc.update(ROUTED, MASK)
    assert acc.compute() == pytest.approx(EXPECTED)


def test_two_updates_equal_one_update_over_the_concatenation():
    one = MoELoadBalanceAccumulator(num_experts=4)
    one.update(ROUTED, MASK)
    two = MoELoadBalanceAccumulator(num_experts=4)
    two.update(ROUTED[:1], MASK[:1])
    two.update(ROUTED[1:], MASK[1:])
    assert torch.equal(two.counts, one.counts)
    assert two.compute() == one.compute()


def test_add_to_metrics_writes_and_resets():
    acc = MoELoadBalanceAccumulator(num_experts=4)
    acc.update(ROUTED, MASK)
    metrics = {"actor/pg_loss": 0.1}
    assert acc.add_to_metrics(metrics) is metrics
    assert metrics == pytest.approx({"actor/pg_loss": 0.1, **EXPECTED})
    assert acc.compute() == {}
    assert acc.counts is None
    # after a reset the next step starts from zero
    acc.update(ROUTED[:1, :1], MASK[:1, :1])
    assert acc.compute()["moe/num_assignments"] == 4.0


def test_nothing_accumulated_adds_nothing():
    metrics = {}
    MoELoadBalanceAccumulator(num_experts=4).add_to_metrics(metrics)
    assert metrics == {}


def test_from_counts_gives_the_same_load_metrics_without_a_token_count():
    acc = MoELoadBalanceAccumulator.from_counts(COUNTS)
    assert acc.compute() == pytest.approx({**EXPECTED, "moe/num_tokens": 0.0})


def test_counts_and_routing_updates_add_up():
    acc = MoELoadBalanceAccumulator(num_experts=4)
    acc.update(ROUTED, MASK)
    acc.update_counts(COUNTS)
    assert torch.equal(acc.counts, 2 * COUNTS)


def test_inferred_width_grows_when_a_larger_expert_id_appears():
    acc = MoELoadBalanceAccumulator()
    acc.update(ROUTED, MASK)
    acc.update(torch.tensor([[[[5, 0], [1, 1]]]]), torch.ones(1, 1))
    assert acc.counts.tolist() == [[4, 1, 1, 1, 0, 1], [1, 3, 2, 2, 0, 0]]
    assert acc.compute()["moe/num_experts"] == 6.0


def test_a_layer_without_traffic_is_reported_zero_and_left_out_of_aggregates():
    acc = MoELoadBalanceAccumulator.from_counts(torch.tensor([[0, 0], [1, 3]]))
    m = acc.compute()
    assert m["moe/layer_0/imbalance"] == 0.0
    assert m["moe/layer_1/imbalance"] == 1.5
    assert m["moe/load_imbalance/mean"] == 1.5
    assert m["moe/load_imbalance/min"] == 1.5


def test_out_of_range_id_at_a_counted_position_fails_at_compute():
    routed = ROUTED.clone()
    routed[0, 0, 1, 0] = 4  # num_experts = 4: ids 0..3
    acc = MoELoadBalanceAccumulator(num_experts=4)
    acc.update(routed, MASK)  # no device sync here
    with pytest.raises(ValueError, match=r"1 expert ids outside \[0, num_experts=4\)"):
        acc.compute()


def test_negative_id_at_a_counted_position_fails_at_update_when_inferring():
    routed = ROUTED.clone()
    routed[0, 1, 0, 1] = -3
    with pytest.raises(ValueError, match="expert id -3 < 0"):
        MoELoadBalanceAccumulator().update(routed, MASK)


def test_out_of_range_ids_under_the_mask_are_ignored():
    routed = ROUTED.clone()
    routed[1, 1] = 17  # padding token
    acc = MoELoadBalanceAccumulator(num_experts=4)
    acc.update(routed, MASK)
    assert acc.compute() == pytest.approx(EXPECTED)


@pytest.mark.parametrize(
    "routed, mask, match",
    [
        (ROUTED[0], MASK, r"routed_experts: expected an int tensor of shape \[B, T, L, K\]"),
        (ROUTED.float(), MASK, "routed_experts: expected integer expert ids"),
        (ROUTED, MASK[:, :1], r"response_mask: expected shape \[B=2, T=2\]"),
    ],
)
def test_bad_update_inputs_name_the_argument(routed, mask, match):
    with pytest.raises(ValueError, match=match):
        MoELoadBalanceAccumulator(num_experts=4).update(routed, mask)


def test_layer_count_must_not_change_between_updates():
    acc = MoELoadBalanceAccumulator(num_experts=4)
    acc.update(ROUTED, MASK)
    with pytest.raises(ValueError, match="3 MoE layers, but earlier updates had 2"):
        acc.update_counts(torch.zeros(3, 4, dtype=torch.long))


@pytest.mark.parametrize(
    "counts, match",
    [
        (torch.tensor([1, 2]), r"counts: expected a tensor of shape \[L, E\]"),
        (torch.tensor([[1, -2]]), "counts must be >= 0"),
        (torch.tensor([[1.5, 2.0]]), "whole numbers"),
    ],
)
def test_bad_counts_are_rejected(counts, match):
    with pytest.raises(ValueError, match=match):
        MoELoadBalanceAccumulator().update_counts(counts)


def test_counts_width_must_match_a_given_num_experts():
    with pytest.raises(ValueError, match="expected E=4 columns, got 3"):
        MoELoadBalanceAccumulator(num_experts=4).update_counts(torch.zeros(2, 3))


@pytest.mark.parametrize("num_experts", [0, -1, 2.0, True])
def test_num_experts_must_be_a_positive_int(num_experts):
    with pytest.raises(ValueError, match="num_experts"):
        MoELoadBalanceAccumulator(num_experts=num_experts)


def test_an_empty_micro_batch_changes_nothing():
    acc = MoELoadBalanceAccumulator()
    acc.update(torch.zeros(0, 3, 2, 2, dtype=torch.long), torch.zeros(0, 3))
    assert acc.compute() == {}
    acc.update(ROUTED, MASK)
    acc.update(torch.zeros(1, 0, 2, 2, dtype=torch.long), torch.zeros(1, 0))
    assert acc.compute() == pytest.approx(EXPECTED)
