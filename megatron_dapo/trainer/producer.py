"""Rollout producers for the queue trainer: claim pending prompts, generate, write each claim atomically.

Queue layout (one partition, `TRAIN_PARTITION`, for the whole run; see queue_trainer.py):

    <key>        a prompt (is_prompt=True). key = "<uid>@<s>.<k>": the dataset uid made key-safe
                 (`key_safe_uid`), the trainer step s it was issued at and the generation batch k
                 of that step, so a prompt drawn again in a later epoch is a new key.
                 fields: prompts (token ids), raw_prompt, ground_truth, data_source, uid, seed
                 (sampling seed of its generation batch), claim (who generates it), reward_keys
                 (the reward's extra keys, written with the group), fate (why it was consumed:
                 trained / filtered / surplus)
    <key>_<j>    its j-th trajectory, j < rollout.n. Fields: prompts [P] int64, responses [L]
                 int64, rollout_log_probs [L] fp32, finish_reason, min_policy_version,
                 max_policy_version, meta; with a scorer (claim_reward.py, the trainer's producers)
                 rm_scores, rewards, response_text and the reward's extra keys; with `routing`
                 (actor.router_replay=r3) routed_experts, the MoE routing the server chose for the
                 row [L_hf, P + L - 1, K] uint8 / int16, in a file beside the queue (queue/spool.py;
                 the field holds its reference), or None (a row without it); the trainer adds
                 old_log_probs and entropy (and drops the routing of a group filtered or consumed).

Lifecycle: pending --claim--> running --write--> done --trainer step commit--> consumed.
A claim sets status running and a claim token in ONE transaction; the write puts all n
trajectories of every claimed prompt (scored: reward runs in the producer, beside generation) and
marks them done in ONE transaction, and only for prompts still running under this claim token. So a
crash never leaves half a group or a group without its scores, and a producer whose
claim was reissued (it was presumed dead) cannot write a second group for the prompt.

Partial rollouts (`queue.partial_rollout`, producer processes only): a watcher thread aborts the
engine when the trainer publishes newer weights; the unfinished samples are continued under the
new weights (prompt + tokens so far as the new prompt), so a trajectory spans versions
[min_policy_version, max_policy_version].

Weights reach producer processes through `WeightStore`: the trainer writes the unwrapped model's
state dict as `policy_v<version>.safetensors` (atomically) at every weight sync.

Shape legend: P prompt length, L response length of one trajectory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_dapo.queue import TransferQueue, trajectory_key
from megatron_dapo.rollout.base import PromptInput, Sample, SamplingParams
from megatron_dapo.trainer import faults
from megatron_dapo.trainer.claim_reward import ClaimScorer

log = logging.getLogger(__name__)

TRAIN_PARTITION = "train"
# Torchrun variables a spawned producer must not inherit: it is a world of its own.
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID")
_UNSAFE = re.compile(r"[^A-Za-z0-9.:/+#-]")  # '@' and '=' are reserved for the key suffix and the escape


def key_safe_uid(uid: str) -> str:
    """A dataset uid as a queue prompt id: characters outside `[A-Za-z0-9.:/+#-]` become `=XX` (hex)."""
    return _UNSAFE.sub(lambda m: "".join(f"={b:02X}" for b in m.group(0).encode()), uid)


def prompt_key(uid: str, step: int, gen_batch: int) -> str:
    """Queue key (and GRPO group id) of a prompt issued at `step` in generation batch `gen_batch`."""
    return f"{key_safe_uid(uid)}@{step}.{gen_batch}"


# --------------------------------------------------------------------------------------- weights


class WeightStore:
    """Policy weights published by the trainer: `<dir>/policy_v<version>.safetensors`, newest wins."""

    _NAME = re.compile(r"policy_v(\d+)\.safetensors")

    def __init__(self, directory: str, *, keep: int = 3):
        self.dir, self.keep = directory, keep

    def versions(self) -> list[int]:
        if not os.path.isdir(self.dir):
            return []
        return sorted(int(m.group(1)) for m in map(self._NAME.fullmatch, os.listdir(self.dir)) if m)

    def latest_version(self) -> int | None:
        v = self.versions()
        return v[-1] if v else None

    def path(self, version: int) -> str:
        return os.path.join(self.dir, f"policy_v{version}.safetensors")

    def publish(self, version: int, named_tensors: dict[str, torch.Tensor]) -> None:
        """Write version `version` atomically (tmp + rename), drop versions above it (a rollback after a
        restart) and all but the newest `keep`."""
        import safetensors.torch

        os.makedirs(self.dir, exist_ok=True)
        tmp = f"{self.path(version)}.tmp{os.getpid()}"
        safetensors.torch.save_file({k: v.detach().cpu().contiguous().clone() for k, v in named_tensors.items()},
                                    tmp, metadata={"policy_version": str(version)})
        os.replace(tmp, self.path(version))
        older = [v for v in self.versions() if v <= version]
        for v in [v for v in self.versions() if v > version] + older[:-self.keep]:
            _remove(self.path(v))

    def load(self, version: int) -> dict[str, torch.Tensor]:
        import safetensors.torch

        return safetensors.torch.load_file(self.path(version))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def model_weights(model) -> dict[str, torch.Tensor]:
    """The parameters and buffers of an unwrapped GPTModel by name (what LocalEngine.update_weights takes)."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    return {k: v.detach() for k, v in named.items() if v is not None}


