"""The root of the config tree and the checks that span sections."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.schema import (
    ActorConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    QueueConfig,
    TrainerConfig,
)
from megatron_dapo.config.schema_algorithm import AlgorithmConfig, RewardConfig
from megatron_dapo.config.schema_rollout import RolloutConfig

_KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts, lengths and batch sizes."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The Megatron-Core model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP / EP / CP of the actor and reference."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Optimizer and the DAPO policy loss."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling and the rollout engines."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function, overlong shaping and error handling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, KL, dynamic sampling, rollout correction."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop length, checkpoints, validation, logging, devices."""
    queue: QueueConfig = field(default_factory=QueueConfig)
    """The TransferQueue trainer and asynchronous rollout."""

    def __post_init__(self):
        _check_dynamic_sampling(self)
        _check_overlong(self)
        _check_min_new_tokens(self)
        _check_batches(self)
        _check_names(self)
        _check_rollout_correction(self)
        _check_bypass(self)
        _check_queue(self)
        _check_router_replay(self)
        self.parallel.check_world_size(self.trainer.world_size)
        if self.data.task == "files" and self.trainer.test_freq > 0 and not self.data.val_files:
            raise ConfigError("data.val_files", "a validation set is required when trainer.test_freq > 0 "
                              "(or set trainer.test_freq=0)")
        if self.data.task == "files" and not self.data.tokenizer:
            raise ConfigError("data.tokenizer", "an HF tokenizer directory is required when data.task=files")

    @property
    def needs_reference(self) -> bool:
        """The reference model exists only when a KL term is used (in the loss or in the reward)."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def run_dir(self) -> str:
        return os.path.join(self.trainer.output_dir, self.trainer.experiment_name)

    @property
    def ckpt_dir(self) -> str:
        return self.trainer.default_local_dir or os.path.join(self.run_dir, "ckpt")


def _check_dynamic_sampling(cfg: Config) -> None:
    fg = cfg.algorithm.filter_groups
    if fg.streaming:
        where = ("algorithm.filter_groups.enable=false (there is nothing to stop early for)" if not fg.enable else
                 "queue.enable=true (the sync trainer streams)" if cfg.queue.enable else None)
        if where is not None:
            raise ConfigError("algorithm.filter_groups.streaming", f"expected false with {where}, got true")
    if not fg.enable:
        if cfg.data.effective_gen_batch_size != cfg.data.train_batch_size:
            raise ConfigError("data.gen_batch_size", f"expected null or data.train_batch_size "
                              f"({cfg.data.train_batch_size}) when dynamic sampling is off (every generated "
                              f"prompt is trained on), got {cfg.data.gen_batch_size}")
        return
    if cfg.rollout.n < 2:
        raise ConfigError("rollout.n", f"expected >= 2 when algorithm.filter_groups.enable (a group of one has "
                          f"no variance to filter on), got {cfg.rollout.n}")
    if cfg.data.effective_gen_batch_size < cfg.data.train_batch_size:
        raise ConfigError("data.gen_batch_size", f"expected >= data.train_batch_size ({cfg.data.train_batch_size}) "
                          f"when algorithm.filter_groups.enable, got {cfg.data.effective_gen_batch_size}")


def _check_queue(cfg: Config) -> None:
    """What the queue trainer does not run yet is refused here, before any model is built or server started."""
    q = cfg.queue
    if not q.enable:
        return
    if cfg.rollout.engine == "local" and cfg.trainer.world_size != 1:
        raise ConfigError("queue.enable", f"with rollout.engine=local the queue trainer runs one training process, "
                          f"got trainer.nnodes x trainer.n_gpus_per_node = {cfg.trainer.world_size}; use "
                          "rollout.engine=sglang for several")
    if cfg.rollout.engine == "sglang" and q.max_staleness > 0:
        if cfg.rollout.mode == "colocate":
            raise ConfigError("queue.max_staleness", f"expected 0 with rollout.mode=colocate, got {q.max_staleness}: "
                              "in async mode the servers generate while the actor trains, so they need accelerators "
                              "of their own (rollout.mode=disaggregate)")
        if cfg.rollout.speculative.auto:
            raise ConfigError("rollout.speculative.auto", "the with / without speculation comparison relaunches the "
                              "servers between steps; the queue trainer's async mode generates across steps: set "
                              "rollout.speculative.auto=false")
    if cfg.trainer.async_save:
        raise ConfigError("trainer.async_save", "the queue trainer saves synchronously (its queue and checkpoint are "
                          "committed together); set trainer.async_save=false or use the sync trainer")
    if cfg.trainer.total_training_steps % q.parameter_sync_step:
        raise ConfigError("queue.parameter_sync_step", f"expected a divisor of trainer.total_training_steps "
                          f"({cfg.trainer.total_training_steps}: checkpoints fall on weight syncs), got "
                          f"{q.parameter_sync_step}")


def _check_overlong(cfg: Config) -> None:
    ob = cfg.reward.overlong_buffer
    if ob.enable and not 0 < ob.len <= cfg.data.max_response_length:
        raise ConfigError("reward.overlong_buffer.len", f"expected 0 < len <= data.max_response_length "
                          f"({cfg.data.max_response_length}), got {ob.len}")


def _check_min_new_tokens(cfg: Config) -> None:
    if cfg.rollout.min_new_tokens > cfg.data.max_response_length:
        raise ConfigError("rollout.min_new_tokens", f"expected <= data.max_response_length "
                          f"({cfg.data.max_response_length}), got {cfg.rollout.min_new_tokens}")


def _check_batches(cfg: Config) -> None:
    mini, train = cfg.actor.ppo_mini_batch_size, cfg.data.train_batch_size
    if mini > train or train % mini:
        raise ConfigError("actor.ppo_mini_batch_size", f"expected a divisor of data.train_batch_size ({train}), "
                          f"got {mini}")
    if cfg.actor.max_tokens_per_microbatch < cfg.data.max_prompt_length + cfg.data.max_response_length:
        raise ConfigError("actor.max_tokens_per_microbatch",
                          f"expected >= max_prompt_length + max_response_length "
                          f"({cfg.data.max_prompt_length + cfg.data.max_response_length}) so one sequence fits, "
                          f"got {cfg.actor.max_tokens_per_microbatch}")


def _kl_name_ok(name: str) -> bool:
    return name.rstrip("+") in _KL_ESTIMATORS and name.count("+") <= 1


def _check_names(cfg: Config) -> None:
    """Registry names are resolved here, at start, so a typo never waits for the first update."""
    from megatron_dapo.algos.advantage import get_adv_estimator_fn
    from megatron_dapo.algos.policy_loss import get_policy_loss_fn

    for key, getter, name in (("actor.policy_loss", get_policy_loss_fn, cfg.actor.policy_loss),
                              ("algorithm.adv_estimator", get_adv_estimator_fn, cfg.algorithm.adv_estimator)):
        try:
            getter(name)
        except ValueError as e:
            raise ConfigError(key, str(e)) from None
    for key, name in (("actor.kl_loss_type", cfg.actor.kl_loss_type), ("algorithm.kl_penalty", cfg.algorithm.kl_penalty)):
        if not _kl_name_ok(name):
            raise ConfigError(key, f"expected one of {', '.join(_KL_ESTIMATORS)} (optionally with a trailing '+'), "
                              f"got {name!r}")


def _check_rollout_correction(cfg: Config) -> None:
    rc = cfg.algorithm.rollout_correction
    if rc.preset is None:
        return
    defaults = type(rc)()
    explicit = [k for k in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                            "rollout_rs_threshold", "bypass_mode", "loss_type")
                if getattr(rc, k) != getattr(defaults, k)]
    if explicit:
        raise ConfigError(f"algorithm.rollout_correction.{explicit[0]}",
                          f"set together with preset={rc.preset!r}; use either the preset or explicit keys")


def _check_router_replay(cfg: Config) -> None:
    if cfg.actor.router_replay == "r3" and cfg.rollout.engine != "sglang":
        raise ConfigError("actor.router_replay", "r3 replays the routing SGLang reports per request: it needs "
                          f"rollout.engine=sglang (got {cfg.rollout.engine!r}); r2 records it in the trainer")


def _check_bypass(cfg: Config) -> None:
    rc = resolve_rollout_correction(cfg)
    if rc["bypass_mode"] and rc["rollout_is_batch_normalize"]:
        raise ConfigError("algorithm.rollout_correction.rollout_is_batch_normalize",
                          "not supported in bypass mode (weights are computed per micro-batch in the loss)")


def resolve_rollout_correction(cfg: Config) -> dict:
    """The effective rollout-correction keyword arguments (preset expanded), plus bypass_mode and loss_type."""
    from megatron_dapo.algos.rollout_correction import ROLLOUT_CORRECTION_PRESETS

    rc = cfg.algorithm.rollout_correction
    if rc.preset is not None:
        return dict(ROLLOUT_CORRECTION_PRESETS[rc.preset])
    return {k: getattr(rc, k) for k in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
                                        "rollout_rs", "rollout_rs_threshold", "bypass_mode", "loss_type")}
