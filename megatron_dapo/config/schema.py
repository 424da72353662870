"""The one typed config tree: every default of megatron_dapo lives here and nowhere else.

YAML recipes (configs/*.yaml) hold only overrides; `loader.py` applies base -> recipe -> dotlist.
Each field has a docstring under it; a trailing `[recipe: ...]` names the key of the DAPO recipe
(verl's `recipe/dapo`) it corresponds to, and the docs/configuration.md table is generated from these docstrings
(`python -m megatron_dapo.config.docs`). The defaults are the embedded CPU run (a tiny Megatron model
on the synthetic arithmetic task) with the DAPO algorithm settings; the 32B recipes override sizes.

Each section validates itself in `__post_init__`; checks that span sections live in
`Config.__post_init__`. Errors are `ConfigError`s that name the key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from megatron_dapo.config.errors import ConfigError, report


def _check(cond: bool, key: str, expected: str, value) -> None:
    if not cond:
        report(ConfigError(key, f"expected {expected}, got {value!r}"))


@dataclass
class ArithmeticConfig:
    num_train: int = 2000
    """Number of training problems of the synthetic arithmetic task."""
    num_val: int = 128
    """Number of held-out validation problems (disjoint from training)."""
    min_digits: int = 1
    """Fewest digits per operand."""
    max_digits: int = 2
    """Most digits per operand."""
    operators: str = "+-"
    """Operators to draw from, a subset of "+-*"."""
    seed: int = 1234
    """Seed of the problem generator (train/val split included)."""

    def __post_init__(self):
        _check(self.num_train >= 1, "data.arithmetic.num_train", ">= 1", self.num_train)
        _check(self.num_val >= 1, "data.arithmetic.num_val", ">= 1", self.num_val)
        _check(1 <= self.min_digits <= self.max_digits, "data.arithmetic.min_digits",
               "1 <= min_digits <= max_digits", (self.min_digits, self.max_digits))
        _check(bool(self.operators) and set(self.operators) <= set("+-*"), "data.arithmetic.operators",
               'a non-empty subset of "+-*"', self.operators)


@dataclass
class DataConfig:
    task: Literal["arithmetic", "files"] = "arithmetic"
    """Where prompts come from: the built-in synthetic arithmetic task, or parquet/jsonl files."""
    train_files: str = ""
    """Training prompts (DAPO-Math-17k layout), parquet or jsonl; needed when task=files. [recipe: data.train_files]"""
    val_files: str = ""
    """Validation prompts (AIME-2024 layout); needed when task=files and trainer.test_freq > 0. [recipe: data.val_files]"""
    tokenizer: str = ""
    """HF tokenizer directory; empty means the built-in character tokenizer of the synthetic task."""
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template."""
    max_prompt_length: int = 16
    """Longest prompt in tokens. [recipe: data.max_prompt_length]"""
    max_response_length: int = 12
    """Longest response in tokens (the generation limit). [recipe: data.max_response_length]"""
    train_batch_size: int = 16
    """Prompts per training step (after dynamic sampling). [recipe: data.train_batch_size]"""
    gen_batch_size: int | None = None
    """Prompts per generation batch; None means train_batch_size. [recipe: data.gen_batch_size]"""
    shuffle: bool = True
    """Shuffle prompts every epoch (seeded, resumable). [recipe: data.shuffle]"""
    seed: int = 1
    """Seed of the prompt sampler. [recipe: data.seed]"""
    prompt_overflow: Literal["filter", "error"] = "filter"
    """Prompts longer than max_prompt_length: drop them (counted) or raise naming the row. [recipe: data.filter_overlong_prompts]"""
    on_bad_row: Literal["raise", "skip"] = "raise"
    """A malformed data row: raise naming file, row and field, or skip and count it."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """The synthetic arithmetic task (task=arithmetic)."""

    def __post_init__(self):
        _check(self.max_prompt_length >= 1, "data.max_prompt_length", ">= 1", self.max_prompt_length)
        _check(self.max_response_length >= 1, "data.max_response_length", ">= 1", self.max_response_length)
        _check(self.train_batch_size >= 1, "data.train_batch_size", ">= 1", self.train_batch_size)
        if self.gen_batch_size is not None:
            _check(self.gen_batch_size >= 1, "data.gen_batch_size", ">= 1 or null", self.gen_batch_size)
        if self.task == "files":
            _check(bool(self.train_files), "data.train_files", "a parquet/jsonl path when data.task=files",
                   self.train_files)

    @property
    def effective_gen_batch_size(self) -> int:
        return self.gen_batch_size if self.gen_batch_size is not None else self.train_batch_size


@dataclass
class ModelConfig:
    arch: str = "tiny"
    """Architecture: tiny, tiny_moe, qwen2.5-32b, qwen3-30b-a3b, or hf (read from hf_path/config.json)."""
    hf_path: str = ""
    """HF checkpoint directory to initialise the actor (and reference) from; empty trains from scratch. [recipe: actor_rollout_ref.model.path]"""
    params_dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter and compute dtype of the actor and reference."""
    mtp_num_layers: int = 0
    """Multi-token-prediction layers (0 = none); they train the speculative-decoding drafter."""
    num_layers: int | None = None
    """Override of the architecture's layer count (None keeps the architecture's)."""
    hidden_size: int | None = None
    """Override of the architecture's hidden size."""
    ffn_hidden_size: int | None = None
    """Override of the architecture's FFN size."""
    num_attention_heads: int | None = None
    """Override of the architecture's attention heads."""
    num_query_groups: int | None = None
    """Override of the architecture's KV heads (GQA groups)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation of the actor. [recipe: actor_rollout_ref.model.enable_gradient_checkpointing]"""
    gradient_accumulation_fusion: bool | None = None
    """Weight-gradient GEMMs accumulate straight into DDP's fp32 main_grad; None = on with Transformer Engine, off on the local spec (needs TE)."""
    apply_rope_fusion: bool | None = None
    """Fused RoPE kernel; None = on with Transformer Engine, off on the local spec (needs TE)."""
    bias_activation_fusion: bool | None = None
    """Fused (bias +) SwiGLU that keeps only its input for backward (saves ffn/TP activation elements per token and layer); None = on with TE, off on the local spec."""
    bias_dropout_fusion: bool | None = None
    """Fused bias + dropout + residual add; None = on with TE, off on the local spec."""
    masked_softmax_fusion: bool | None = None
    """Fused scale + mask + softmax of the local attention (TE's attention is fused anyway); None = on with TE, off on the local spec."""

    def __post_init__(self):
        _check(self.mtp_num_layers >= 0, "model.mtp_num_layers", ">= 0", self.mtp_num_layers)
        if self.arch == "hf":
            _check(bool(self.hf_path), "model.hf_path", "an HF checkpoint directory when model.arch=hf",
                   self.hf_path)
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups"):
            v = getattr(self, name)
            if v is not None:
                _check(v >= 1, f"model.{name}", ">= 1 or null", v)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor parallel size of the actor/reference. [recipe: actor_rollout_ref.actor.megatron.tensor_model_parallel_size]"""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size. [recipe: actor_rollout_ref.actor.megatron.pipeline_model_parallel_size]"""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved (virtual) pipeline stages per rank; None = no interleaving."""
    expert_model_parallel_size: int = 1
    """Expert parallel size for MoE layers. [recipe: actor_rollout_ref.actor.megatron.expert_model_parallel_size]"""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallel size inside experts; None = tensor_model_parallel_size."""
    context_parallel_size: int = 1
    """Context parallel size; only 1: context parallelism is not implemented (sequences are not split over CP ranks), a larger value is refused. [recipe: actor_rollout_ref.actor.megatron.context_parallel_size]"""
    sequence_parallel: bool | None = None
    """Sequence parallelism with TP; None = on whenever TP > 1 (Megatron requires it for MoE with TP > 1)."""

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size", "context_parallel_size"):
            _check(getattr(self, name) >= 1, f"parallel.{name}", ">= 1", getattr(self, name))
        _check(self.context_parallel_size == 1, "parallel.context_parallel_size",
               "1 (context parallelism is not implemented: sequences would not be split over CP ranks, "
               "giving wrong log-probs and gradients)", self.context_parallel_size)
        if self.virtual_pipeline_model_parallel_size is not None:
            _check(self.pipeline_model_parallel_size > 1, "parallel.virtual_pipeline_model_parallel_size",
                   "null unless pipeline_model_parallel_size > 1", self.virtual_pipeline_model_parallel_size)

    def check_world_size(self, world_size: int) -> None:
        """TP x PP x CP must divide the world; EP x ETP must divide it as well."""
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        if world_size % (tp * pp * cp):
            raise ConfigError("parallel.tensor_model_parallel_size",
                              f"TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp} must divide the world size {world_size}")
        etp = self.expert_tensor_parallel_size or tp
        ep = self.expert_model_parallel_size
        if world_size % (ep * etp * pp):
            raise ConfigError("parallel.expert_model_parallel_size",
                              f"EP*ETP*PP = {ep}*{etp}*{pp} must divide the world size {world_size}")


