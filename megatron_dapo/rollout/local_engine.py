"""The local rollout engine: the actor's own Megatron model samples, with Megatron's static KV cache.

The engine lives in the trainer's process and holds the very GPTModel the actor trains, so it
always samples with the live weights: `update_weights(None, policy_version=v)` only records the
version. It implements `RolloutEngine` (rollout/base.py) on CPU (gloo) and CUDA.

How a call runs:
1. Rows are the (prompt, sample_index) pairs, sorted by prompt length and cut into batches of at
   most `max_batch_size` rows whose prompt lengths lie within `max_new_tokens` of each other.
   Nothing is padded on the left: Megatron's RoPE ignores position_ids (positions are always
   0..S-1) and the actor right-pads, so row i's prompt must sit at positions 0..P_i-1. The prefill
   covers the batch's shortest prompt; in each later forward a row that is still inside its
   prompt is fed its next prompt token (its logits are ignored) and the others their last sampled
   token. So every row sees exactly the positions and keys the actor's forward sees, and
   `rollout_log_probs` equal the actor's recomputed log-probs up to fp32 round-off, while prompts
   of different lengths share one batch (forwards per batch: 1 + Pmax - Pmin + max_new_tokens - 1).
2. KV cache (`use_kv_cache=True`): one prefill forward with a `StaticInferenceContext`
   (`runtime_gather_output=True`; the context materialises only the last position's logits),
   then `increment_sequence_len_offset(P)`, `enable_decode_mode()` and one token per forward.
   The prefill runs once per distinct row of the batch's first Pmin tokens (the n samples of a
   prompt share theirs) and each layer's cache rows are copied to the duplicates: with n = 4 it
   costs a quarter of the FLOPs (384 rows of 5-6 tokens, CPU: about 65 -> 27 ms). Only while every
   core attention is the local one (`_SdpaCoreAttention`), whose cache is one [S, b, ng, hn]
   (key, value) pair per layer. The keys are cached after their rotary embedding
   (`_RotatedKeyCache`), so a decode step rotates its own key only, not the whole cache again.
   Both are swapped in for the generation only (rollout/generation_attention.py).
   Without the cache every step re-runs the whole sequence (the reference path, and the
   benchmark's baseline).
3. Rows that finished keep being fed `pad_token_id` until their batch is done (their outputs are
   ignored); a batch stops as soon as every row has finished.
4. Streaming (`generate_streaming`): after each decode step the groups whose last row just finished
   (a group's rows are adjacent in the length order, but may span two batches) go to
   `on_groups_done`; once it says stop, the batch breaks off, its unfinished rows and every row of the
   batches not run yet come back "abort". With `decision_group` (the ranks that run this engine in
   lockstep, SPMD data parallelism) the callback runs on that group's rank 0 only and its answer is
   broadcast, so every rank stops at the same step; without it, any TP rank's stop stops all.

Sampling: each step draws one token per row with `sample_next_tokens` (rollout/sampling.py, whose
docstring gives the order of temperature, stop-token mask, top-k and top-p, and what
`rollout_log_probs` hold). With `SamplingParams.seed` set, row (prompt_id, j) draws from its own
generator seeded with `derive_sample_seed(seed, prompt_id, j)`, so a sample does not depend on
batching or on the order of the prompts.

Parallelism: pipeline parallelism is not supported (ValueError at construction). Under tensor
parallelism every TP rank runs the same generation on logits gathered over TP; after each step
the tokens, log-probs and abort flag are summed over the TP group with every rank but TP rank 0
contributing zeros (a broadcast from rank 0 that is exact), so all TP ranks return identical
samples even if their round-off differed, and an abort seen by any TP rank stops all of them at
the same step. Sequence parallelism is switched off for the generation (a decode step has one
token, which cannot be split over TP ranks) and restored afterwards, as Megatron's own
text-generation controller does (text_generation_controller.py, `set_model_to_sequence_parallel`).
MTP heads are switched off for the generation too: only the main head samples, and GPTModel's
forward needs labels while MTP is on (gpt_model.py `labels.clone()`).

CPU: the KV-cache decode needs only the process-wide shims of `models.cpu_compat` (curdev, rng).
Forwards over more than one position through Megatron's local core attention build its default
causal mask with device="cuda" (transformer/utils.get_default_causal_mask), so they run inside
`CudaToCpuMode`; it is thread-local, so the engine enters it itself and works from any thread.
When every core attention is `_SdpaCoreAttention` (it builds its own mask) they run without it too,
like the decode (its Python hook on every op cost ~15% of a 384-row prefill).

Shape legend:
    b  rows of one batch                         P_i  row i's prompt length (Pmin..Pmax)
    t  decode step, 0..max_new_tokens-1         V  vocabulary (logits gathered over TP)
    logits [b, V] fp32; tokens, log_probs [b]; the KV cache of one layer [Pmax + max_new_tokens, b, g, d]
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dapo.models.forward import unwrap_model
from megatron_dapo.rollout.base import (
    GroupsDone,
    PromptInput,
    RolloutEngine,
    RolloutEngineError,
    Sample,
    SamplingParams,
    check_generate_inputs,
    derive_sample_seed,
    right_padded,
)
from megatron_dapo.rollout.generation_attention import _RotatedKeyCache, _SdpaCoreAttention
from megatron_dapo.rollout.sampling import sample_next_tokens

__all__ = ["LocalEngine"]

# Module attributes that carry sequence parallelism (the list Megatron's own
# transformer/utils.set_model_to_sequence_parallel walks).
_SP_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


# --------------------------------------------------------------------------------------- engine


class LocalEngine(RolloutEngine):
    """Batched sampling with the actor's Megatron model (see the module docstring).

    model: the GPTModel the actor trains, bare or wrapped (DDP / Float16Module); the engine runs
    the unwrapped GPTModel and flips the wrapper between eval and its previous mode.
    pgs: parallel.ParallelGroups (pgs.tp, pgs.device). eos_token_id: ends a response
    (None: only SamplingParams.stop_token_ids do, e.g. for benchmarks). pad_token_id: fed to rows
    that finished. max_batch_size: rows per forward. use_kv_cache: False re-runs the whole
    sequence every step (the reference path). decision_group: the ranks that run this engine in lockstep
    (pgs.ctrl under SPMD data parallelism): a streaming stop is decided on its rank 0 and broadcast.
    """

    supports_streaming = True

    def __init__(self, model, *, pgs, eos_token_id: int | None, pad_token_id: int,
                 max_batch_size: int = 64, use_kv_cache: bool = True, policy_version: int = 0,
                 decision_group=None):
        if isinstance(model, (list, tuple)):
            raise TypeError("LocalEngine takes one model, not a list of model chunks "
                            "(virtual pipeline stages are not supported by the local engine)")
        if pgs.pp_size > 1:
            raise ValueError(
                f"the local rollout engine does not support pipeline parallelism "
                f"(parallel.pipeline_model_parallel_size={pgs.pp_size}); set "
                "parallel.pipeline_model_parallel_size=1 or use rollout.engine=sglang")
        self.model = model
        self.inner = unwrap_model(model)
        if not (self.inner.pre_process and self.inner.post_process):
            raise ValueError("LocalEngine needs a model that holds both the embedding and the output layer")
        self.pgs = pgs
        self.vocab_size = int(self.inner.vocab_size)
        self.max_sequence_length = int(self.inner.max_sequence_length)
        if eos_token_id is not None:
            _check_int(eos_token_id, "eos_token_id", 0, self.vocab_size - 1)
        _check_int(pad_token_id, "pad_token_id", 0, self.vocab_size - 1)
        _check_int(max_batch_size, "max_batch_size", 1, None)
        _check_int(policy_version, "policy_version", 0, None)
        if not isinstance(use_kv_cache, bool):
            raise ValueError(f"LocalEngine use_kv_cache must be a bool, got {use_kv_cache!r}")
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.max_batch_size, self.use_kv_cache = max_batch_size, use_kv_cache
        self.decision_group = decision_group
        self.device = torch.device(pgs.device)
        self._policy_version = policy_version
        self._lock = threading.Lock()  # one generation (or weight update) at a time on the model
        self._plain_attention = False  # inside _generation_mode: every core attention is _SdpaCoreAttention
        self._abort_event = threading.Event()  # replaced by abort(); generate calls keep theirs
        self._memory_released = False
        self._closed = False
        self._generating = False

    # ----------------------------------------------------------------------------- generation

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def generate(self, prompts: Sequence[PromptInput], sampling: SamplingParams) -> list[Sample]:
        return self._generate(prompts, sampling, None)

    def generate_streaming(self, prompts: Sequence[PromptInput], sampling: SamplingParams, *,
                           on_groups_done: GroupsDone) -> list[Sample]:
        """`generate` that stops once `on_groups_done` says so (module docstring, step 4)."""
        return self._generate(prompts, sampling, on_groups_done)

    def _generate(self, prompts: Sequence[PromptInput], sampling: SamplingParams,
                  on_groups_done: GroupsDone | None) -> list[Sample]:
        check_generate_inputs(prompts, sampling)
        if self._closed:
            raise RolloutEngineError("LocalEngine is closed")
        if self._memory_released:
            raise RolloutEngineError("LocalEngine.generate after release_memory(); call resume_memory() first")
        aborted = self._abort_event
        for p in prompts:
            self._check_prompt(p, sampling.max_new_tokens)
        rows = [(p, j) for p in prompts for j in range(sampling.n)]
        stop_ids = set(sampling.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())
        out: list[Sample | None] = [None] * len(rows)
        left = [sampling.n] * len(prompts)  # unfinished rows per group
        stopped = False
        with self._lock, self._generation_mode():
            self._generating = True
            try:
                version = self._policy_version

                def sample(r: int, tokens: list, log_probs: list, reason: str) -> Sample:
                    p, j = rows[r]
                    return Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids,
                                  response_token_ids=tokens, rollout_log_probs=log_probs, finish_reason=reason,
                                  policy_version=version)

                for batch in self._batches(rows, sampling.max_new_tokens):
                    if stopped:
                        for r in batch:
                            out[r] = sample(r, [], [], "abort")
                        continue
                    on_done = None
                    if on_groups_done is not None:
                        def on_done(finished, batch=batch):  # (row in batch, tokens, log-probs, reason)
                            complete = []
                            for i, tokens, log_probs, reason in finished:
                                r = batch[i]
                                out[r] = sample(r, tokens, log_probs, reason)
                                g = r // sampling.n
                                left[g] -= 1
                                if left[g] == 0:
                                    complete.append(out[g * sampling.n:(g + 1) * sampling.n])
                            return bool(complete) and self._decide(on_groups_done, complete)
                    results, stopped = self._generate_batch([rows[r] for r in batch], sampling, stop_ids, aborted,
                                                            on_done)
                    for r, (tokens, log_probs, reason) in zip(batch, results, strict=True):
                        if out[r] is None:
                            out[r] = sample(r, tokens, log_probs, reason)
            finally:
                self._generating = False
        return out  # type: ignore[return-value]  # every row was filled above

    def _decide(self, on_groups_done: GroupsDone, groups: list[list[Sample]]) -> bool:
        """The stop decision, the same on every rank (module docstring, step 4). An error in the callback
        on the deciding rank reaches the others as a RolloutEngineError instead of leaving them waiting."""
        g = self.decision_group
        if g is None or dist.get_world_size(g) == 1:
            return self._agree(bool(on_groups_done(groups)))
        flag, error = torch.zeros(1, dtype=torch.int64), None
        if dist.get_rank(g) == 0:
            try:
                flag[0] = int(bool(on_groups_done(groups)))
            except Exception as e:  # noqa: BLE001 - re-raised here after the others heard of it
                flag[0], error = 2, e
        dist.broadcast(flag, src=dist.get_global_rank(g, 0), group=g)
        if error is not None:
            raise error
        if int(flag[0]) == 2:
            raise RolloutEngineError("the streaming stop callback failed on the deciding rank")
        return bool(flag[0])

    def _check_prompt(self, p: PromptInput, max_new_tokens: int) -> None:
        bad = [t for t in p.token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt {p.prompt_id!r}: token id {bad[0]} is outside the model's vocabulary "
                             f"[0, {self.vocab_size})")
        total = len(p.token_ids) + max_new_tokens
        if total > self.max_sequence_length:
            raise ValueError(f"prompt {p.prompt_id!r}: {len(p.token_ids)} prompt tokens + max_new_tokens="
                             f"{max_new_tokens} = {total} > the model's max_sequence_length={self.max_sequence_length}")

    def _batches(self, rows: list[tuple[PromptInput, int]], max_new: int) -> list[list[int]]:
        """Row indices cut into batches: sorted by prompt length, at most `max_batch_size` rows, and
        prompt lengths within `max_new` of the batch's shortest (a longer spread would cost more
        forwards feeding prompt tokens than a separate batch costs)."""
        order = sorted(range(len(rows)), key=lambda r: len(rows[r][0].token_ids))
        batches: list[list[int]] = []
        for r in order:
            P = len(rows[r][0].token_ids)
            if batches and len(batches[-1]) < self.max_batch_size \
                    and P - len(rows[batches[-1][0]][0].token_ids) <= max_new:
                batches[-1].append(r)
            else:
                batches.append([r])
        return batches

    def _generate_batch(self, rows: list[tuple[PromptInput, int]], sampling: SamplingParams,
                        stop_ids: set[int], aborted: threading.Event,
                        on_done: Callable[[list[tuple[int, list, list, str]]], bool] | None = None,
                        ) -> tuple[list[tuple[list, list, str]], bool]:
        """Sample one batch of rows; returns ((tokens, log_probs, reason) per row, whether on_done stopped it).

        on_done(finished): after each step, the rows that finished in it as (row, tokens, log_probs,
        reason); True stops the batch, its unfinished rows are "abort".

        Prompts of different lengths share the batch without padding (module docstring, step 1):
        the prefill covers the shortest prompt (Pmin); at position `pos` a row whose prompt is
        longer is fed its own prompt token, every other row its last sampled token, so row i
        samples its token t at position P_i + t, exactly where the actor's forward puts it.
        """
        b, max_new = len(rows), sampling.max_new_tokens
        if self._agree(aborted.is_set()):
            return [([], [], "abort")] * b, False
        dev = self.device
        lengths = torch.tensor([len(p.token_ids) for p, _ in rows], device=dev)  # P_i [b]
        p_min, p_max = int(lengths.min()), int(lengths.max())
        prompt = right_padded([p.token_ids for p, _ in rows], p_max, self.pad_token_id, torch.long, dev)  # [b, Pmax]
        uniforms = None  # [b, max_new]: row i's t-th token is drawn with uniforms[i, t]
        if sampling.seed is not None and sampling.temperature > 0:
            uniforms = torch.stack([
                torch.rand(max_new, device=dev,
                           generator=torch.Generator(device=dev).manual_seed(derive_sample_seed(sampling.seed, p.prompt_id, j)))
                for p, j in rows])
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
        tokens = torch.full((b, max_new), self.pad_token_id, dtype=torch.long, device=dev)
        log_probs = torch.zeros((b, max_new), dtype=torch.float32, device=dev)
        length = torch.zeros(b, dtype=torch.long, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        stopped = torch.zeros(b, dtype=torch.bool, device=dev)
        step = (_CachedStepper(self, prompt[:, :p_min], p_max - p_min + max_new) if self.use_kv_cache
                else _FullStepper(self, prompt[:, :p_min]))
        logits = step.prefill()  # [b, V]: the next token after position p_min - 1
        was_aborted = cut = False
        for pos in range(p_min, p_max + max_new):
            t = pos - lengths                       # [b] index of the token sampled at pos (< 0: prompt)
            sampling_rows = ((t >= 0) & ~done).nonzero().squeeze(-1)
            if len(sampling_rows):
                early = t[sampling_rows] < sampling.min_new_tokens  # rows that may not stop yet
                tok, lp = sample_next_tokens(
                    logits[sampling_rows], temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                    uniforms=None if uniforms is None else uniforms[sampling_rows, t[sampling_rows]],
                    banned_ids=stop if sampling.min_new_tokens and bool(early.any()) else None, banned_rows=early)
            else:
                tok = lp = torch.zeros(0, device=dev)
            tok, lp, was_aborted = self._sync_step(tok.long(), lp.float(), aborted.is_set())
            ts = t[sampling_rows]
            tokens[sampling_rows, ts] = tok
            log_probs[sampling_rows, ts] = lp
            length[sampling_rows] += 1
            hit = torch.zeros(b, dtype=torch.bool, device=dev)
            hit[sampling_rows] = torch.isin(tok, stop)
            stopped |= hit
            newly = ~done & (hit | (length == max_new))
            done |= newly
            if on_done is not None and bool(newly.any()):
                lens = length.tolist()
                cut = on_done([(i, tokens[i, :lens[i]].tolist(), log_probs[i, :lens[i]].tolist(),
                                "stop" if bool(stopped[i]) else "length") for i in newly.nonzero().squeeze(-1).tolist()])
            if was_aborted or cut or bool(done.all()):
                break
            fed = prompt[:, min(pos, p_max - 1)].clone()  # rows still inside their prompt
            fed[t >= 0] = self.pad_token_id                 # finished rows are fed padding
            fed[sampling_rows] = tok
            logits = step.decode(fed)
        reasons = ["stop" if s else ("abort" if (was_aborted or cut) and n < max_new else "length")
                   for s, n in zip(stopped.tolist(), length.tolist())]
        tokens_l, lps_l = tokens.tolist(), log_probs.tolist()
        return [(tokens_l[i][:n], lps_l[i][:n], reasons[i]) for i, n in enumerate(length.tolist())], cut

    # ------------------------------------------------------------------- tensor-parallel agreement

    def _tp_multi(self) -> bool:
        return self.pgs.tp_size > 1

    def _agree(self, flag: bool) -> bool:
        """True when any TP rank has the flag set (every TP rank gets the same answer)."""
        if not self._tp_multi():
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pgs.tp)
        return bool(t.item() > 0)

    def _sync_step(self, tok: Tensor, lp: Tensor, abort_flag: bool) -> tuple[Tensor, Tensor, bool]:
        """TP rank 0's tokens and log-probs on every TP rank, and "did any TP rank abort".

        One float64 all-reduce: rank 0 contributes its values, the others zeros, so the sum is an
        exact broadcast (token ids are far below 2^53); the abort flags simply add up.
        """
        if not self._tp_multi():
            return tok, lp, abort_flag
        b = tok.shape[0]
        packed = torch.zeros(2 * b + 1, dtype=torch.float64, device=tok.device)
        if self.pgs.tp_rank == 0:
            packed[:b] = tok.double()
            packed[b:2 * b] = lp.double()
        packed[2 * b] = 1.0 if abort_flag else 0.0
        dist.all_reduce(packed, group=self.pgs.tp)
        return packed[:b].long(), packed[b:2 * b].float(), bool(packed[2 * b].item() > 0)

    # ------------------------------------------------------------------------ model preparation

    @contextlib.contextmanager
    def _generation_mode(self):
        """no_grad + eval, sequence parallelism and MTP heads off, the local spec's core attention on
        SDPA (_SdpaCoreAttention); everything restored on exit."""
        inner, config = self.inner, self.inner.config
        modes = [(m, m.training) for m in self.model.modules()]
        sp_saved = [(m, a, getattr(m, a)) for m in inner.modules() for a in _SP_ATTRS if hasattr(m, a)]
        sp_config, mtp_layers, mtp_process = config.sequence_parallel, config.mtp_num_layers, inner.mtp_process
        cores = [m for m in inner.modules() if hasattr(m, "core_attention")]
        swapped = [(m, m.core_attention) for m in cores if _SdpaCoreAttention.can_replace(m.core_attention)]
        rotated = [m for m in cores if _RotatedKeyCache.can_wrap(m)]
        try:
            for m, core in swapped:
                m.core_attention = _SdpaCoreAttention(core)
            for m in rotated:
                m._adjust_key_value_for_inference = _RotatedKeyCache(m)
            self._plain_attention = len(swapped) == len(cores)
            self.model.eval()
            if sp_config:
                config.sequence_parallel = False
                for m, a, _ in sp_saved:
                    setattr(m, a, False)
            config.mtp_num_layers, inner.mtp_process = None, False
            with torch.no_grad():
                yield
        finally:
            for m in rotated:
                del m._adjust_key_value_for_inference  # the instance attribute: the class's method again
            for m, core in swapped:
                m.core_attention = core
            self._plain_attention = False
            config.sequence_parallel, config.mtp_num_layers, inner.mtp_process = sp_config, mtp_layers, mtp_process
            for m, a, v in sp_saved:
                setattr(m, a, v)
            for m, training in modes:
                m.training = training

    def _multi_token_forward(self):
        """Context for forwards over more than one position (module docstring, CPU)."""
        if self.device.type != "cpu":
            return contextlib.nullcontext()
        if self._plain_attention:  # _SdpaCoreAttention builds its own causal mask
            return self._single_token_forward()
        from megatron_dapo.models.cpu_compat import CudaToCpuMode

        return CudaToCpuMode()

    def _single_token_forward(self):
        """Context for the one-token decode forwards: on CPU, torch-function modes off.

        The decode step needs no CudaToCpuMode (only the process-wide shims), but a thread that ran
        cpu_compat.install() has one entered, and its Python hook on every tiny op cost ~20% of
        decode time (b8 x 64 steps, hidden 256, 1 thread: 0.68 s -> 0.55 s, interleaved runs).
        """
        return torch._C.DisableTorchFunction() if self.device.type == "cpu" else contextlib.nullcontext()

    def _positions(self, start: int, b: int, s: int) -> Tensor:
        return torch.arange(start, start + s, device=self.device).unsqueeze(0).expand(b, s)

    # -------------------------------------------------------------------------------- control

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]] | None = None, *, policy_version: int,
                       **kwargs: Any) -> None:
        """None: the actor already changed the shared weights, only the version moves. Otherwise copy
        each (name, tensor) into the parameter (or buffer) of that name of the unwrapped GPTModel,
        in this rank's shard shape; a subset of the names (one bucket) is fine. `bucket_mb` is
        accepted and ignored (nothing is serialized); any other keyword is an error."""
        unknown = sorted(set(kwargs) - {"bucket_mb"})
        if unknown:
            raise TypeError(f"LocalEngine.update_weights got unexpected keyword arguments {unknown}")
        if not isinstance(policy_version, int) or isinstance(policy_version, bool) \
                or policy_version < self._policy_version:
            raise ValueError(f"policy_version must be an int >= {self._policy_version} (current), "
                             f"got {policy_version!r}")
        with self._lock:
            if named_tensors is not None:
                self._copy_weights(named_tensors)
            self._policy_version = policy_version

    def _copy_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        targets = dict(self.inner.named_parameters())
        targets.update(self.inner.named_buffers())
        updates = []
        for item in named_tensors:  # validate everything before touching any weight
            name, tensor = item
            if name not in targets:
                near = sorted(targets)[:5]
                raise ValueError(f"update_weights: {name!r} is not a parameter of the model "
                                 f"(names look like {near}, ...)")
            if not torch.is_tensor(tensor) or tuple(tensor.shape) != tuple(targets[name].shape):
                got = tuple(tensor.shape) if torch.is_tensor(tensor) else type(tensor).__name__
                raise ValueError(f"update_weights: {name!r} has shape {got}, the model's is "
                                 f"{tuple(targets[name].shape)} (this rank's shard)")
            updates.append((targets[name], tensor))
        with torch.no_grad():
            for target, tensor in updates:
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    def abort(self) -> None:
        """Generate calls in flight stop before their next decode step; unfinished samples come back
        with finish_reason "abort" and the tokens sampled so far. Later calls run normally."""
        old, self._abort_event = self._abort_event, threading.Event()
        old.set()

    def release_memory(self) -> None:
        """The KV cache exists only inside generate and the weights are the actor's (they cannot be
        freed here), so this returns the allocator's cached blocks on CUDA (torch.cuda.empty_cache)
        and records the state: generate refuses to run until resume_memory(), as a real engine would."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._memory_released = True

    def resume_memory(self) -> None:
        """Nothing to re-allocate (the cache is built per batch); clears the released state."""
        self._memory_released = False

    def health(self) -> dict[str, Any]:
        return {"healthy": not self._closed, "policy_version": self._policy_version,
                "device": str(self.device), "use_kv_cache": self.use_kv_cache,
                "memory_released": self._memory_released, "generating": self._generating}

    def close(self) -> None:
        self._closed = True
        self.abort()


