"""The one typed config tree: every default of megatron_dapo lives here (and in the two section modules
beside this one) and nowhere else.

YAML recipes (configs/*.yaml) hold only overrides; `loader.py` applies base -> recipe -> dotlist.
Each field has a docstring under it; a trailing `[recipe: ...]` names the key of the DAPO recipe
(verl's `recipe/dapo`) it corresponds to, and the docs/configuration.md table is generated from these docstrings
(`python -m megatron_dapo.config.docs`). The defaults are the embedded CPU run (a tiny Megatron model
on the synthetic arithmetic task) with the DAPO algorithm settings; the 32B recipes override sizes.

Each section validates itself in `__post_init__`; checks that span sections live in
`Config.__post_init__`. Errors are `ConfigError`s that name the key.

Where the sections live: here data (with its arithmetic task), model, parallel, actor, trainer and
queue, and `_check`, the validation helper of every section; schema_rollout.py the rollout section and
its sub-configs; schema_algorithm.py the reward and algorithm sections and theirs. The root `Config`,
which holds one of each, and the checks that span sections are in root.py.
"""

from __future__ import annotations

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
    """SQLite file of the TransferQueue; empty = <run_dir>/queue.sqlite. With actor.router_replay=r3 each queued row's routing is a file in <path>.spool/ beside it (about 2.5 MB a row at the MoE recipe: docs/queue-trainer.md)."""
    parameter_sync_step: int = 1
    """Local actor updates (`_step_once` calls) between weight syncs to the engines."""
    max_staleness: int = 0
    """How many weight pushes old a sample may be when trained (0 = on-policy: sync mode); producers are paced to stay within it. With rollout.engine=sglang, >= 1 needs rollout.mode=disaggregate."""
    stale_policy: Literal["drop", "correct"] = "drop"
    """Samples older than max_staleness: drop (and regenerate their prompts) or keep them with rollout correction."""
    partial_rollout: bool = False
    """Async mode: generation running at a weight push continues under the new weights instead of finishing first. SGLang: paused in place around the push (servers without radix cache); local engine: aborted and continued from the prefix."""
    num_producers: int = 0
    """Async mode: rollout producers writing into the queue: threads in one process beside rank 0, each keeping one claim in flight at the SGLang servers (and scoring and writing it there, off the training process), or processes with a local engine each. 0 = auto: with SGLang, enough threads to keep a generation batch in flight in claims of claim_prompts; with the local engine, one process."""
    claim_prompts: int = 64
    """Async mode: prompts a producer claims and generates at a time (at most a generation batch's share per producer). Small claims let finished groups reach the trainer while the longest responses of other claims still generate, so the long tail of a batch is hidden behind training."""

    def __post_init__(self):
        _check(self.parameter_sync_step >= 1, "queue.parameter_sync_step", ">= 1", self.parameter_sync_step)
        _check(self.max_staleness >= 0, "queue.max_staleness", ">= 0", self.max_staleness)
        _check(self.num_producers >= 0, "queue.num_producers", ">= 0 (0 = auto)", self.num_producers)
        _check(self.claim_prompts >= 1, "queue.claim_prompts", ">= 1", self.claim_prompts)
