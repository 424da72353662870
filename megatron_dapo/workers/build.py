"""Build the actor and the reference from the typed config: model, then DDP, then optimizer.

STYLE.md rule 9: small ordered functions; the CPU and GPU paths differ only in the layer spec
(chosen by `models.builder`) and in defaults resolved here (distributed optimizer on CUDA).
"""

from __future__ import annotations

import torch

from megatron_dapo.algos.policy_loss import get_policy_loss_fn
from megatron_dapo.config import Config, ConfigError
from megatron_dapo.models.arch import ModelArch
from megatron_dapo.models.config_arch import model_arch
from megatron_dapo.models.forward import unwrap_model
from megatron_dapo.workers.actor import Actor, PolicyModel

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _config_overrides(cfg: Config, arch: ModelArch, pgs) -> dict:
    from megatron_dapo.models.builder import default_backend
    from megatron_dapo.models.fusions import FUSIONS, resolve_fusions

    out = {"mtp_loss_scaling_factor": cfg.actor.mtp_loss_scaling_factor}
    # Trained through Megatron DDP (main_grad), so gradient_accumulation_fusion may be on too.
    out.update(resolve_fusions(default_backend(pgs.device), arch=arch, main_grad=True, device_type=pgs.device.type,
                               **{name: getattr(cfg.model, name) for name in FUSIONS}))
    if cfg.actor.router_replay != "off":
        if not arch.num_moe_experts:
            raise ConfigError("actor.router_replay", f"is {cfg.actor.router_replay!r} but model {arch.name!r} has "
                              "no MoE layers: set it to off")
        out["moe_enable_routing_replay"] = True
    if cfg.parallel.pipeline_model_parallel_size > 1:
        # p2p shapes differ per micro-batch (token-budget packing), except with virtual stages: there every
        # micro-batch of a pass has one shape (policy.py, pad_microbatch) and the schedule sends that fixed
        # [seq_length, micro_batch_size] shape. Megatron 0.16's shape exchange in the interleaved schedule's
        # send_forward_backward_recv_forward_backward crosses or hangs at PP = 2 (Megatron-LM #5100, #5271:
        # a 2-rank PP2 x VPP2 run deadlocked in _communicate_shapes), so it stays off there.
        out["variable_seq_lengths"] = (cfg.parallel.virtual_pipeline_model_parallel_size or 1) == 1
    if cfg.model.recompute != "none":
        out.update(recompute_granularity=cfg.model.recompute,
                   **({"recompute_method": "uniform", "recompute_num_layers": 1} if cfg.model.recompute == "full" else {}))
    return out


def build_model_chunks(cfg: Config, arch: ModelArch, pgs, *, seed: int) -> list:
    from megatron_dapo.models.builder import build_gpt_model_chunks

    chunks = build_gpt_model_chunks(arch, pgs=pgs, seed=seed, params_dtype=_DTYPES[cfg.model.params_dtype],
                                    sequence_parallel=cfg.parallel.sequence_parallel,
                                    config_overrides=_config_overrides(cfg, arch, pgs))
    if cfg.model.hf_path:
        from megatron_dapo.models.hf import load_hf_weights_into

        load_hf_weights_into(chunks, cfg.model.hf_path, arch=arch, pgs=pgs, keep_mtp_init=True)  # fresh MTP, logged
    if cfg.actor.mtp_detach_trunk:
        for chunk in chunks:
            _detach_mtp_input(chunk)
    return chunks


def _detach_mtp_input(model) -> None:
    """The first MTP layer reads the trunk's final hidden states through a detach. (Megatron's MTP block
    returns the trunk's chunk itself too, so the detach must sit on the layer's input, not the block's.)"""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return

    def detach_hidden(module, args, kwargs):
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"].detach()}

    mtp.layers[0].register_forward_pre_hook(detach_hidden, with_kwargs=True)


def use_distributed_optimizer(cfg: Config, pgs) -> bool:
    flag = cfg.actor.use_distributed_optimizer
    return (pgs.device.type == "cuda") if flag is None else flag