@dataclass
class ActorConfig:
    lr: float = 1e-6
    """Peak learning rate. [recipe: actor_rollout_ref.actor.optim.lr]"""
    lr_warmup_steps: int = 10
    """Linear warm-up steps of the learning rate. [recipe: actor_rollout_ref.actor.optim.lr_warmup_steps]"""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, over trainer.total_training_steps."""
    min_lr: float = 0.0
    """Floor of the decayed learning rate."""
    weight_decay: float = 0.1
    """AdamW weight decay. [recipe: actor_rollout_ref.actor.optim.weight_decay]"""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Gradient clipping by global norm (0 disables). [recipe: actor_rollout_ref.actor.grad_clip]"""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step (each with rollout.n responses). [recipe: actor_rollout_ref.actor.ppo_mini_batch_size]"""
    ppo_epochs: int = 1
    """Passes over each training batch. [recipe: actor_rollout_ref.actor.ppo_epochs]"""
    max_tokens_per_microbatch: int = 4096
    """Token budget of one packed micro-batch (prompt + response tokens). [recipe: actor_rollout_ref.actor.ppo_max_token_len_per_gpu]"""
    clip_ratio_low: float = 0.2
    """Lower clip epsilon: ratio >= 1 - clip_ratio_low. [recipe: actor_rollout_ref.actor.clip_ratio_low]"""
    clip_ratio_high: float = 0.28
    """Upper clip epsilon (clip-higher): ratio <= 1 + clip_ratio_high. [recipe: actor_rollout_ref.actor.clip_ratio_high]"""
    clip_ratio_c: float = 10.0
    """Dual-clip bound for A < 0; must be > 1. [recipe: actor_rollout_ref.actor.clip_ratio_c]"""
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    """How the per-token loss becomes a scalar; token-mean is DAPO's token-level loss. [recipe: actor_rollout_ref.actor.loss_agg_mode]"""
    policy_loss: str = "vanilla"
    """Policy-loss registry entry: vanilla (clipped PPO with dual clip), reinforce, gspo (PPO clip on the length-normalised sequence ratio; GSPO uses clip_ratio_low/high 3e-4/4e-4 and loss_agg_mode seq-mean-token-mean), cispo (REINFORCE weighted by the clipped, gradient-stopped ratio). gspo and cispo take their clip band from clip_ratio_low/high, as in verl; neither has a dual clip. [recipe: actor_rollout_ref.actor.policy_loss.loss_mode]"""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (0 = off, as in DAPO). [recipe: actor_rollout_ref.actor.entropy_coeff]"""
    use_kl_loss: bool = False
    """Add a KL(actor || reference) term to the loss (off in DAPO). [recipe: actor_rollout_ref.actor.use_kl_loss]"""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss term. [recipe: actor_rollout_ref.actor.kl_loss_coef]"""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss term (kl, abs, mse, low_var_kl, k1, k2, k3, with optional +). [recipe: actor_rollout_ref.actor.kl_loss_type]"""
    use_fused_kernels: bool | None = None
    """The fused clipped-loss kernel (Triton on CUDA, chunked torch on CPU); None = on for CUDA. Log-probs, entropy and sum p^2 always come from the fused log-prob kernel, at real response tokens only. [recipe: actor_rollout_ref.model.use_fused_kernels]"""
    use_distributed_optimizer: bool | None = None
    """Megatron's distributed optimizer (ZeRO-1); None = on for CUDA, off on CPU."""
    offload_optimizer: bool = False
    """Colocated SGLang: move the optimizer state (Adam moments, fp32 master copy) to host memory while the servers run, and back before the update; the servers' KV pool grows by up to that much (not beyond what SGLang sizes at launch; python -m megatron_dapo.plan shows both), and each step pays two copies of it between GPU and host."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP loss when the model has MTP layers."""
    router_replay: Literal["off", "r2", "r3"] | bool = "off"
    """MoE routing replay: the update routes every token to the experts the behaviour policy chose. `r2`: the old_log_prob pass records each token's top-k experts per MoE layer and the update's forwards replay them; `r3`: the experts SGLang routed each token to during rollout (rollout.engine=sglang; the servers are asked for them and launched with the release's flag), sent to the ranks that train each row and replayed in the old_log_prob, reference and update passes. Any TP / PP / VPP / EP layout, with or without model.recompute. Logs router_replay/engaged_layers and router_replay/mismatch_frac; a step where a MoE layer did not take the replayed routing is an error. true = r2, false = off. [recipe: actor_rollout_ref.actor.router_replay.mode]"""
    mtp_detach_trunk: bool = False
    """Train the MTP layers on a detached copy of the trunk's hidden states: the drafter follows the policy and the MTP loss does not reach the decoder layers."""
    old_log_prob_from_update: bool = True
    """When the update is one optimizer step on the whole batch (ppo_epochs=1, ppo_mini_batch_size=data.train_batch_size) of a dense model, with no rollout correction, no KL in the reward and no router replay: take old_log_prob from the update's own forward (detached) instead of a separate pass. Same weights, same values: the ratio is 1 and the gradient unchanged, one forward per step saved; the first-step invariant and variance-proxy metrics come from that forward. False: always a separate old_log_prob pass."""

    def __post_init__(self):
        _check(self.lr > 0, "actor.lr", "> 0", self.lr)
        _check(self.lr_warmup_steps >= 0, "actor.lr_warmup_steps", ">= 0", self.lr_warmup_steps)
        _check(0 <= self.min_lr <= self.lr, "actor.min_lr", "0 <= min_lr <= lr", self.min_lr)
        _check(self.clip_grad >= 0, "actor.clip_grad", ">= 0", self.clip_grad)
        _check(self.ppo_mini_batch_size >= 1, "actor.ppo_mini_batch_size", ">= 1", self.ppo_mini_batch_size)
        _check(self.ppo_epochs >= 1, "actor.ppo_epochs", ">= 1", self.ppo_epochs)
        _check(self.max_tokens_per_microbatch >= 1, "actor.max_tokens_per_microbatch", ">= 1",
               self.max_tokens_per_microbatch)
        _check(0 <= self.clip_ratio_low < 1, "actor.clip_ratio_low", "in [0, 1)", self.clip_ratio_low)
        _check(self.clip_ratio_high >= 0, "actor.clip_ratio_high", ">= 0", self.clip_ratio_high)
        _check(self.clip_ratio_c > 1, "actor.clip_ratio_c", "> 1 (dual-clip bound)", self.clip_ratio_c)
        _check(self.entropy_coeff >= 0, "actor.entropy_coeff", ">= 0", self.entropy_coeff)
        _check(self.kl_loss_coef >= 0, "actor.kl_loss_coef", ">= 0", self.kl_loss_coef)
        _check(self.mtp_loss_scaling_factor >= 0, "actor.mtp_loss_scaling_factor", ">= 0",
               self.mtp_loss_scaling_factor)
        if isinstance(self.router_replay, bool):  # the key was a switch before the modes: true meant R2
            self.router_replay = "r2" if self.router_replay else "off"