# -------------------------------------------------------------------------------------- producer


@dataclass(frozen=True)
class Trajectory:
    sample: Sample  # sample.policy_version is the newest version that produced a token
    min_policy_version: int


@dataclass(frozen=True)
class Claim:
    """A claim's prompts, their fields read at the claim, and the generated groups."""

    keys: list[str]
    fields: dict[str, list]
    groups: dict[str, list[Trajectory]]
    token: str


class Producer:
    """Claims pending prompts of `partition`, generates `sampling.n` trajectories each, writes them.

    `producer_id` prefixes the claim tokens ("<producer_id>.<pid>.<counter>"), so the trainer can
    reissue exactly the claims of a producer that died. `weights` (a WeightStore) is for producer
    processes: `refresh_weights()` loads a newer published version into the engine.
    """

    def __init__(self, queue: TransferQueue, engine, *, sampling: SamplingParams, producer_id: str,
                 partition: str = TRAIN_PARTITION, weights: WeightStore | None = None, partial_rollout: bool = False,
                 fault_point: str = "generation", poll_s: float = 0.05, stop: threading.Event | None = None,
                 scorer: ClaimScorer | None = None, routing: bool = False):
        """stop: once set, a claim whose generation returns is not written (it stays running: the
        generation may have been cut by an abort at shutdown; the next start's recovery reissues it).
        scorer: the reward stage, run on each claim before its write (claim_reward.py); None writes the
        trajectories unscored (a producer of a test or of data that is scored elsewhere). routing: write
        each trajectory's `routed_experts` (the engine asks its servers for it: actor.router_replay=r3)."""
        if partial_rollout and weights is None:
            raise ValueError("partial rollouts need a WeightStore: a weight sync is what aborts a generation")
        if partial_rollout and routing:  # a continuation is a new request: its routing covers its segment only
            raise ValueError("routing replay (routing=True) cannot join aborted and continued samples' routing; "
                             "SGLang's producers pause generation in place instead")
        self.queue, self.engine, self.sampling = queue, engine, sampling
        self.producer_id, self.partition, self.weights = producer_id, partition, weights
        self.partial_rollout, self.fault_point, self.poll_s = partial_rollout, fault_point, poll_s
        self.stop, self.scorer, self.routing = stop, scorer, routing
        self._claims = 0

    @property
    def claim_prefix(self) -> str:
        return f"{self.producer_id}.{os.getpid()}."

    # -- one claim ----------------------------------------------------------------------------
    def run_once(self, max_prompts: int) -> int:
        """Claim up to `max_prompts` pending prompts, generate, score and write them; returns how many were
        written."""
        claim = self.generate_claim(max_prompts)
        return 0 if claim is None else self.write_claim(claim)

    def generate_claim(self, max_prompts: int) -> Claim | None:
        """Claim up to `max_prompts` pending prompts and generate them; None when nothing was pending or the
        producer is stopping (a claim made as it stops stays running: reissued at the next start)."""
        self._claims += 1
        token = f"{self.claim_prefix}{self._claims}"
        with self.queue.transaction():
            meta = self.queue.claim(self.partition, max_prompts)
            if len(meta):
                self.queue.put_fields(self.partition, meta.keys, {"claim": [token] * len(meta)})
        if not len(meta) or (self.stop is not None and self.stop.is_set()):
            return None
        keys = list(meta.keys)
        fields = self.queue.get(self.partition, keys, ["prompts", "seed",
                                                       *(self.scorer.prompt_fields if self.scorer else ())])
        groups = self.generate(keys, fields["prompts"], fields["seed"])
        faults.maybe_crash(self.fault_point, max(int(t["global_steps"]) for t in meta.tags))
        return Claim(keys, fields, groups, token)

    def write_claim(self, claim: Claim) -> int:
        """Score a generated claim (reward beside generation: the group is written with its scores) and write
        it; returns how many prompts were written (0 when stopping: the claim stays running)."""
        if self.stop is not None and self.stop.is_set():
            return 0
        scores = None
        if self.scorer is not None:
            scored = self.scorer.score(claim.fields, [[t.sample.response_token_ids for t in claim.groups[k]]
                                                      for k in claim.keys])
            scores = dict(zip(claim.keys, scored, strict=True))
        return self._write(claim.keys, claim.groups, claim.token, scores)

    def generate(self, keys: list[str], prompts: Sequence[list[int]], seeds: Sequence[int | None]
                 ) -> dict[str, list[Trajectory]]:
        """n trajectories per key; one engine call per sampling seed (a generation batch shares one)."""
        by_seed: dict[int | None, list[int]] = {}
        for i, seed in enumerate(seeds):
            by_seed.setdefault(seed, []).append(i)
        out: dict[str, list[Trajectory]] = {}
        for seed, rows in by_seed.items():
            inputs = [PromptInput(prompt_id=keys[i], token_ids=tuple(prompts[i])) for i in rows]
            trajs = self._sample(inputs, dataclasses.replace(self.sampling, seed=seed))
            for t in trajs:
                out.setdefault(t.sample.prompt_id, []).append(t)
        return out

    def _write(self, keys: list[str], groups: dict[str, list[Trajectory]], token: str,
               scores: dict[str, dict[str, list]] | None = None) -> int:
        q, part = self.queue, self.partition
        # R3: each row's routing to its own file first, so that the transaction references only whole files
        # (a row the transaction discards leaves a file no row names: queue/spool.py sweeps it)
        spooled = self._spool_routing(keys, groups, token) if self.routing else None
        with q.transaction():
            tags = q.get_tags(part, keys)
            claims = q.get(part, keys, ["claim"])["claim"]
            live = [k for k, t, c in zip(keys, tags, claims, strict=True) if t["status"] == "running" and c == token]
            if len(live) < len(keys):
                log.warning("%s: %d of %d claimed prompts were reissued meanwhile; their groups are discarded",
                            self.producer_id, len(keys) - len(live), len(keys))
            if not live:
                return 0
            steps = {k: int(t["global_steps"]) for k, t in zip(keys, tags, strict=True)}
            tkeys, rows, ttags = [], [], []
            for k in live:
                for j, t in enumerate(groups[k]):
                    s = t.sample
                    tkeys.append(trajectory_key(k, j))
                    rows.append(t)
                    ttags.append({"status": "done", "global_steps": steps[k], "policy_version": s.policy_version})
            fields = _trajectory_fields(rows)
            if spooled is not None:
                fields["routed_experts"] = [spooled[k][j] for k in live for j in range(len(groups[k]))]
            if scores is not None:
                names = [name for name in scores[live[0]] if name != "reward_keys"]
                fields.update({name: [v for k in live for v in scores[k][name]] for name in names})
            q.put(part, tkeys, fields, ttags)
            if scores is not None:
                q.put_fields(part, live, {"reward_keys": [scores[k]["reward_keys"] for k in live]})
            by_version: dict[int, list[str]] = {}
            for k in live:
                by_version.setdefault(max(t.sample.policy_version for t in groups[k]), []).append(k)
            for version, ks in by_version.items():
                q.update_tags(part, ks, status="done", policy_version=version)
        return len(live)

    def _spool_routing(self, keys: list[str], groups: dict[str, list[Trajectory]], token: str
                       ) -> dict[str, list[dict | None]]:
        """Each row's routing ([L_hf, P + L - 1, K] as the engine decoded it) in its own spool file, named
        by its trajectory key and this claim's token; per key, each row's reference (None: no routing)."""
        import hashlib

        from megatron_dapo.queue.spool import spool_dir, write_tensor

        directory, out = spool_dir(self.queue.path), {}
        for k in keys:
            out[k] = []
            for j, t in enumerate(groups[k]):
                r = t.sample.routed_experts
                name = hashlib.sha1(f"{trajectory_key(k, j)}|{token}".encode()).hexdigest() + ".routing"
                out[k].append(None if r is None else write_tensor(directory, name, r))
        return out

    # -- sampling with partial rollouts ---------------------------------------------------------
    def _sample(self, inputs: list[PromptInput], sampling: SamplingParams) -> list[Trajectory]:
        samples = self._call(inputs, sampling)
        trajs = [Trajectory(s, s.min_policy_version) for s in samples]
        while self.partial_rollout:
            todo = [i for i, t in enumerate(trajs) if t.sample.finish_reason == "abort"]
            if not todo:
                break
            self.refresh_weights()  # the weight sync that aborted the call
            trajs = self._continue(trajs, todo, sampling)
        return trajs

    def _continue(self, trajs: list[Trajectory], todo: list[int], sampling: SamplingParams) -> list[Trajectory]:
        """Continue the aborted trajectories `todo` with the engine's current weights (one call per
        remaining length); each continuation is its own prompt: the original prompt + tokens so far."""
        out = list(trajs)
        by_remaining: dict[int, list[int]] = {}
        for i in todo:
            s = trajs[i].sample
            by_remaining.setdefault(sampling.max_new_tokens - len(s.response_token_ids), []).append(i)
        for remaining, rows in by_remaining.items():
            inputs = [PromptInput(prompt_id=trajectory_key(trajs[i].sample.prompt_id, trajs[i].sample.sample_index),
                                  token_ids=trajs[i].sample.prompt_token_ids + trajs[i].sample.response_token_ids)
                      for i in rows]
            seed = None if sampling.seed is None else sampling.seed + 1_000_033 * (self.engine.policy_version + 1)
            done = sampling.max_new_tokens - remaining  # tokens each of these rows already has
            cont = self._call(inputs, dataclasses.replace(sampling, n=1, max_new_tokens=remaining, seed=seed,
                                                          min_new_tokens=max(0, sampling.min_new_tokens - done)))
            for i, c in zip(rows, cont, strict=True):
                s = trajs[i].sample
                out[i] = Trajectory(dataclasses.replace(
                    s, response_token_ids=s.response_token_ids + c.response_token_ids,
                    rollout_log_probs=s.rollout_log_probs + c.rollout_log_probs, finish_reason=c.finish_reason,
                    policy_version=c.policy_version, meta={**s.meta, "partial_segments": s.meta.get(
                        "partial_segments", 1) + 1}), trajs[i].min_policy_version)
        return out

    def _call(self, inputs: list[PromptInput], sampling: SamplingParams) -> list[Sample]:
        """engine.generate, with a watcher that aborts it when newer weights appear (partial rollouts)."""
        if not self.partial_rollout:
            return self.engine.generate(inputs, sampling)
        done = threading.Event()

        def watch():
            while not done.wait(self.poll_s):
                latest = self.weights.latest_version()
                if latest is not None and latest > self.engine.policy_version:
                    self.engine.abort()
                    return

        watcher = threading.Thread(target=watch, name=f"{self.producer_id}-abort-watch", daemon=True)
        watcher.start()
        try:
            return self.engine.generate(inputs, sampling)
        finally:
            done.set()
            watcher.join()

    def refresh_weights(self) -> bool:
        """Load the newest published weights into the engine if they are newer; True when loaded."""
        if self.weights is None:
            return False
        latest = self.weights.latest_version()
        if latest is None or latest <= self.engine.policy_version:
            return False
        try:
            tensors = self.weights.load(latest)
        except FileNotFoundError:  # pruned between listing and opening: a newer one exists
            return self.refresh_weights()
        self.engine.update_weights(tensors.items(), policy_version=latest)
        log.info("%s: loaded policy version %d", self.producer_id, latest)
        return True


