"""The rollout section of the config tree: `RolloutConfig` (sampling, the local engine, the SGLang
servers, the weight sync) and its sub-configs `ValKwargs` (validation sampling), `MismatchAlarmConfig`
(the engine/actor log-prob mismatch alarm) and `SpeculativeConfig` (MTP speculative decoding).

As everywhere in the tree (schema.py): the field docstrings are the documentation (docs/configuration.md
is generated from them), each section validates itself in `__post_init__`, and errors name the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.schema import _check


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
