"""Advantage estimators: hand-computed cases and loop == vectorised GRPO on random groups."""

import math
import statistics
import types

import numpy as np
import pytest
import torch

from megatron_dapo.algos.advantage import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)

F64 = torch.float64
EPS = 1e-6


def _outcome_batch(scores, length=4, dtype=F64):
    """Rewards whose row sums are `scores`, spread over two tokens; masks of varying length."""
    batch = len(scores)
    rewards = torch.zeros(batch, length, dtype=dtype)
    rewards[:, 0] = torch.tensor(scores, dtype=dtype) - 0.25
    rewards[:, 1] = 0.25
    lengths = torch.tensor([2 + i % (length - 1) for i in range(batch)])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    return rewards, mask


def test_registered_estimator_names():
    for name in ("grpo", "grpo_vectorized", "rloo", "reinforce_plus_plus", "gae"):
        assert callable(get_adv_estimator_fn(name))
    assert get_adv_estimator_fn("grpo") is compute_grpo_outcome_advantage


def test_unknown_estimator_lists_registered_names():
    with pytest.raises(ValueError, match="grpo_vectorized"):
        get_adv_estimator_fn("ppo")


def test_registering_a_different_function_under_a_taken_name_raises():
    with pytest.raises(ValueError, match="grpo"):
        register_adv_est("grpo")(lambda **kwargs: None)


@pytest.mark.parametrize("fn", [compute_grpo_outcome_advantage, compute_grpo_vectorized_outcome_advantage])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_small_case_by_hand(fn, norm):
    # group a: 1, 2, 3 (mean 2, std 1); group b: 0, 4 (mean 2, std 2*sqrt(2)); group c: 5 alone.
    index = ["a", "b", "a", "c", "a", "b"]
    rewards, mask = _outcome_batch([1.0, 0.0, 2.0, 5.0, 3.0, 4.0])
    adv, returns = fn(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    if norm:
        expected = [
            -1 / (1 + EPS),
            -2 / (math.sqrt(8) + EPS),
            0.0,
            5 / (1 + EPS),
            1 / (1 + EPS),
            2 / (math.sqrt(8) + EPS),
        ]
    else:
        expected = [-1.0, -2.0, 0.0, 5.0, 1.0, 2.0]  # a singleton keeps score - 0
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64)[:, None] * mask)
    assert adv is returns or torch.equal(adv, returns)
    assert (adv[mask == 0] == 0).all()


@pytest.mark.parametrize("fn", [compute_grpo_outcome_advantage, compute_grpo_vectorized_outcome_advantage])
def test_grpo_constant_group_gets_exactly_zero_advantage(fn):
    # Three float32 0.9 scores: torch.mean in float32 is off by 6e-8 and the std 7e-8, which would
    # give advantages of about -0.05; the float64 statistics make them exactly zero.
    scores = torch.full((3,), 0.9)
    assert torch.std(scores) > 0  # the float32 hazard this test guards against
    rewards = torch.zeros(3, 2)
    rewards[:, 0] = scores
    adv, _ = fn(rewards, torch.ones(3, 2), [7, 7, 7])
    assert torch.equal(adv, torch.zeros(3, 2))


def _random_groups(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 6, size=40)  # includes groups of one
    ids = np.repeat(np.arange(len(sizes)), sizes)
    rng.shuffle(ids)
    batch = len(ids)
    rewards = torch.zeros(batch, 5)
    binary = torch.from_numpy(rng.integers(0, 2, size=batch).astype(np.float32)) * 2 - 1
    noise = torch.from_numpy(rng.normal(size=batch).astype(np.float32))
    rewards[:, 2] = torch.where(torch.from_numpy(rng.random(batch) < 0.5), binary, noise)
    mask = torch.from_numpy((rng.random((batch, 5)) < 0.8).astype(np.float32))
    return ids, rewards, mask