def _trajectory_fields(rows: list[Trajectory]) -> dict[str, list]:
    return {
        "prompts": [torch.tensor(t.sample.prompt_token_ids, dtype=torch.int64) for t in rows],
        "responses": [torch.tensor(t.sample.response_token_ids, dtype=torch.int64) for t in rows],
        "rollout_log_probs": [torch.tensor(t.sample.rollout_log_probs, dtype=torch.float32) for t in rows],
        "finish_reason": [t.sample.finish_reason for t in rows],
        "min_policy_version": [t.min_policy_version for t in rows],
        "max_policy_version": [t.sample.policy_version for t in rows],
        "meta": [dict(t.sample.meta) for t in rows],
    }


def sampling_params(cfg, *, eos_id: int) -> SamplingParams:
    """Training-rollout sampling from the config; the seed comes per prompt from the queue."""
    r = cfg.rollout
    return SamplingParams(max_new_tokens=cfg.data.max_response_length, n=r.n, temperature=r.temperature,
                          top_p=r.top_p, top_k=r.top_k, stop_token_ids=(eos_id,), seed=None,
                          min_new_tokens=r.min_new_tokens)


# ------------------------------------------------------------------------------ producer processes


def as_own_world() -> None:
    """In a spawned producer process: no torchrun variables (it is a world of its own), and the kernel
    SIGKILLs it when the trainer that started it dies (PR_SET_PDEATHSIG, Linux)."""
    import ctypes
    import signal

    for var in _DIST_ENV:
        os.environ.pop(var, None)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def producer_main(cfg, queue: TransferQueue, producer_id: int, weights_dir: str, stop, parent_pid: int,
                  claim_size: int) -> None:
    """Body of a producer process (multiprocessing spawn): its own LocalEngine on the published weights.

    Runs until `stop` is set or the trainer process is gone (an orphan of a killed trainer exits
    by itself; its late writes are refused by the claim-token check anyway).
    """
    as_own_world()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s producer{producer_id} %(levelname)s %(message)s")
    from megatron_dapo.rewards.build import build_reward_manager

    engine, tokenizer = build_producer_engine(cfg)
    store = WeightStore(weights_dir)
    with build_reward_manager(cfg) as reward_manager:  # the reward stage runs here, beside generation
        producer = Producer(queue, engine, sampling=sampling_params(cfg, eos_id=tokenizer.eos_id),
                            producer_id=f"p{producer_id}", weights=store, partial_rollout=cfg.queue.partial_rollout,
                            fault_point="producer_generation", scorer=ClaimScorer(tokenizer, reward_manager))
        alive = lambda: not stop.is_set() and os.getppid() == parent_pid  # noqa: E731
        while alive() and store.latest_version() is None:
            stop.wait(0.05)
        while alive():
            producer.refresh_weights()
            if producer.run_once(claim_size) == 0:
                stop.wait(producer.poll_s)
    engine.close()