def build_actor(cfg: Config, pgs, *, vocab_size: int, pad_id: int) -> Actor:
    """Model -> DDP -> Megatron optimizer -> LR schedule -> Actor."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    arch = model_arch(cfg, vocab_size=vocab_size)
    chunks = build_model_chunks(cfg, arch, pgs, seed=cfg.trainer.seed)
    dist_opt = use_distributed_optimizer(cfg, pgs)
    tf_config = chunks[0].config
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt)
    chunks = [DistributedDataParallel(config=tf_config, ddp_config=ddp_cfg, module=c,
                                      disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    a = cfg.actor
    opt_cfg = OptimizerConfig(optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay,
                              adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2, adam_eps=a.adam_eps,
                              clip_grad=a.clip_grad, bf16=cfg.model.params_dtype == "bf16",
                              params_dtype=_DTYPES[cfg.model.params_dtype], use_distributed_optimizer=dist_opt)
    optimizer = get_megatron_optimizer(opt_cfg, chunks)
    for c in chunks:
        c.config.finalize_model_grads_func = finalize_model_grads
        c.config.grad_scale_func = optimizer.scale_loss
    # The schedule counts training steps, as verl's does: every mini-batch of step k runs at the same
    # lr, warm-up over actor.lr_warmup_steps steps, decay over trainer.total_training_steps. The actor
    # advances it at the start of each step, so step 1 already trains at lr * 1/warmup (not at 0).
    steps = cfg.trainer.total_training_steps
    warmup = min(a.lr_warmup_steps, max(steps - 1, 0))
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else a.lr, max_lr=a.lr, min_lr=a.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(steps, warmup + 1), lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay,
        end_wd=a.weight_decay, wd_incr_steps=max(steps, 1), wd_incr_style="constant")
    policy = _policy_model(cfg, chunks, pgs, pad_id=pad_id, vocab_size=arch.vocab_size,
                           router_replay=a.router_replay)
    name = _loss_name(cfg)
    loss_fn = _fused_vanilla_loss if use_fused_kernels(cfg, pgs) and name == "vanilla" else get_policy_loss_fn(name)
    actor = Actor(policy, optimizer=optimizer, scheduler=scheduler, cfg=a, loss_fn=loss_fn, n=cfg.rollout.n,
                  balance_batch=cfg.trainer.balance_batch, bypass_correction=_bypass_correction(cfg))
    if a.offload_optimizer:
        from megatron_dapo.workers.memory import OptimizerOffload

        actor.offload = OptimizerOffload(optimizer, masters=cfg.model.params_dtype == "bf16")
    return actor


def _policy_model(cfg: Config, chunks: list, pgs, *, pad_id: int, vocab_size: int, router_replay: str) -> PolicyModel:
    """The policy over `chunks`, laid out as the update lays out its mini-batches (so compute_log_prob
    runs the update's own micro-batches), thd-packed where the layer spec is Transformer Engine's."""
    from megatron_dapo.models.builder import default_backend

    return PolicyModel(chunks, pgs=pgs, pad_id=pad_id, temperature=cfg.rollout.temperature,
                       max_tokens=cfg.actor.max_tokens_per_microbatch, vocab_size=vocab_size,
                       minibatch_rows=cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                       balance_rows=cfg.trainer.balance_batch,
                       packed_sequences=default_backend(pgs.device) == "te", router_replay=router_replay)


def use_fused_kernels(cfg: Config, pgs) -> bool:
    """The fused clipped-loss kernel (log-probs always come from kernels.fused_logprob_stats)."""
    flag = cfg.actor.use_fused_kernels
    return (pgs.device.type == "cuda") if flag is None else flag


def _fused_vanilla_loss(*, old_log_prob, log_prob, advantages, response_mask, **kwargs):
    """The "vanilla" loss through the fused clipped-loss kernel (same value and gradient)."""
    from megatron_dapo.kernels import fused_clipped_token_loss

    return fused_clipped_token_loss(log_prob, old_log_prob, advantages, response_mask, **kwargs)


def _bypass_correction(cfg: Config) -> dict | None:
    from megatron_dapo.config import resolve_rollout_correction

    rc = resolve_rollout_correction(cfg)
    if not rc["bypass_mode"] or not (rc["rollout_is"] or rc["rollout_rs"]):
        return None
    return {k: rc[k] for k in ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold")}


def _loss_name(cfg: Config) -> str:
    """Bypass mode with loss_type=reinforce (the bypass_pg_is preset) swaps the loss registry entry."""
    from megatron_dapo.config import resolve_rollout_correction

    rc = resolve_rollout_correction(cfg)
    if rc["bypass_mode"] and rc["loss_type"] == "reinforce":
        return "reinforce"
    return cfg.actor.policy_loss


def build_reference(cfg: Config, pgs, *, vocab_size: int, pad_id: int, actor: Actor | None = None) -> PolicyModel:
    """A frozen copy of the initial policy for reference log-probs (built only when a KL term is used)."""
    arch = model_arch(cfg, vocab_size=vocab_size)
    chunks = build_model_chunks(cfg, arch, pgs, seed=cfg.trainer.seed)
    if actor is not None:  # start from exactly the actor's current weights
        for ref_chunk, act_chunk in zip(chunks, actor.policy.chunks):
            ref_chunk.load_state_dict(unwrap_model(act_chunk).state_dict())
    for c in chunks:
        c.requires_grad_(False)
        c.eval()
    return _policy_model(cfg, chunks, pgs, pad_id=pad_id, vocab_size=arch.vocab_size, router_replay="off")