INDEX_FORMS = {
    "list_str": lambda ids: [f"uid-{i:03d}" for i in ids],
    "list_int": lambda ids: [int(i) for i in ids],
    "ndarray_object_str": lambda ids: np.array([f"uid-{i}" for i in ids], dtype=object),
    "ndarray_unicode": lambda ids: np.array([f"uid-{i}" for i in ids]),
    "ndarray_int": lambda ids: ids.astype(np.int64),
    "tensor_int": lambda ids: torch.from_numpy(ids.astype(np.int64)),
    "list_negative_int": lambda ids: [-int(i) - 1 for i in ids],  # hash(-1) == hash(-2)
}


@pytest.mark.parametrize("form", sorted(INDEX_FORMS))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_loop_equals_vectorized_on_random_groups(form, seed, norm):
    ids, rewards, mask = _random_groups(seed)
    index = INDEX_FORMS[form](ids)
    loop, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    vec, _ = compute_grpo_vectorized_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    assert vec.dtype == rewards.dtype
    torch.testing.assert_close(vec, loop, rtol=1e-6, atol=1e-6)


def test_vectorized_grpo_groups_hash_colliding_ids_apart():
    # hash(-1) == hash(-2) in CPython: the hash factorisation must notice and stay exact.
    rewards, mask = _outcome_batch([1.0, 10.0, 3.0, 30.0])
    adv, _ = compute_grpo_vectorized_outcome_advantage(
        rewards, mask, [-1, -2, -1, -2], norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(adv, torch.tensor([-1.0, -10.0, 1.0, 10.0], dtype=F64)[:, None] * mask)


@pytest.mark.parametrize(
    "fn",
    [
        compute_grpo_outcome_advantage,
        compute_grpo_vectorized_outcome_advantage,
        compute_rloo_outcome_advantage,
    ],
)
def test_index_of_wrong_length_raises(fn):
    rewards, mask = _outcome_batch([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="index"):
        fn(rewards, mask, ["a", "a"])


def test_mask_of_wrong_shape_raises():
    rewards, mask = _outcome_batch([1.0, 2.0])
    with pytest.raises(ValueError, match="response_mask"):
        compute_grpo_vectorized_outcome_advantage(rewards, mask[:, :2], ["a", "a"])


def test_rloo_by_hand():
    # group a: 1, 2, 3 -> each minus the mean of the other two; group b: 5 alone keeps its score.
    rewards, mask = _outcome_batch([1.0, 5.0, 2.0, 3.0])
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, ["a", "b", "a", "a"])
    torch.testing.assert_close(adv, torch.tensor([1 - 2.5, 5.0, 2 - 2.0, 3 - 1.5], dtype=F64)[:, None] * mask)


def test_reinforce_plus_plus_by_hand():
    gamma = 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 7.0]], dtype=F64)  # 7.0 sits on padding
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=gamma)
    # Row 1: the padded 7.0 is not carried back (a masked position adds no reward).
    expected_returns = torch.tensor([[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]], dtype=F64)
    torch.testing.assert_close(returns, expected_returns)
    valid = [0.25, 0.5, 1.0, 0.5, 1.0]
    mean, var = statistics.mean(valid), statistics.variance(valid)  # unbiased, like torch.var
    expected_adv = (expected_returns - mean) / math.sqrt(var + 1e-8) * mask
    torch.testing.assert_close(adv, expected_adv)


def test_gae_by_hand_and_padding_is_skipped():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 1.0], [2.0, 0.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.2], [0.4, 123.0]], dtype=F64)  # 123.0 sits on padding
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv, returns = compute_gae_advantage_return(rewards, values, mask, gamma=gamma, lam=lam)
    # Row 0: delta_1 = 1 - 0.2 = 0.8 -> A_1 = 0.8; delta_0 = 0.9*0.2 - 0.5 = -0.32 -> A_0 = -0.32 + 0.72*0.8.
    # Row 1: the padded step is skipped, so A_0 = delta_0 = 2 - 0.4 = 1.6.
    raw = torch.tensor([[-0.32 + 0.72 * 0.8, 0.8], [1.6, 0.0]], dtype=F64)
    torch.testing.assert_close(returns, (raw + values) * mask)
    valid = [raw[0, 0].item(), 0.8, 1.6]
    mean, var = statistics.mean(valid), statistics.variance(valid)
    torch.testing.assert_close(adv, (raw - mean) / math.sqrt(var + 1e-8) * mask)