def build_producer_engine(cfg):
    """A single-process world with the actor's architecture and a LocalEngine on it (TP = PP = 1)."""
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.parallel import init_parallel
    from megatron_dapo.rollout.local_engine import LocalEngine
    from megatron_dapo.workers.build import build_model_chunks, model_arch

    pgs = init_parallel(seed=cfg.trainer.seed)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    chunks = build_model_chunks(cfg, model_arch(cfg, vocab_size=tokenizer.vocab_size), pgs, seed=cfg.trainer.seed)
    engine = LocalEngine(chunks[0], pgs=pgs, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    return engine, tokenizer


class ProducerPool:
    """`num` producer processes (spawn), restartable one by one when they die."""

    def __init__(self, cfg, queue: TransferQueue, *, weights_dir: str, num: int, claim_size: int,
                 max_restarts: int = 3):
        import multiprocessing as mp

        self._ctx = mp.get_context("spawn")
        self.cfg, self.queue, self.weights_dir = cfg, queue, weights_dir
        self.num, self.claim_size, self.max_restarts = num, claim_size, max_restarts
        self.stop_event = self._ctx.Event()
        self.procs: dict[int, object] = {}
        self.restarts = {i: 0 for i in range(num)}

    def start(self) -> None:
        for i in range(self.num):
            self._start(i)

    def _start(self, i: int) -> None:
        p = self._ctx.Process(target=producer_main, name=f"producer{i}", daemon=True,
                              args=(self.cfg, self.queue, i, self.weights_dir, self.stop_event, os.getpid(),
                                    self.claim_size))
        p.start()
        self.procs[i] = p

    def claim_prefix(self, i: int) -> str:
        return f"p{i}.{self.procs[i].pid}."

    def dead(self) -> list[tuple[int, int | None]]:
        """(producer id, exit code) of every producer that exited."""
        return [(i, p.exitcode) for i, p in self.procs.items() if not p.is_alive()]

    def restart(self, i: int, exitcode: int | None) -> None:
        self.restarts[i] += 1
        if self.restarts[i] > self.max_restarts:
            raise RuntimeError(f"producer {i} died {self.restarts[i]} times (last exit code {exitcode}); "
                               f"see its log lines above")
        log.warning("producer %d exited with code %s; restarting it (%d/%d)", i, exitcode, self.restarts[i],
                    self.max_restarts)
        self._start(i)

    def close(self, timeout_s: float = 10.0) -> None:
        self.stop_event.set()
        for p in self.procs.values():
            p.join(timeout_s)
            if p.is_alive():  # stuck in a long generation: it is ours, end it
                p.kill()
                p.join()


def reissue_claims(queue: TransferQueue, claim_prefix: str, *, global_steps: int,
                   partition: str = TRAIN_PARTITION) -> list[str]:
    """Put the prompts still `running` under claims starting with `claim_prefix` (a dead producer's)
    back to pending; returns their keys. Writes nothing for them had been committed (writes are atomic)."""
    with queue.transaction():
        running = queue.list_keys(partition, is_prompt=True, status="running")
        if not running:
            return []
        claims = queue.get(partition, running, ["claim"])["claim"]
        keys = [k for k, c in zip(running, claims, strict=True) if isinstance(c, str) and c.startswith(claim_prefix)]
        if keys:
            queue.delete_trajectories(partition, keys)
            queue.update_tags(partition, keys, status="pending", global_steps=global_steps)
    return keys

