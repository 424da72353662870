"""Advantage estimators (GRPO, RLOO, REINFORCE++, GAE) behind a name registry.

Shape legend:
    B  responses in the batch
    T  padded response length
    G  number of distinct prompt ids in `index`
    token_level_rewards, values, response_mask, advantages, returns: [B, T]
    scores (row sums of the rewards): [B]; per-group statistics: [G]

`index` is the prompt id of each response (a list, numpy array or tensor of length B, of str or
int, all of one type); responses with the same id form one GRPO/RLOO group.

Group statistics are computed in float64 and the advantages cast back to the rewards' dtype: a
group whose scores are all equal then gets exactly zero advantage (in float32 the group mean of
three 0.1s is not 0.1, and dividing that round-off by std + 1e-6 gives advantages near 0.01).

Every estimator returns `(advantages, returns)`, both [B, T], zero on padding, detached.

verl calls every estimator with its algorithm config as `config=` (and the prompt ids as `index=`),
so each accepts `config` (a dataclass, namespace or mapping). GRPO and RLOO ignore it, as verl does;
REINFORCE++ and GAE read `gamma` (and `lam`) from it when those are not passed explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "get_adv_estimator_fn",
    "register_adv_est",
]

_ADV_ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {}


def register_adv_est(name: str) -> Callable:
    """Decorator registering an advantage estimator under `name`."""

    def decorator(fn: Callable) -> Callable:
        existing = _ADV_ESTIMATORS.get(name)
        if existing is not None and existing.__qualname__ != fn.__qualname__:
            raise ValueError(f"advantage estimator {name!r} is already registered to {existing.__qualname__}")
        _ADV_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """The estimator registered under `name` (resolve it once, at trainer build time)."""
    try:
        return _ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; registered estimators: {sorted(_ADV_ESTIMATORS)}"
        ) from None


# ---------------------------------------------------------------------------------------------
# Input checks and grouping
# ---------------------------------------------------------------------------------------------


def _check_rewards(token_level_rewards: Tensor, response_mask: Tensor, values: Tensor | None = None) -> None:
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be a [B, T] tensor, got shape {tuple(token_level_rewards.shape)}"
        )
    if not token_level_rewards.is_floating_point():
        raise ValueError(f"token_level_rewards must be floating point, got {token_level_rewards.dtype}")
    for name, tensor in (("response_mask", response_mask), ("values", values)):
        if tensor is not None and tensor.shape != token_level_rewards.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(token_level_rewards.shape)} "
                "(the shape of token_level_rewards)"
            )


def _check_index_length(index: object, batch_size: int) -> None:
    if isinstance(index, str | bytes) or not hasattr(index, "__len__"):
        raise ValueError(
            f"index must be a list, numpy array or tensor of prompt ids, got {type(index).__name__}"
        )
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} prompt ids, expected one per response (B={batch_size})")


def _index_as_keys(index: Sequence | np.ndarray | Tensor, batch_size: int) -> list[Hashable]:
    """Prompt ids as hashable Python values (0-dim tensors hash by identity, so never use them)."""
    _check_index_length(index, batch_size)
    if isinstance(index, Tensor):
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
        return index.tolist()
    if isinstance(index, np.ndarray):
        return index.tolist()
    return list(index)


def _group_ids(
    index: Sequence | np.ndarray | Tensor, batch_size: int, device: torch.device
) -> tuple[Tensor, int]:
    """Map prompt ids to dense group ids [B] (int64, on `device`) without a Python loop over rows.

    Returns (group_id, G). Integer tensors and arrays go straight to torch.unique. Other ids
    (uuid strings, lists) are hashed by `map(hash, ...)`, which runs in C with no bytecode per
    row, and the hashes are factorised with torch.unique. Grouping therefore follows the same
    hash/equality rules as the dict in `compute_grpo_outcome_advantage`; it is exact because it
    checks that distinct hashes == distinct ids, and refactorises through a dict in the
    (astronomically rare for strings) case of a hash collision such as hash(-1) == hash(-2).
    """
    _check_index_length(index, batch_size)
    if isinstance(index, Tensor):
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
        if index.device != device:
            raise ValueError(f"index is on {index.device} but the rewards are on {device}")
        uniques, inverse = torch.unique(index, return_inverse=True)
        return inverse, uniques.numel()
    if isinstance(index, np.ndarray):
        if index.ndim != 1:
            raise ValueError(f"index must be 1-D, got shape {index.shape}")
        if index.dtype.kind in "iub":
            uniques, inverse = torch.unique(torch.from_numpy(index).to(torch.int64), return_inverse=True)
            return inverse.to(device), uniques.numel()
    try:
        hashes = np.fromiter(map(hash, index), dtype=np.int64, count=batch_size)
        num_ids = len(set(index))
    except TypeError as err:
        raise ValueError(f"index must hold hashable prompt ids (str or int): {err}") from None
    uniques, inverse = torch.unique(torch.from_numpy(hashes), return_inverse=True)
    if uniques.numel() != num_ids:
        first_row: dict[Hashable, int] = {}
        inverse = torch.tensor(
            [first_row.setdefault(key, len(first_row)) for key in index], dtype=torch.int64
        )
    return inverse.to(device), num_ids


def _knob(value: float | None, name: str, config: Any, default: float) -> float:
    """An estimator knob: the explicit keyword, else verl's `config.<name>`, else the default.

    Both given and different is a ValueError naming the knob (never a silent pick of one).
    """
    from_config = None
    if config is not None:
        from_config = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    if value is not None and from_config is not None and float(value) != float(from_config):
        raise ValueError(f"{name}={value!r} disagrees with config.{name}={from_config!r}; pass one of them")
    if value is not None:
        return float(value)
    return default if from_config is None else float(from_config)


def _masked_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """(values - mean) / sqrt(var + 1e-8) with the mean and unbiased variance over valid tokens."""
    n_valid = mask.sum()
    if int(n_valid) < 2:  # one sync per step: whitening needs a variance
        raise ValueError(f"whitening needs at least 2 valid tokens in response_mask, got {int(n_valid)}")
    mean = (values * mask).sum() / n_valid
    var = ((values - mean).square() * mask).sum() / (n_valid - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


# ---------------------------------------------------------------------------------------------
# Outcome estimators (one scalar score per response, broadcast over its tokens)
# ---------------------------------------------------------------------------------------------


@register_adv_est("grpo")
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence | np.ndarray | Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage, one response at a time (the plain specification).

    Keyword arguments: token_level_rewards [B, T], response_mask [B, T], index (B prompt ids),
    epsilon=1e-6, norm_adv_by_std_in_grpo=True, config=None (verl's algorithm config; ignored, as
    in verl, whose trainer passes norm_adv_by_std_in_grpo explicitly).

    score = row sum of token_level_rewards; per group mean and unbiased std (torch.std); a group
    of one response gets mean 0 and std 1. adv = (score - mean) / (std + epsilon), or
    score - mean when norm_adv_by_std_in_grpo is False; broadcast over tokens times the mask.
    Returns (adv, adv). `compute_grpo_vectorized_outcome_advantage` gives the same result fast.
    """
    _check_rewards(token_level_rewards, response_mask)
    batch_size = token_level_rewards.shape[0]
    keys = _index_as_keys(index, batch_size)
    scores = token_level_rewards.sum(dim=-1).double()  # [B]

    group_scores: dict[Hashable, list[Tensor]] = {}
    for i in range(batch_size):
        group_scores.setdefault(keys[i], []).append(scores[i])
    group_mean: dict[Hashable, Tensor] = {}
    group_std: dict[Hashable, Tensor] = {}
    for key, members in group_scores.items():
        if len(members) == 1:
            group_mean[key] = scores.new_tensor(0.0)
            group_std[key] = scores.new_tensor(1.0)
        else:
            stacked = torch.stack(members)
            group_mean[key] = torch.mean(stacked)
            group_std[key] = torch.std(stacked)

    advantages = torch.empty_like(scores)
    for i in range(batch_size):
        centred = scores[i] - group_mean[keys[i]]
        advantages[i] = centred / (group_std[keys[i]] + epsilon) if norm_adv_by_std_in_grpo else centred

    mask = response_mask.to(token_level_rewards.dtype)
    adv = advantages.to(token_level_rewards.dtype).unsqueeze(-1) * mask
    return adv, adv


