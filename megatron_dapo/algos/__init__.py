"""Pure tensor functions of the DAPO algorithm (contract: shared/API.md).

Submodules: policy_loss, advantage, kl, overlong, rollout_correction, dynamic_sampling.
"""

from megatron_dapo.algos.advantage import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)
from megatron_dapo.algos.dynamic_sampling import select_informative_groups
from megatron_dapo.algos.kl import (
    KL_PENALTY_TYPES,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
)
from megatron_dapo.algos.overlong import overlong_filter_mask, overlong_penalty
from megatron_dapo.algos.policy_loss import (
    AGG_MODES,
    POLICY_LOSS_KWARGS,
    agg_loss,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    register_policy_loss,
)
from megatron_dapo.algos.rollout_correction import (
    ROLLOUT_CORRECTION_PRESETS,
    ROLLOUT_RS_MODES,
    compute_rollout_correction,
    get_rollout_correction_preset,
)

__all__ = [
    "AGG_MODES",
    "KL_PENALTY_TYPES",
    "POLICY_LOSS_KWARGS",
    "ROLLOUT_CORRECTION_PRESETS",
    "ROLLOUT_RS_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_correction",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "get_rollout_correction_preset",
    "kl_penalty",
    "overlong_filter_mask",
    "overlong_penalty",
    "register_adv_est",
    "register_policy_loss",
    "select_informative_groups",
]
