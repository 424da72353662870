"""The reward manager and reward function a config names (reward.*): one place for the trainer, the
producers, validation, eval and the preflight check."""

from __future__ import annotations

from megatron_dapo.config import Config, ConfigError


def build_reward_manager(cfg: Config):
    """The reward manager from reward.* (every field passed by keyword; auto picks by data.task)."""
    from megatron_dapo.rewards.manager import RewardManager

    r, score_fn = cfg.reward, build_score_fn(cfg)
    ob = r.overlong_buffer
    return RewardManager(score_fn, max_response_length=cfg.data.max_response_length,
                         overlong_buffer_enable=ob.enable, overlong_buffer_len=ob.len,
                         overlong_penalty_factor=ob.penalty_factor, on_error=r.on_error,
                         error_score=r.error_score, timeout_s=r.timeout_s, num_workers=r.num_workers)


def build_score_fn(cfg: Config):
    """The reward function reward.* names: a custom one (loaded here once, so a file that does not load
    fails the start), else reward.function (auto picks by data.task)."""
    from megatron_dapo.rewards.manager import make_reward_fn

    r = cfg.reward
    if r.custom_function.path:
        from megatron_dapo.rewards.custom import CustomRewardError, CustomRewardFn

        score_fn = CustomRewardFn(r.custom_function.path, r.custom_function.name)
        try:
            score_fn.load()  # here, once: a file that does not load or define the function stops the start
        except CustomRewardError as e:
            raise ConfigError("reward.custom_function", str(e)) from None
    else:
        name = r.function if r.function != "auto" else ("arithmetic" if cfg.data.task == "arithmetic" else "math_dapo")
        try:
            score_fn = make_reward_fn(name, strict_box_verify=r.strict_box_verify)
        except ValueError as e:
            raise ConfigError("reward.strict_box_verify", str(e)) from None
    return score_fn
