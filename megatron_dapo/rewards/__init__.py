"""Rewards: the DAPO math reward, the synthetic arithmetic reward, and the batch reward manager."""

from megatron_dapo.rewards.manager import (
    RewardError,
    RewardManager,
    RewardOutput,
    get_reward_fn,
    register_reward_fn,
)

__all__ = ["RewardError", "RewardManager", "RewardOutput", "get_reward_fn", "register_reward_fn"]