class _CachedStepper:
    """The KV-cache loop of one batch: Megatron's StaticInferenceContext sized [P + max_new, b]."""

    def __init__(self, engine: LocalEngine, prompt: Tensor, max_new: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.engine, self.prompt = engine, prompt
        b, P = prompt.shape
        self.ctx = StaticInferenceContext(max_batch_size=b, max_sequence_length=P + max_new)

    def prefill(self) -> Tensor:
        """The forward over the first P positions. Rows with the same P tokens (a prompt's n samples) are
        computed once and their cache rows copied to the others (module docstring, step 2)."""
        e, (b, P) = self.engine, self.prompt.shape
        unique, inverse = self.prompt, None
        if e._plain_attention:  # the cache is one (key, value) pair [S, b, ng, hn] per layer
            unique, inverse = torch.unique(self.prompt, dim=0, return_inverse=True)
            if len(unique) == b:
                unique, inverse = self.prompt, None
        u = len(unique)
        with e._multi_token_forward():
            out = e.inner(unique, e._positions(0, u, P), None, inference_context=self.ctx,
                          runtime_gather_output=True)              # [u, 1, V]: last position only
        if inverse is not None:
            for cache in self.ctx.key_value_memory_dict.values():
                for t in cache:
                    t[:P, :b] = t[:P, :u].index_select(1, inverse)
            out = out.index_select(0, inverse)
        self.ctx.increment_sequence_len_offset(P)
        self.ctx.enable_decode_mode()
        return out[:, -1]

    def decode(self, last: Tensor) -> Tensor:
        e, offset = self.engine, self.ctx.sequence_len_offset
        with e._single_token_forward():
            out = e.inner(last[:, None], e._positions(offset, last.shape[0], 1), None, inference_context=self.ctx,
                          runtime_gather_output=True)              # [b, 1, V]
        self.ctx.increment_sequence_len_offset(1)
        return out[:, -1]


class _FullStepper:
    """No cache: every step re-runs prompt + tokens so far and keeps the last position's logits."""

    def __init__(self, engine: LocalEngine, prompt: Tensor):
        self.engine, self.seq = engine, prompt

    def _forward(self) -> Tensor:
        e, (b, S) = self.engine, self.seq.shape
        with e._multi_token_forward():
            return e.inner(self.seq, e._positions(0, b, S), None, runtime_gather_output=True)[:, -1]

    def prefill(self) -> Tensor:
        return self._forward()

    def decode(self, last: Tensor) -> Tensor:
        self.seq = torch.cat([self.seq, last[:, None]], dim=1)
        return self._forward()


def _check_int(value: Any, name: str, lo: int, hi: int | None) -> None:
    try:
        ok = not isinstance(value, bool) and operator.index(value) == value
    except TypeError:
        ok = False
    if not ok or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"LocalEngine {name} must be an int {bound}, got {value!r}")
