"""The reward and algorithm sections of the config tree: `RewardConfig` (reward function, a custom one,
overlong shaping, failures) and `AlgorithmConfig` (advantages, KL in the reward, dynamic sampling,
rollout correction), each with its sub-configs.

As everywhere in the tree (schema.py): the field docstrings are the documentation (docs/configuration.md
is generated from them), each section validates itself in `__post_init__`, and errors name the key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from megatron_dapo.config.schema import _check


@dataclass
class CustomRewardFunctionConfig:
    path: str = ""
    """A Python file holding a reward function of your own (verl's signature: data_source, solution_str, ground_truth, extra_info -> a float or a dict with 'score'); it replaces reward.function. Runs in the reward workers with reward.timeout_s and reward.on_error. Empty = off. [recipe: custom_reward_function.path]"""
    name: str = "compute_score"
    """The function's name in that file. [recipe: custom_reward_function.name]"""


@dataclass
class OverlongBufferConfig:
    enable: bool = True
    """Soft overlong punishment: a linear penalty over the last `len` tokens before the limit. [recipe: reward_model.overlong_buffer.enable]"""
    len: int = 4
    """Length of the penalty interval in tokens (DAPO: 4096 of 20480). [recipe: reward_model.overlong_buffer.len]"""
    penalty_factor: float = 1.0
    """Penalty at the limit. [recipe: reward_model.overlong_buffer.penalty_factor]"""
    log: bool = False
    """Also log the overlong penalty statistics (reward/overlong_penalty/mean|min, reward/overlong_penalized_ratio, reward/overlong_ratio). [recipe: reward_model.overlong_buffer.log]"""

    def __post_init__(self):
        _check(self.penalty_factor >= 0, "reward.overlong_buffer.penalty_factor", ">= 0", self.penalty_factor)


@dataclass
class RewardConfig:
    function: Literal["auto", "arithmetic", "math_dapo", "math_dapo_plus", "math_verify"] = "auto"
    """Reward function; auto = arithmetic for data.task=arithmetic, math_dapo for files. math_dapo scores exactly as verl's math_dapo (+-1); math_dapo_plus normalises answers as a grader would (+-1); math_verify compares answers symbolically with Math-Verify (0/1, as verl's math_verify). [recipe: reward_model.reward_manager=dapo]"""
    strict_box_verify: bool = False
    """math_dapo, math_dapo_plus: score only the last \\boxed{} of the final 100 characters, compared with the ground truth as written (an error with another reward function)."""
    custom_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """A reward function of your own, from a Python file (docs/rewards-and-losses.md)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """Overlong reward shaping."""
    overlong_filter: bool = False
    """Exclude truncated responses (no EOS within the limit) from the loss."""
    on_error: Literal["raise", "penalize"] = "raise"
    """A reward function that raises, hangs or returns a non-finite score: stop with a named error, or give error_score and count it."""
    error_score: float = -1.0
    """Score given to a sample whose reward failed, when on_error=penalize."""
    timeout_s: float = 10.0
    """Per-call timeout of the reward function (<= 0 runs it inline, without a timeout)."""
    num_workers: int = 1
    """Reward worker processes."""

    def __post_init__(self):
        _check(self.num_workers >= 1, "reward.num_workers", ">= 1", self.num_workers)
        c = self.custom_function
        if c.path:
            _check(os.path.isfile(c.path), "reward.custom_function.path", "an existing Python file", c.path)
            _check(self.function == "auto", "reward.function", "auto when reward.custom_function.path is set (the "
                   "custom function replaces it)", self.function)
            _check(not self.strict_box_verify, "reward.strict_box_verify", "false with a custom reward function",
                   self.strict_box_verify)
            _check(bool(c.name) and c.name.isidentifier(), "reward.custom_function.name", "a Python identifier", c.name)


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """KL-in-reward controller. [recipe: algorithm.kl_ctrl.type]"""
    kl_coef: float = 0.001
    """(Initial) KL coefficient. [recipe: algorithm.kl_ctrl.kl_coef]"""
    horizon: int = 10000
    """Adaptive controller horizon. [recipe: algorithm.kl_ctrl.horizon]"""
    target_kl: float = 0.1
    """Adaptive controller target. [recipe: algorithm.kl_ctrl.target_kl]"""

    def __post_init__(self):
        _check(self.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", ">= 0", self.kl_coef)
        if self.type == "adaptive":
            _check(self.horizon > 0, "algorithm.kl_ctrl.horizon", "> 0 for the adaptive controller", self.horizon)
            _check(self.target_kl > 0, "algorithm.kl_ctrl.target_kl", "> 0 for the adaptive controller",
                   self.target_kl)


@dataclass
class FilterGroupsConfig:
    enable: bool = True
    """DAPO dynamic sampling: drop groups whose metric is constant, re-generate until train_batch_size groups. [recipe: algorithm.filter_groups.enable]"""
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    """Per-sample value whose within-group variance decides. [recipe: algorithm.filter_groups.metric]"""
    max_num_gen_batches: int = 10
    """Most generation batches per step (<= 0: no limit). [recipe: algorithm.filter_groups.max_num_gen_batches]"""
    on_exhausted: Literal["raise", "train_on_available"] = "raise"
    """Past max_num_gen_batches: stop with an error (as the recipe), or train on the groups kept so far."""
    streaming: bool = False
    """Stop a generation batch as soon as train_batch_size informative groups are complete (each group scored when its last sample ends); groups still running are aborted and their prompts go back to the front of the sampler. Cuts the longest responses' tail, so it favours short answers (docs/dapo-step.md, "Streaming dynamic sampling"). Sync trainer; either engine (SGLang: one request per group, the rest aborted by rid)."""


@dataclass
class RolloutCorrectionConfig:
    preset: Literal["decoupled_token_is", "decoupled_seq_is", "decoupled_geo_rs", "bypass_ppo_clip",
                    "bypass_pg_is"] | None = None
    """A named preset of the keys below; explicit keys may not also be set. [recipe: algorithm.rollout_correction]"""
    rollout_is: Literal["token", "sequence"] | None = None
    """Importance weights old/rollout policy: per token, per sequence, or None (metrics only). [recipe: algorithm.rollout_correction.rollout_is]"""
    rollout_is_threshold: float | str = 2.0
    """A number truncates weights above it; "lower_upper" zeroes weights outside the band. [recipe: algorithm.rollout_correction.rollout_is_threshold]"""
    rollout_is_batch_normalize: bool = False
    """Rescale the weights to mean 1. [recipe: algorithm.rollout_correction.rollout_is_batch_normalize]"""
    rollout_rs: str | None = None
    """Rejection-sampling modes, comma-separated (token_k1, seq_mean_k1, seq_max_k2, ...). [recipe: algorithm.rollout_correction.rollout_rs]"""
    rollout_rs_threshold: float | str | None = None
    """Threshold(s) of rollout_rs, one per mode or one for all. [recipe: algorithm.rollout_correction.rollout_rs_threshold]"""
    bypass_mode: bool = False
    """Use the rollout log-probs as old log-probs (skip the old_log_prob forward). [recipe: algorithm.rollout_correction.bypass_mode]"""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Loss in bypass mode: clipped PPO against the rollout policy, or IS-weighted REINFORCE. [recipe: algorithm.rollout_correction.loss_type]"""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage registry entry (grpo for DAPO; grpo_vectorized, rloo, reinforce_plus_plus, gae). [recipe: algorithm.adv_estimator]"""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group std. [recipe: algorithm.norm_adv_by_std_in_grpo]"""
    gamma: float = 1.0
    """Discount (gae, reinforce_plus_plus). [recipe: algorithm.gamma]"""
    lam: float = 1.0
    """GAE lambda. [recipe: algorithm.lam]"""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty from the token rewards (off in DAPO). [recipe: algorithm.use_kl_in_reward]"""
    kl_penalty: str = "kl"
    """KL estimator of the in-reward penalty. [recipe: algorithm.kl_penalty]"""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """KL-in-reward controller."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Off-policy (rollout vs training policy) correction."""
