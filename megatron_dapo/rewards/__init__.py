"""Rewards: the DAPO math rewards (math_dapo as verl scores it, math_dapo_plus, math_verify), the
synthetic arithmetic reward, and the batch reward manager."""

from megatron_dapo.rewards.manager import (
    RewardError,
    RewardManager,
    RewardOutput,
    get_reward_fn,
    make_reward_fn,
    register_reward_fn,
)

__all__ = ["RewardError", "RewardManager", "RewardOutput", "get_reward_fn", "make_reward_fn", "register_reward_fn"]
