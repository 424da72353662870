"""verl's configuration keys, accepted here: each maps to one key of this project, has no effect here (and
says why), or is refused naming what to set instead.

A verl key can be given wherever a key of ours can: in a recipe YAML (verl's nested layout) or as a
`key=value` override, with or without Hydra's leading `+`. So the override list of verl's DAPO recipe
script runs here with the Ray submission line replaced (docs/migrating-from-verl.md). The table below is
the whole contract; `python -m megatron_dapo.config.docs --write docs/migrating-from-verl.md` renders it
into the page between the VERL-TABLE markers, and a test keeps the two in sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_dapo.config.errors import ConfigError

BEGIN, END = "<!-- VERL-TABLE:BEGIN -->", "<!-- VERL-TABLE:END -->"
SECTIONS = ("actor_rollout_ref", "reward_model", "custom_reward_function", "critic")  # verl's, not ours


@dataclass(frozen=True)
class Alias:
    """What one verl key becomes. key: ours (None: no effect here). convert: verl's value -> ours; it raises
    ValueError (the reason) for a value this project cannot honour. note: the documented difference.
    last: applied after every other override (a switch in verl that disables another key's effect).
    implies: (our key, value or a function of verl's value) set as well, unless the configuration gives that key
    itself (in the recipe or an override, in any order): what verl derives from the key."""

    key: str | None
    convert: Callable[[Any], Any] | None = None
    note: str = ""
    last: bool = False
    implies: tuple[tuple[str, Any], ...] = ()


def _one_file(value):
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"{len(value)} files: this project reads one training file; concatenate them "
                             "(make data writes one parquet)")
        return value[0]
    return value


def _is(expected, why: str):
    """Accept exactly `expected` (True, False or None: by identity, so 0 is not False)."""
    def check(value):
        if value is not expected:
            raise ValueError(why)
        return value
    return check


def _zero(why: str):
    def check(value):
        if value not in (0, 0.0):
            raise ValueError(why)
        return value
    return check


def _equal(expected, why: str):
    def check(value):
        if value != expected:
            raise ValueError(why)
        return value
    return check


def _engine(value):
    if value == "sglang":
        return "sglang"
    raise ValueError(f"no {value} engine here: rollout.engine=sglang (SGLang servers) or local (the embedded one)")


def _reward_manager(value):
    if value in ("dapo", "naive"):
        return value
    raise ValueError(f"the {value!r} reward manager does not exist here: reward.function picks the scorer "
                     "(auto = math_dapo for data files), or reward.custom_function.path for your own")


def _router_replay(value):
    modes = {"disabled": "off", "R2": "r2", "R3": "r3"}
    if value not in modes:
        raise ValueError(f"expected one of {', '.join(modes)} (got {value!r})")
    return modes[value]


def _do_sample(value):
    if value is not True:
        raise ValueError("validation always samples here: set rollout.val_kwargs.temperature=0 for greedy decoding")
    return value


def _resume_path(value):
    return value if value else None  # null: no effect (verl's default)


_NO_FSDP = "an FSDP setting: this trainer shards with Megatron (parallel.*), sized by `python -m megatron_dapo.plan`"
_ULYSSES = ("Ulysses sequence parallelism is FSDP's and not needed here: a 20k-token response trains under "
            "tensor parallelism with parallel.sequence_parallel and model.recompute=full, in micro-batches of "
            "actor.max_tokens_per_microbatch tokens (the 32B recipe at TP 8: 1.6 GiB of activations per GPU); "
            "`python -m megatron_dapo.plan` gives the figure for your layout")
_TOKEN_MICRO = ("micro-batches are formed by token count here: actor.max_tokens_per_microbatch (verl's "
                "ppo_max_token_len_per_gpu) for every pass")
_PACKED = "always on: sequences are packed (THD) and micro-batches are formed by token count"

ALIASES: dict[str, Alias] = {
    # data
    "data.train_files": Alias("data.train_files", _one_file, "a list of one file is accepted"),
    "data.val_files": Alias("data.val_files", _one_file, "a list of one file is accepted"),
    "data.prompt_key": Alias(None, _equal("prompt", "the prompt column is always 'prompt' (a list of chat messages)"),
                             "only 'prompt'"),
    "data.truncation": Alias(None, note="prompts are never truncated: longer than data.max_prompt_length are dropped "
                                        "and counted (data.prompt_overflow=filter) or refused (error)"),
    "data.filter_overlong_prompts": Alias("data.prompt_overflow", lambda v: "filter" if v else "error",
                                          "true -> filter, false -> error"),
    "data.return_raw_chat": Alias(None, note="the raw prompt is always kept"),
    # model
    "actor_rollout_ref.model.path": Alias(
        "model.hf_path", note="also model.arch=hf (the shape from its config.json), data.tokenizer=the same path and "
        "model.params_dtype=bf16 (verl's Megatron dtype), each unless given",
        implies=(("model.arch", "hf"), ("data.tokenizer", lambda v: v), ("model.params_dtype", "bf16"))),
    "actor_rollout_ref.model.enable_gradient_checkpointing": Alias(
        "model.recompute", lambda v: "full" if v else "none", "true -> full, false -> none"),
    "actor_rollout_ref.model.use_remove_padding": Alias(None, _is(True, _PACKED), _PACKED),
    "actor_rollout_ref.model.use_fused_kernels": Alias("actor.use_fused_kernels"),
    "actor_rollout_ref.actor.router_replay.mode": Alias("actor.router_replay", _router_replay,
                                                        "disabled -> off, R2 -> r2, R3 -> r3"),
    "actor_rollout_ref.model.override_config.attention_dropout": Alias(
        None, _zero("no dropout in RL training here"), "0 only: no dropout here"),
    "actor_rollout_ref.model.override_config.embd_pdrop": Alias(None, _zero("no dropout in RL training here"),
                                                                "0 only: no dropout here"),
    "actor_rollout_ref.model.override_config.resid_pdrop": Alias(None, _zero("no dropout in RL training here"),
                                                                 "0 only: no dropout here"),
    # actor: optimiser and update
    "actor_rollout_ref.actor.optim.lr": Alias("actor.lr"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": Alias("actor.lr_warmup_steps"),
    "actor_rollout_ref.actor.optim.weight_decay": Alias("actor.weight_decay"),
    "actor_rollout_ref.actor.grad_clip": Alias("actor.clip_grad"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": Alias("actor.ppo_mini_batch_size"),
    "actor_rollout_ref.actor.ppo_epochs": Alias("actor.ppo_epochs"),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": Alias("actor.max_tokens_per_microbatch"),
    "actor_rollout_ref.actor.use_dynamic_bsz": Alias(None, _is(True, _PACKED), _PACKED),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": Alias(None, _is(True, _PACKED), _PACKED),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": Alias(None, _is(True, _PACKED), _PACKED),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": Alias(None, note=_TOKEN_MICRO),
    "actor_rollout_ref.actor.ppo_micro_batch_size": Alias(None, note=_TOKEN_MICRO),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": Alias(None, note=_TOKEN_MICRO),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": Alias(None, note=_TOKEN_MICRO),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": Alias(
        None, _zero("the warm-up is counted in steps here: set actor.lr_warmup_steps (the ratio x "
                    "trainer.total_training_steps)"), "0 only: set actor.lr_warmup_steps"),
    "actor_rollout_ref.actor.megatron.optimizer_offload": Alias("actor.offload_optimizer"),
    "actor_rollout_ref.actor.megatron.param_offload": Alias(
        None, note="the actor's weights stay in GPU memory; colocated servers release theirs while the actor trains "
        "(actor.offload_optimizer moves the optimizer state)"),
    "actor_rollout_ref.actor.megatron.grad_offload": Alias(
        None, note="gradients live only inside a step here; nothing to offload between steps"),
    "actor_rollout_ref.ref.megatron.param_offload": Alias(
        None, note="the reference's weights stay in GPU memory (its passes run at the actor's layout)"),
    "actor_rollout_ref.actor.checkpoint.save_contents": Alias(
        None, note="a checkpoint always holds the model, the optimizer, the RNG and the data position"),
    "actor_rollout_ref.actor.checkpoint.load_contents": Alias(
        None, note="a checkpoint always holds the model, the optimizer, the RNG and the data position"),
    "actor_rollout_ref.hybrid_engine": Alias(
        None, _is(True, "the actor and the rollout always share one set of weights: rollout.mode=colocate shares the "
                    "GPUs too, disaggregate runs the servers on GPUs of their own"),
        "true only: rollout.mode picks colocated or disaggregated servers"),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": Alias(
        None, note="the reference and old-log-prob passes use actor.max_tokens_per_microbatch"),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": Alias(
        None, note="the reference and old-log-prob passes use actor.max_tokens_per_microbatch"),
    # actor: the loss
    "actor_rollout_ref.actor.clip_ratio_low": Alias("actor.clip_ratio_low"),
    "actor_rollout_ref.actor.clip_ratio_high": Alias("actor.clip_ratio_high"),
    "actor_rollout_ref.actor.clip_ratio_c": Alias("actor.clip_ratio_c"),
    "actor_rollout_ref.actor.loss_agg_mode": Alias("actor.loss_agg_mode"),
    "actor_rollout_ref.actor.use_token_level_loss": Alias(
        "actor.loss_agg_mode", lambda v: "token-mean" if v else "seq-mean-token-mean",
        "older DAPO scripts: true -> token-mean, false -> seq-mean-token-mean"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": Alias("actor.policy_loss"),
    "actor_rollout_ref.actor.entropy_coeff": Alias("actor.entropy_coeff"),
    "actor_rollout_ref.actor.kl_loss_coef": Alias("actor.kl_loss_coef"),
    "actor_rollout_ref.actor.kl_loss_type": Alias("actor.kl_loss_type"),
    "actor_rollout_ref.actor.use_kl_loss": Alias(
        "actor.use_kl_loss", note="the KL loss term (and the reference model it needs) is on exactly when this is "
        "true, with actor.kl_loss_coef as its weight, as in verl"),
    # parallelism (verl's Megatron backend names; FSDP ones have no effect)
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": Alias("parallel.tensor_model_parallel_size"),
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": Alias("parallel.pipeline_model_parallel_size"),
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size": Alias(
        "parallel.virtual_pipeline_model_parallel_size"),
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": Alias("parallel.expert_model_parallel_size"),
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size": Alias("parallel.expert_tensor_parallel_size"),
    "actor_rollout_ref.actor.megatron.context_parallel_size": Alias("parallel.context_parallel_size"),
    "actor_rollout_ref.actor.megatron.sequence_parallel": Alias("parallel.sequence_parallel"),
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer": Alias("actor.use_distributed_optimizer"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": Alias(None, _equal(1, _ULYSSES), "1 only: " + _ULYSSES),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": Alias(
        None, _equal(1, "Ulysses sequence parallelism is FSDP's: the reference runs at the actor's layout "
                        "(parallel.*)"), "1 only: the reference runs at the actor's layout"),
    # rollout
    "actor_rollout_ref.rollout.name": Alias("rollout.engine", _engine, "sglang only (no vLLM here)"),
    "actor_rollout_ref.rollout.n": Alias("rollout.n"),
    "actor_rollout_ref.rollout.temperature": Alias("rollout.temperature"),
    "actor_rollout_ref.rollout.top_p": Alias("rollout.top_p"),
    "actor_rollout_ref.rollout.top_k": Alias("rollout.top_k"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": Alias("rollout.tensor_model_parallel_size"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": Alias("rollout.gpu_memory_utilization"),
    "actor_rollout_ref.rollout.max_num_seqs": Alias("rollout.max_num_seqs"),
    "actor_rollout_ref.rollout.enable_chunked_prefill": Alias(
        None, note="SGLang chunks prefills by itself (tune with rollout.server_extra_args)"),
    "actor_rollout_ref.rollout.max_num_batched_tokens": Alias(
        None, note="vLLM's; SGLang sizes its batches itself (rollout.server_extra_args for its flags)"),
    "actor_rollout_ref.rollout.mode": Alias(None, note="the SGLang servers are always driven asynchronously"),
    "actor_rollout_ref.rollout.free_cache_engine": Alias(
        None, note="colocated servers always release their KV cache and weights while the actor trains"),
    "actor_rollout_ref.rollout.calculate_log_probs": Alias(
        None, note="the servers always return each token's log-prob (rollout correction, bypass mode)"),
    "actor_rollout_ref.rollout.val_kwargs.n": Alias("rollout.val_kwargs.n", note="the same mean@n / pass@n"),
    "actor_rollout_ref.rollout.val_kwargs.temperature": Alias("rollout.val_kwargs.temperature"),
    "actor_rollout_ref.rollout.val_kwargs.top_p": Alias("rollout.val_kwargs.top_p"),
    "actor_rollout_ref.rollout.val_kwargs.top_k": Alias("rollout.val_kwargs.top_k"),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": Alias(None, _do_sample,
                                                             "true only (greedy: rollout.val_kwargs.temperature=0)"),
    # reward
    "reward_model.reward_manager": Alias(None, _reward_manager,
                                         "dapo / naive (reward.function=auto scores with math_dapo)"),
    "reward_model.overlong_buffer.enable": Alias("reward.overlong_buffer.enable"),
    "reward_model.overlong_buffer.len": Alias("reward.overlong_buffer.len"),
    "reward_model.overlong_buffer.penalty_factor": Alias("reward.overlong_buffer.penalty_factor"),
    "reward_model.overlong_buffer.log": Alias("reward.overlong_buffer.log"),
    "custom_reward_function.overlong_buffer.enable": Alias("reward.overlong_buffer.enable", note="older DAPO scripts"),
    "custom_reward_function.overlong_buffer.len": Alias("reward.overlong_buffer.len", note="older DAPO scripts"),
    "custom_reward_function.overlong_buffer.penalty_factor": Alias("reward.overlong_buffer.penalty_factor",
                                                                   note="older DAPO scripts"),
    "custom_reward_function.path": Alias("reward.custom_function.path"),
    "custom_reward_function.name": Alias("reward.custom_function.name"),
    # algorithm: verl's own names are ours (algorithm.adv_estimator, algorithm.filter_groups.*, ...)
    "algorithm.rollout_correction": Alias("algorithm.rollout_correction.preset"),
    # trainer: verl's own names are ours (trainer.nnodes, trainer.save_freq, trainer.logger, ...)
    "trainer.log_val_generations": Alias(None, note="validation responses go to trainer.rollout_data_dir"),
    "trainer.max_actor_ckpt_to_keep": Alias("trainer.max_ckpt_to_keep"),
    "trainer.max_critic_ckpt_to_keep": Alias(None, note="the critic's state is in the same checkpoint"),
    "trainer.default_hdfs_dir": Alias(None, _is(None, "no HDFS copy here: checkpoints stay in trainer.default_local_dir"),
                                      "null only: checkpoints stay in trainer.default_local_dir"),
    "trainer.val_only": Alias(None, _is(False, "validation alone is `python -m megatron_dapo.eval` (make eval) on a "
                                           "checkpoint"), "false only: make eval validates a checkpoint"),
    "trainer.resume_from_path": Alias("trainer.resume_mode", _resume_path,
                                      "a checkpoint path is trainer.resume_mode=<path>; null has no effect",
                                      last=True),
}

# verl keys under these prefixes have no effect here (FSDP's sharding, offload and wrapping).
PREFIXES: dict[str, Alias] = {
    "actor_rollout_ref.actor.fsdp_config.": Alias(None, note=_NO_FSDP),
    "actor_rollout_ref.ref.fsdp_config.": Alias(None, note=_NO_FSDP),
}


def lookup(key: str) -> Alias | None:
    """The alias of verl key `key` (a leading Hydra '+' or '++' ignored), or None when it is not one."""
    key = key.lstrip("+")
    if key in ALIASES:
        return ALIASES[key]
    return next((alias for prefix, alias in PREFIXES.items() if key.startswith(prefix)), None)


def translate(key: str, value) -> tuple[str, Any, bool] | None:
    """(our key, our value, last) for verl key `key`; None when it has no effect here. Raises ConfigError
    naming the verl key and the reason when its value cannot be honoured."""
    alias = lookup(key)
    if alias is None:
        raise KeyError(key)
    try:
        converted = alias.convert(value) if alias.convert is not None else value
    except ValueError as e:
        raise ConfigError(key.lstrip("+"), f"verl key not supported with value {value!r}: {e}") from None
    if alias.key is None or converted is None:
        return None
    return alias.key, converted, alias.last


def implied(key: str, value) -> list[tuple[str, Any]]:
    """(our key, value) pairs verl key `key` given `value` implies (Alias.implies)."""
    alias = lookup(key)
    if alias is None:
        return []
    return [(k, v(value) if callable(v) else v) for k, v in alias.implies]


def no_effect_reason(key: str) -> str:
    """Why verl key `key` (one `translate` dropped) has no effect here: its documented note."""
    alias = lookup(key)
    return alias.note if alias is not None and alias.note else "no counterpart here"


def table() -> str:
    """The markdown table of docs/migrating-from-verl.md."""
    lines = ["| verl key | here | note |", "|---|---|---|"]
    for key, alias in sorted(ALIASES.items()) + sorted((p + "*", a) for p, a in PREFIXES.items()):
        here = f"`{alias.key}`" if alias.key else "no effect"
        lines.append(f"| `{key}` | {here} | {alias.note} |")
    return "\n".join(lines)