@dataclass
class ValKwargs:
    n: int = 1
    """Samples per validation prompt (mean@n and pass@n). [recipe: actor_rollout_ref.rollout.val_kwargs.n]"""
    temperature: float = 1.0
    """Validation sampling temperature (0 = greedy). [recipe: actor_rollout_ref.rollout.val_kwargs.temperature]"""
    top_p: float = 0.7
    """Validation nucleus sampling. [recipe: actor_rollout_ref.rollout.val_kwargs.top_p]"""
    top_k: int = -1
    """Validation top-k (-1 = off). [recipe: actor_rollout_ref.rollout.val_kwargs.top_k]"""

    def __post_init__(self):
        _check(self.n >= 1, "rollout.val_kwargs.n", ">= 1", self.n)
        _check(self.temperature >= 0, "rollout.val_kwargs.temperature", ">= 0", self.temperature)
        _check(0 < self.top_p <= 1, "rollout.val_kwargs.top_p", "in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 1, "rollout.val_kwargs.top_k", "-1 or >= 1", self.top_k)


@dataclass
class MismatchAlarmConfig:
    token_mult_prob_error: float = 1.05
    """Alarm when the step's rollout_corr/token_mult_prob_error (mean exp|log p_actor - log p_engine| over response tokens) exceeds this (NeMo-RL's nightly gate)."""
    mismatch_kl: float = 0.015
    """Alarm when the step's rollout_corr/mismatch_kl (k3 estimate of KL(engine || actor) over response tokens) exceeds this (prime-rl's bound)."""
    stop_after: int = 0
    """Consecutive alarmed steps that stop the run with MismatchAlarmError; 0 = warn only."""

    def __post_init__(self):
        _check(self.token_mult_prob_error >= 1.0, "rollout.mismatch_alarm.token_mult_prob_error", ">= 1",
               self.token_mult_prob_error)
        _check(self.mismatch_kl >= 0.0, "rollout.mismatch_alarm.mismatch_kl", ">= 0", self.mismatch_kl)
        _check(self.stop_after >= 0, "rollout.mismatch_alarm.stop_after", ">= 0 (0 = warn only)", self.stop_after)


@dataclass
class SpeculativeConfig:
    algorithm: Literal["EAGLE", "NEXTN"] | None = None
    """SGLang speculative decoding with the model's MTP layer as the drafter (needs model.mtp_num_layers=1 and a model SGLang has an MTP drafter for: Qwen3-MoE, SGLang >= 0.5.13); every weight sync sends the MTP layer under the drafter's names (weight_transport=distributed needs SGLang >= 0.5.21). None = off."""
    num_steps: int = 3
    """Draft steps per verification (--speculative-num-steps)."""
    eagle_topk: int = 1
    """Draft branching (--speculative-eagle-topk)."""
    num_draft_tokens: int = 4
    """Draft tokens per verification (--speculative-num-draft-tokens)."""
    auto: bool = False
    """Measure rollout tokens/s with speculation (auto_steps steps from auto_start_step), then without (the servers this trainer launched are relaunched without it), and keep the faster (relaunching with speculation if it wins); logs both under spec_decode/auto/. SGLang cannot switch speculation on a running server; costs one relaunch (two when speculation wins)."""
    auto_steps: int = 1
    """Steps measured in each mode by auto."""
    auto_start_step: int = 1
    """First step auto measures; before it the servers run with speculation (set it past the first steps when the drafter starts fresh: a checkpoint without MTP weights)."""

    def __post_init__(self):
        for name in ("num_steps", "eagle_topk", "num_draft_tokens", "auto_steps", "auto_start_step"):
            _check(getattr(self, name) >= 1, f"rollout.speculative.{name}", ">= 1", getattr(self, name))
        if self.auto and self.algorithm is None:
            raise ConfigError("rollout.speculative.auto", "needs rollout.speculative.algorithm (EAGLE or NEXTN): "
                              "it compares rollout with and without that speculation")


@dataclass
class RolloutConfig:
    engine: Literal["local", "sglang"] = "local"
    """local = the actor's Megatron model samples with a KV cache; sglang = SGLang servers. [recipe: actor_rollout_ref.rollout.name]"""
    n: int = 8
    """Responses per prompt (the GRPO group size). [recipe: actor_rollout_ref.rollout.n]"""
    temperature: float = 1.0
    """Sampling temperature; log-probs are computed at this temperature. [recipe: actor_rollout_ref.rollout.temperature]"""
    top_p: float = 1.0
    """Nucleus sampling. [recipe: actor_rollout_ref.rollout.top_p]"""
    top_k: int = -1
    """Top-k sampling (-1 = off). [recipe: actor_rollout_ref.rollout.top_k]"""
    min_new_tokens: int = 0
    """Training rollouts: EOS (and any stop token) cannot be sampled before this many response tokens; 0 = off, at most data.max_response_length. Local engine: those logits are masked; SGLang: its sampling param min_new_tokens. Rollout log-probs stay those of the unmasked distribution (what the actor recomputes), as with top_k / top_p."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """Sampling for validation."""
    mismatch_alarm: MismatchAlarmConfig = field(default_factory=MismatchAlarmConfig)
    """Thresholds on the engine/actor log-prob mismatch of each step (trainer/mismatch.py)."""
    max_num_seqs: int = 256
    """engine=local: rows (prompt x sample) per forward; more rows, fewer forwards per generation. [recipe: actor_rollout_ref.rollout.max_num_seqs]"""
    tensor_model_parallel_size: int = 1
    """TP size of each SGLang engine. [recipe: actor_rollout_ref.rollout.tensor_model_parallel_size]"""
    gpu_memory_utilization: float = 0.85
    """SGLang --mem-fraction-static. [recipe: actor_rollout_ref.rollout.gpu_memory_utilization]"""
    mode: Literal["colocate", "disaggregate"] = "colocate"
    """colocate: engines share GPUs with training (weights from tensors, memory released while training); disaggregate: engines on GPUs of their own, weights over a process group, nothing released. With engine=sglang, disaggregate needs rollout.sglang_urls: start the servers on their own nodes and give their URLs (the servers this trainer launches take the trainer's own GPUs, where a weight-update group would hold two ranks on one GPU, which NCCL refuses). Launched servers with server_device=cpu are the one exception."""
    weight_sync_bucket_mb: float = 512
    """Bucket size of actor -> engine weight updates, MiB (whole parameters; a larger one travels alone)."""
    weight_transport: Literal["auto", "distributed", "ipc"] = "auto"
    """How SGLang servers get the weights: distributed = one weight-update process group per pipeline stage (NCCL; gloo on CPU), for servers on other GPUs or nodes; ipc = each node's first trainer rank posts CUDA IPC handles to the servers on its node (colocated: NCCL refuses two ranks on one GPU); auto = ipc for mode=colocate on CUDA, else distributed."""
    weight_sync_timeout_s: float = 600.0
    """Longest wait for the servers to join a weight-update group (and for one bucket to load, unless weight_sync_bucket_timeout_s is smaller)."""
    weight_sync_bucket_timeout_s: float = 120.0
    """Longest time one weight-sync bucket may take, from its first POST to the last server's reply, at most weight_sync_timeout_s. weight_transport=distributed: a server that dies mid-bucket leaves the broadcast incomplete for every member, so after this the senders abandon the group and every rank stops with the same WeightSyncError naming the servers that did not answer (the run resumes from its checkpoint) instead of waiting for the NCCL watchdog; ipc: a server that fails a bucket gets nothing more and leaves the rotation, the others are fed."""
    sglang_server_nodes: list[int] = field(default_factory=list)
    """Trainer node (torchrun node rank) each of rollout.sglang_urls runs on, for weight_transport=ipc; empty = found by matching each URL's host with the nodes' addresses (loopback: node 0)."""
    weight_sync_host: str = ""
    """Address the servers reach the trainer's weight senders at (their TCP stores); empty = loopback when every server is on loopback, else the interface that routes to the first server."""
    max_concurrency: int = 256
    """Most HTTP generation requests in flight per SGLang server. Besides, a request is sent only when its server decodes its sequences at once (the running capacity the server reports: --max-running-requests or what its KV pool admits); the rest of the batch waits in the client."""
    request_timeout_s: float = 1800.0
    """Timeout of one generation request (up to 16 sequences, or one group when streaming). Requests are sent only when the server admits them, so this bounds their own generation time, not a queue: size it for the longest response (max_response_length at the servers' slowest decode rate)."""
    max_retries: int = 3
    """Retries of a failed request (exponential backoff). A request whose server is lost (connection refused or dropped) is re-sent at once to another server without using a retry."""
    health_check_interval_s: float = 5.0
    """engine=sglang: how often rank 0 checks each server (/health, then its weight version). A server that refuses connections or fails 3 checks in a row leaves the rotation; its requests go to the others; it comes back when it answers with the weights the trainer last pushed (a restarted one after the next weight sync)."""
    server_down_timeout_s: float = 600.0
    """engine=sglang: how long generation or a weight sync waits with no server taking requests before the run stops with AllServersDown (on every rank, before the step's checkpoint)."""
    restart_servers: bool = True
    """engine=sglang: restart a server this trainer launched when it dies (same command, log appended); it rejoins at the first weight sync after it answers. Servers given by rollout.sglang_urls are polled, never restarted."""
    sglang_urls: list[str] = field(default_factory=list)
    """SGLang servers to use; empty = launch one per rollout.tensor_model_parallel_size GPUs: on the Ray cluster when RAY_ADDRESS is set (the SLURM launcher), else on this node."""
    server_host: str = "127.0.0.1"
    """Address SGLang servers bind to (loopback unless a cluster-internal address is given)."""
    server_base_port: int = 30000
    """First port of the SGLang servers."""
    sglang_python: str = ""
    """Python interpreter that runs the SGLang servers this trainer launches (`<it> -m sglang.launch_server`): a venv or image with SGLang; empty = the trainer's own Python."""
    server_device: str = ""
    """--device of the servers this trainer launches (cuda, cpu, ...); empty = SGLang's default (cuda)."""
    server_attention_backend: str = ""
    """--attention-backend of the servers this trainer launches (fa3, flashinfer, triton, torch_native, ...); empty = SGLang's choice for the device and model."""
    server_max_total_tokens: int | None = None
    """--max-total-tokens: the KV pool of each server this trainer launches, in tokens; null = colocated GPU servers get the memory planner's pool beside the trainer's steady state (python -m megatron_dapo.plan), others size it from rollout.gpu_memory_utilization (on CPU SGLang sizes it from the host's RAM: set it there)."""
    server_env: list[str] = field(default_factory=list)
    """KEY=VALUE environment settings of the servers this trainer launches (e.g. SGLANG_USE_CPU_ENGINE=1, which SGLang needs for server_device=cpu)."""
    server_extra_args: list[str] = field(default_factory=list)
    """Further sglang.launch_server flags of the servers this trainer launches, appended verbatim (e.g. --sleep-on-idle)."""
    require_memory_saver: bool = True
    """mode=colocate: refuse servers that run without --enable-memory-saver (they would keep their weights and KV cache in the accelerator memory the actor trains in), and launch with it; false when the servers do not share the trainer's accelerator memory (CPU servers)."""
    deterministic_inference: bool = False
    """engine=sglang: launch the servers with --enable-deterministic-inference, so they honour the per-sample sampling seeds and a rerun samples the same rollouts; costs decoding speed (batch-invariant kernels, pytorch sampling, a deterministic attention backend). False: seeds are not sent (SGLang would ignore them) and rollouts are not reproducible. With rollout.sglang_urls the servers must match (checked at connect)."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """MTP speculative decoding."""

    def __post_init__(self):
        _check(self.n >= 1, "rollout.n", ">= 1", self.n)
        _check(self.max_num_seqs >= 1, "rollout.max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.temperature > 0, "rollout.temperature", "> 0 for training rollouts", self.temperature)
        _check(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", "-1 or >= 1", self.top_k)
        _check(self.min_new_tokens >= 0, "rollout.min_new_tokens", ">= 0", self.min_new_tokens)
        _check(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "in (0, 1]",
               self.gpu_memory_utilization)
        _check(self.weight_sync_bucket_mb > 0, "rollout.weight_sync_bucket_mb", "> 0", self.weight_sync_bucket_mb)
        _check(self.weight_sync_timeout_s > 0, "rollout.weight_sync_timeout_s", "> 0", self.weight_sync_timeout_s)
        _check(0 < self.weight_sync_bucket_timeout_s <= self.weight_sync_timeout_s, "rollout.weight_sync_bucket_timeout_s",
               "in (0, rollout.weight_sync_timeout_s]", self.weight_sync_bucket_timeout_s)
        _check(self.max_concurrency >= 1, "rollout.max_concurrency", ">= 1", self.max_concurrency)
        _check(self.max_retries >= 0, "rollout.max_retries", ">= 0", self.max_retries)
        _check(self.health_check_interval_s > 0, "rollout.health_check_interval_s", "> 0", self.health_check_interval_s)
        _check(self.server_down_timeout_s > 0, "rollout.server_down_timeout_s", "> 0", self.server_down_timeout_s)
        for i, item in enumerate(self.server_env):
            if "=" not in item or not item.split("=", 1)[0].strip():
                raise ConfigError(f"rollout.server_env[{i}]", f"expected KEY=VALUE, got {item!r}")
        if self.server_max_total_tokens is not None:
            _check(self.server_max_total_tokens >= 1, "rollout.server_max_total_tokens", ">= 1 or null",
                   self.server_max_total_tokens)
        if self.engine == "sglang" and self.mode == "disaggregate" and not self.sglang_urls and self.server_device != "cpu":
            raise ConfigError("rollout.mode", "disaggregate needs rollout.sglang_urls: the servers this trainer "
                              "launches go on the trainer's own GPUs (a weight-update group would then hold two "
                              "ranks on one GPU, which NCCL refuses); start the SGLang servers on nodes of their "
                              "own and pass their URLs in rollout.sglang_urls, or use rollout.mode=colocate")
        if self.speculative.auto and (self.engine != "sglang" or self.sglang_urls):
            raise ConfigError("rollout.speculative.auto", "relaunches the SGLang servers this trainer launches: needs "
                              "rollout.engine=sglang and no rollout.sglang_urls")


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


@dataclass
class TrainerConfig:
    experiment_name: str = "tiny_cpu"
    """Run name; outputs go under <output_dir>/<experiment_name>/. [recipe: trainer.experiment_name]"""
    project_name: str = "megatron_dapo"
    """Project name (logged). [recipe: trainer.project_name]"""
    output_dir: str = "runs"
    """Root of run directories (tb/, ckpt/, rollouts/, config.yaml)."""
    total_training_steps: int = 30
    """Training steps to run. [recipe: trainer.total_training_steps]"""
    total_epochs: int = 100
    """Upper bound in epochs over the prompts: training ends after the step that draws the last prompt of this
    many epochs, or at total_training_steps, whichever comes first. [recipe: trainer.total_epochs]"""
    save_freq: int = 10
    """Checkpoint every this many steps (-1 = never; the last step is always saved). [recipe: trainer.save_freq]"""
    test_freq: int = 5
    """Validate every this many steps (<= 0 = never). [recipe: trainer.test_freq]"""
    val_before_train: bool = True
    """Validate once before the first step. [recipe: trainer.val_before_train]"""
    resume_mode: str = "auto"
    """auto (latest checkpoint in default_local_dir), disable, or a checkpoint path. [recipe: trainer.resume_mode]"""
    default_local_dir: str = ""
    """Checkpoint directory; empty = <output_dir>/<experiment_name>/ckpt. [recipe: trainer.default_local_dir]"""
    exit_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"])
    """Signals that stop the run at the next safe point (a step's end, or between generation batches) with a checkpoint of the step reached, on every rank; then the process exits with preemption_exit_code. Any of SIGTERM, SIGUSR1 (what the SLURM script asks for before the time limit), SIGINT (a second one stops at once); [] = the default actions (die at once)."""
    preemption_exit_code: int = 75
    """Exit code after a stop signal's checkpoint (75 = EX_TEMPFAIL); the SLURM script requeues the job on it and the requeued job resumes (resume_mode=auto)."""
    max_ckpt_to_keep: int = 2
    """Checkpoints kept (older ones deleted). [recipe: trainer.max_actor_ckpt_to_keep]"""
    async_save: bool = False
    """Write the model and optimizer shards of a checkpoint in a background process while training goes on (Megatron's asynchronous save); the checkpoint is completed (manifest, rename, `latest`) at a later step's end once every rank's writer is done, before the next save, and at once at the last step or a stop signal. Until then the previous checkpoint is the last good one. Costs host memory for the staged shards. Sync trainer only."""
    rollout_data_dir: str = ""
    """Write each step's prompts, responses and scores as JSON lines here; empty = off. [recipe: trainer.rollout_data_dir]"""
    critic_warmup: int = 0
    """Steps before the actor starts updating. [recipe: trainer.critic_warmup]"""
    logger: list[str] = field(default_factory=lambda: ["console", "tensorboard"])
    """Metric sinks: console, tensorboard, wandb, mlflow (the last two are optional extras; configured by their own WANDB_* / MLFLOW_TRACKING_URI variables). [recipe: trainer.logger]"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available."""
    nnodes: int = 1
    """Nodes. [recipe: trainer.nnodes]"""
    n_gpus_per_node: int = 1
    """Training processes per node (GPUs, or CPU processes). [recipe: trainer.n_gpus_per_node]"""
    host_memory_gib_per_node: float = 1536.0
    """Host RAM of a node, GiB: the planner (`python -m megatron_dapo.plan`, `--check`) refuses a layout whose rank 0's node would hold more (the sync trainer's data path per rank, plan/host.py). 1.5 TiB: a typical 8 x H800 node."""
    seed: int = 42
    """Seed of model init and sampling."""
    balance_batch: bool = True
    """Balance tokens across data-parallel ranks. [recipe: trainer.balance_batch]"""
    sft_warmup_steps: int = 0
    """Supervised warm-up steps on the task's answers before RL (the embedded default uses it; cached in the run directory)."""
    sft_warmup_lr: float = 1e-3
    """Peak learning rate of the supervised warm-up."""
    sft_warmup_lr_warmup_steps: int = 0
    """Steps of a linear ramp up to sft_warmup_lr (step k of the ramp uses sft_warmup_lr * k / ramp); 0 = none."""
    sft_warmup_lr_decay_style: Literal["constant", "cosine"] = "constant"
    """After the ramp: constant, or cosine decay to 0 at sft_warmup_steps (an early stop at sft_warmup_target_acc stops partway down the curve)."""
    sft_warmup_batch_size: int = 64
    """Answers per supervised warm-up step."""
    sft_warmup_target_acc: float = 0.0
    """Stop the warm-up early once the policy's accuracy on the first 256 training problems (sampled with rollout.val_kwargs, mean@n; checked every 6,400 training examples far from the target, every 1,600 near it) reaches this, so RL starts from a policy that is sometimes right whatever the seed; 0 = run exactly sft_warmup_steps."""

    def __post_init__(self):
        _check(self.total_training_steps >= 1, "trainer.total_training_steps", ">= 1", self.total_training_steps)
        _check(self.total_epochs >= 1, "trainer.total_epochs", ">= 1", self.total_epochs)
        _check(self.save_freq == -1 or self.save_freq >= 1, "trainer.save_freq", "-1 or >= 1", self.save_freq)
        _check(self.max_ckpt_to_keep >= 1, "trainer.max_ckpt_to_keep", ">= 1", self.max_ckpt_to_keep)
        _check(self.host_memory_gib_per_node > 0, "trainer.host_memory_gib_per_node", "> 0",
               self.host_memory_gib_per_node)
        _check(set(self.exit_signals) <= {"SIGTERM", "SIGUSR1", "SIGINT"}, "trainer.exit_signals",
               "a list of SIGTERM, SIGUSR1, SIGINT", self.exit_signals)
        _check(3 <= self.preemption_exit_code <= 125, "trainer.preemption_exit_code",
               "in 3..125 (0, 1 and 2 mean success, failure and a config error; above 125, the shell's)",
               self.preemption_exit_code)
        _check(self.critic_warmup >= 0, "trainer.critic_warmup", ">= 0", self.critic_warmup)
        _check(self.nnodes >= 1, "trainer.nnodes", ">= 1", self.nnodes)
        _check(self.n_gpus_per_node >= 1, "trainer.n_gpus_per_node", ">= 1", self.n_gpus_per_node)
        _check(set(self.logger) <= {"console", "tensorboard", "wandb", "mlflow"}, "trainer.logger",
               'a list of "console", "tensorboard", "wandb", "mlflow"', self.logger)
        _check(self.sft_warmup_steps >= 0, "trainer.sft_warmup_steps", ">= 0", self.sft_warmup_steps)
        _check(self.sft_warmup_lr_warmup_steps >= 0, "trainer.sft_warmup_lr_warmup_steps", ">= 0",
               self.sft_warmup_lr_warmup_steps)
        _check(self.sft_warmup_batch_size >= 1, "trainer.sft_warmup_batch_size", ">= 1", self.sft_warmup_batch_size)
        _check(0.0 <= self.sft_warmup_target_acc < 1.0, "trainer.sft_warmup_target_acc", "in [0, 1)",
               self.sft_warmup_target_acc)
        _check(bool(self.experiment_name) and "/" not in self.experiment_name
               and self.experiment_name not in (".", ".."), "trainer.experiment_name",
               "a non-empty name without '/', not '.' or '..' (it names a directory under trainer.output_dir)",
               self.experiment_name)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node


@dataclass
class QueueConfig:
    enable: bool = False
    """Run the queue trainer (`_step_once` over the TransferQueue) instead of the sync `fit`."""
    path: str = ""
    """SQLite file of the TransferQueue; empty = <run_dir>/queue.sqlite."""
    parameter_sync_step: int = 1
    """Local actor updates (`_step_once` calls) between weight syncs to the engines."""
    max_staleness: int = 0
    """How many weight pushes old a sample may be when trained (0 = on-policy: sync mode); producers are paced to stay within it. With rollout.engine=sglang, >= 1 needs rollout.mode=disaggregate."""
    stale_policy: Literal["drop", "correct"] = "drop"
    """Samples older than max_staleness: drop (and regenerate their prompts) or keep them with rollout correction."""
    partial_rollout: bool = False
    """Async mode: generation running at a weight push continues under the new weights instead of finishing first. SGLang: paused in place around the push (servers without radix cache); local engine: aborted and continued from the prefix."""
    num_producers: int = 0
    """Async mode: rollout producers writing into the queue: threads on rank 0, each keeping one claim in flight at the SGLang servers, or processes with a local engine each. 0 = auto: with SGLang, enough threads to keep a generation batch in flight in claims of claim_prompts; with the local engine, one process."""
    claim_prompts: int = 64
    """Async mode: prompts a producer claims and generates at a time (at most a generation batch's share per producer). Small claims let finished groups reach the trainer while the longest responses of other claims still generate, so the long tail of a batch is hidden behind training."""

    def __post_init__(self):
        _check(self.parameter_sync_step >= 1, "queue.parameter_sync_step", ">= 1", self.parameter_sync_step)
        _check(self.max_staleness >= 0, "queue.max_staleness", ">= 0", self.max_staleness)
        _check(self.num_producers >= 0, "queue.num_producers", ">= 0 (0 = auto)", self.num_producers)
        _check(self.claim_prompts >= 1, "queue.claim_prompts", ">= 1", self.claim_prompts)