def test_whitening_needs_two_valid_tokens():
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        compute_reinforce_plus_plus_outcome_advantage(torch.ones(1, 3), torch.tensor([[1.0, 0.0, 0.0]]))


def test_advantages_are_detached():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]], requires_grad=True)
    adv, _ = compute_grpo_vectorized_outcome_advantage(rewards, torch.ones(2, 2), ["a", "a"])
    assert not adv.requires_grad


def test_reinforce_plus_plus_carries_the_return_across_masked_gaps():
    """verl 0.9.1's REINFORCE++: a masked position inside a response (a tool observation, a token
    dropped by rejection sampling) neither adds its reward nor cuts the return off."""
    gamma = 0.5
    rewards = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0]], dtype=F64)  # the 5.0 is masked
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    adv, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=gamma)
    # Row 0: t=2 gives 1; t=1 is skipped; t=0 gets 0 + 0.5 * 1 (not 0: the gap does not reset it).
    torch.testing.assert_close(returns, torch.tensor([[0.5, 0.0, 1.0], [2.0, 0.0, 0.0]], dtype=F64))
    valid = [0.5, 1.0, 2.0, 0.0]
    mean, var = statistics.mean(valid), statistics.variance(valid)
    torch.testing.assert_close(adv, (returns - mean) / math.sqrt(var + 1e-8) * mask)


VERL_CONFIG = types.SimpleNamespace(gamma=0.5, lam=0.9, norm_adv_by_std_in_grpo=True)  # an AlgoConfig stand-in


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized", "rloo", "reinforce_plus_plus", "gae"])
def test_every_estimator_accepts_verls_config_keyword(name):
    rewards, mask = _outcome_batch([1.0, 0.0, 1.0, 1.0])
    kwargs = {"token_level_rewards": rewards, "response_mask": mask, "config": VERL_CONFIG}
    if name == "gae":
        kwargs["values"] = torch.zeros_like(rewards)
    else:  # verl's trainer passes the uids to every estimator but GAE
        kwargs["index"] = ["a", "a", "b", "b"]
    adv, _ = get_adv_estimator_fn(name)(**kwargs)
    assert adv.shape == rewards.shape and torch.isfinite(adv).all()


def test_reinforce_plus_plus_reads_gamma_from_config_as_verl_does():
    rewards, mask = _outcome_batch([1.0, 0.0, 1.0, 3.0])
    explicit = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    for config in (VERL_CONFIG, {"gamma": 0.5}):
        from_config = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=config, index=[0, 0, 1, 1])
        for a, b in zip(explicit, from_config):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    default = compute_reinforce_plus_plus_outcome_advantage(rewards, mask)
    torch.testing.assert_close(default[1], compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=1.0)[1])


def test_gae_reads_gamma_and_lam_from_config():
    rewards, mask = _outcome_batch([1.0, 0.0, 2.0])
    values = torch.full_like(rewards, 0.1)
    explicit = compute_gae_advantage_return(rewards, values, mask, gamma=0.5, lam=0.9)
    from_config = compute_gae_advantage_return(rewards, values, mask, config=VERL_CONFIG)
    for a, b in zip(explicit, from_config):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_knob_given_twice_with_different_values_is_an_error_naming_it():
    rewards, mask = _outcome_batch([1.0, 0.0])
    with pytest.raises(ValueError, match=r"gamma=0.9 disagrees with config.gamma=0.5"):
        compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.9, config=VERL_CONFIG)
    compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5, config=VERL_CONFIG)  # agreeing is fine