@register_adv_est("grpo_vectorized")
@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence | np.ndarray | Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage with group statistics from index_add / bincount (no row loop).

    Keyword arguments and result: exactly those of `compute_grpo_outcome_advantage`
    (token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True,
    config=None).
    """
    _check_rewards(token_level_rewards, response_mask)
    batch_size = token_level_rewards.shape[0]
    scores = token_level_rewards.sum(dim=-1).double()  # [B]
    group_id, num_groups = _group_ids(index, batch_size, scores.device)  # [B], G

    counts = torch.bincount(group_id, minlength=num_groups).to(scores.dtype)  # [G]
    sums = scores.new_zeros(num_groups).index_add_(0, group_id, scores)
    mean = sums / counts
    # Two-pass variance (sum of squared deviations), as torch.std does: no cancellation.
    deviations = scores - mean[group_id]
    sq_dev = scores.new_zeros(num_groups).index_add_(0, group_id, deviations.square())
    std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))
    singleton = counts == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)

    advantages = scores - mean[group_id]
    if norm_adv_by_std_in_grpo:
        advantages = advantages / (std[group_id] + epsilon)

    mask = response_mask.to(token_level_rewards.dtype)
    adv = advantages.to(token_level_rewards.dtype).unsqueeze(-1) * mask
    return adv, adv


@register_adv_est("rloo")
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence | np.ndarray | Tensor,
    config: Any = None,
) -> tuple[Tensor, Tensor]:
    """RLOO (leave-one-out) outcome advantage.

    Keyword arguments: token_level_rewards [B, T], response_mask [B, T], index (B prompt ids),
    config=None (verl's algorithm config; ignored, as in verl).

    For a group of n > 1 responses: adv_i = score_i - mean of the other n-1 scores
    (= n/(n-1) * (score_i - group mean)); a group of one keeps its raw score.
    Returns (adv, adv), broadcast over tokens times the mask.
    """
    _check_rewards(token_level_rewards, response_mask)
    batch_size = token_level_rewards.shape[0]
    scores = token_level_rewards.sum(dim=-1).double()  # [B]
    group_id, num_groups = _group_ids(index, batch_size, scores.device)

    counts = torch.bincount(group_id, minlength=num_groups).to(scores.dtype)[group_id]  # [B]
    sums = scores.new_zeros(num_groups).index_add_(0, group_id, scores)[group_id]  # [B]
    leave_one_out_mean = (sums - scores) / (counts - 1).clamp(min=1)
    advantages = torch.where(counts > 1, scores - leave_one_out_mean, scores)

    mask = response_mask.to(token_level_rewards.dtype)
    adv = advantages.to(token_level_rewards.dtype).unsqueeze(-1) * mask
    return adv, adv


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    gamma: float | None = None,
    config: Any = None,
    index: Sequence | np.ndarray | Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over the batch's valid tokens (as verl 0.9.1).

    Keyword arguments: token_level_rewards [B, T], response_mask [B, T], gamma (default: config.gamma,
    else 1.0), config=None (verl's algorithm config), index=None (ignored: REINFORCE++ has no
    groups; verl's trainer passes every estimator the prompt ids).

    Over the valid tokens, returns_t = r_t + gamma * returns_{t'} with t' the next valid token: a
    masked position (padding, or a tool observation inside a multi-turn response) neither adds its
    reward nor breaks the recursion, so the outcome reward reaches every valid token before it.
    advantages = masked_whiten(returns) * mask (mean and unbiased variance over the valid tokens).
    Returns (advantages, returns), both 0 on masked positions.
    """
    _check_rewards(token_level_rewards, response_mask)
    gamma = _knob(gamma, "gamma", config, 1.0)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])  # [B], the return from the next valid token
    # A loop over T (not over responses): the recursion is sequential in time.
    for t in reversed(range(token_level_rewards.shape[1])):
        valid = mask[:, t] > 0
        running = torch.where(valid, token_level_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, torch.zeros_like(running))
    advantages = _masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est("gae")
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float | None = None,
    lam: float | None = None,
    config: Any = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (needs a critic's `values`).

    Keyword arguments: token_level_rewards [B, T], values [B, T], response_mask [B, T],
    gamma and lam (default: config.gamma / config.lam, else 1.0), config=None.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, where
    padded positions are skipped (they neither contribute a TD error nor break the recursion).
    returns = A + V (the critic's target). Returns (masked_whiten(A) * mask, returns * mask).
    """
    _check_rewards(token_level_rewards, response_mask, values)
    gamma = _knob(gamma, "gamma", config, 1.0)
    lam = _knob(lam, "lam", config, 1.0)
    mask = response_mask.to(token_level_rewards.dtype)
    values = values.to(token_level_rewards.dtype)
    next_value = torch.zeros_like(token_level_rewards[:, 0])  # [B]
    last_gae = torch.zeros_like(next_value)
    advantages = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        # On a padded position keep the carried value and advantage unchanged.
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        last_gae = torch.where(mask[:, t] > 0, gae, last_gae)
        advantages[:, t] = last_gae
    returns = (advantages + values) * mask
    return _masked_whiten(advantages, mask) * mask, returns
