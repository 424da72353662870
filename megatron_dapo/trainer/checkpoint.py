"""Checkpoints: Megatron distributed checkpoint of model + optimizer, plus the trainer state.

Layout under the checkpoint directory:
    global_step_<k>/model/           megatron dist_checkpointing (model + optimizer, sharded per rank)
    global_step_<k>/trainer_state.pt step, sampler, LR scheduler, KL controller, RNG (torch.save of
                                     tensors / numbers / lists only: loaded with weights_only=True)
    global_step_<k>/manifest.json    every other file's size and SHA-256 (JSON: read without unpickling)
    latest_checkpointed_iteration.txt
    inflight/                        the dynamic-sampling buffer of the step in progress (see fit):
        part_<i>.pt                  the groups kept from generation batch i, ragged (real tokens only),
                                     each written once, when it is new
        state.pt                     the step, the buffer's counters, the sampler and how many parts
                                     belong to it; written after the parts, so a part it does not
                                     count (a crash between the two) is ignored and overwritten

A checkpoint is written into `tmp_global_step_<k>` and renamed into place when complete, and the
`latest` file is replaced atomically after that: a crash mid-write never replaces the last good
checkpoint. Only the newest `max_ckpt_to_keep` are kept.

The manifest is written last, before the rename; the ranks hash the files in parallel (file i by rank
i mod world size; SHA-256 runs at about 1-2 GB/s per core with the SHA extensions of current x86 CPUs,
benchmarks/bench_checkpoint_manifest.py). A resume (`newest_verified`) checks every file's size and
digest before anything is unpickled, and takes the newest step directory that verifies, whatever the
`latest` file says (it may be missing, name a missing directory, or lag a rename): a corrupted or
truncated file is named in the log and the run falls back to the checkpoint before. Directories written
before manifests existed are accepted with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import pickle
import queue
import shutil
import struct
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_dapo.models.forward import unwrap_model
from megatron_dapo.trainer import faults

LATEST = "latest_checkpointed_iteration.txt"
INFLIGHT = "inflight"
_INFLIGHT_STATE = "state.pt"
MANIFEST = "manifest.json"
HASH = "sha256"
_CHUNK = 16 * 2**20

log = logging.getLogger(__name__)


class CheckpointCorrupt(RuntimeError):
    """No checkpoint directory verifies against its manifest; the message names the files."""


def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def latest_step(root: str) -> int | None:
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit() or not os.path.isdir(step_dir(root, int(text))):
        raise RuntimeError(f"{path} names step {text!r} but {step_dir(root, int(text) if text.isdigit() else 0)} "
                           "is missing: the checkpoint directory is damaged")
    return int(text)


def optimizer_has_state(opt) -> bool:
    """Whether the optimizer took a step (Adam's moments exist): none before the first update, e.g. during
    trainer.critic_warmup or when dynamic sampling kept nothing."""
    return any(len(getattr(getattr(o, "optimizer", o), "state", {})) > 0
               for o in getattr(opt, "chained_optimizers", [opt]))


def _sharded_state_dict(actor, *, is_loading: bool = False, with_optimizer: bool = True) -> dict:
    chunks = actor.policy.chunks
    model_sd = {}
    # The data-parallel group passed explicitly: GPTModel.sharded_state_dict reads metadata['dp_cp_group']
    # itself when its MTP layers sit on a later pipeline stage than the embedding (gpt_model.py:842), and
    # crashes on the default metadata=None.
    metadata = {"dp_cp_group": actor.policy.pgs.dp_cp}
    for i, c in enumerate(chunks):
        model_sd[f"model{i}" if len(chunks) > 1 else "model"] = unwrap_model(c).sharded_state_dict(metadata=metadata)
    if not with_optimizer:
        return model_sd
    # is_loading: a fresh optimizer has no Adam state yet; Megatron then builds the template from
    # initialised states, otherwise the loaded checkpoint would silently bring no moments.
    opt_sd = actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return {**model_sd, "optimizer": opt_sd}


def _die_with_parent() -> None:
    """In a helper process: the kernel SIGKILLs it when the process that started it dies (Linux)."""
    import ctypes
    import signal as _signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(_signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


class WriteResultsFile:
    """The queue Megatron's checkpoint writer reports its write results on (`filesystem_async._results_queue`).

    Megatron makes a `multiprocessing.Manager().Queue()` at the first save (`_get_write_results_queue`): a
    Manager server process started with "spawn", which re-imports the trainer's main module, outlives a
    trainer killed with SIGKILL, and imports torch the first time it unpickles a result (2-3 s of a core per
    rank at every trainer start). Its only use is one `put` by the process that ran the writes (the trainer
    itself in a synchronous save, the helper it forked in an asynchronous one) and one `get_nowait` by the
    trainer once that process has finished. So an unlinked temporary file does the same: `put` appends a
    length-prefixed pickle (O_APPEND: a forked helper shares the open file), `get_nowait` reads the next one
    from the trainer's own read position. Nothing is left behind, whatever kills the trainer; each save
    starts from an empty file (`reset`; one save is in flight at a time)."""

    _HEADER = struct.Struct("<Q")

    def __init__(self):
        fd, path = tempfile.mkstemp(prefix="megatron_dapo-checkpoint-results-")
        os.unlink(path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        self._fd, self._read = fd, 0

    def put(self, obj, block: bool = True, timeout: float | None = None) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(self._HEADER.pack(len(data)) + data)
        while view:  # one writer at a time: a short write is continued where it stopped
            view = view[os.write(self._fd, view):]

    def get_nowait(self):
        header = self._pread(self._HEADER.size, self._read)
        if len(header) < self._HEADER.size:
            raise queue.Empty
        (size,) = self._HEADER.unpack(header)
        data = self._pread(size, self._read + self._HEADER.size)
        if len(data) < size:
            raise RuntimeError(f"the checkpoint writer's results are truncated ({len(data)} of {size} bytes)")
        self._read += self._HEADER.size + size
        return pickle.loads(data)

    def get(self, block: bool = True, timeout: float | None = None):
        return self.get_nowait()  # read only after the writing process finished: there is nothing to wait for

    def empty(self) -> bool:
        return len(self._pread(1, self._read)) == 0

    def reset(self) -> None:
        os.ftruncate(self._fd, 0)
        self._read = 0

    def _pread(self, size: int, offset: int) -> bytes:
        parts = []
        while size > 0:
            chunk = os.pread(self._fd, size, offset)
            if not chunk:
                break
            parts.append(chunk)
            size, offset = size - len(chunk), offset + len(chunk)
        return b"".join(parts)


def _writer_results_file() -> None:
    """Megatron's checkpoint writer reports through a `WriteResultsFile` of this process (made at the first
    save, emptied at each), never through a Manager server process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if not hasattr(fa, "_results_queue"):  # a release without it: nothing to replace
        return
    if isinstance(fa._results_queue, WriteResultsFile):
        fa._results_queue.reset()
    else:
        fa._results_queue = WriteResultsFile()


def save_checkpoint(root: str, step: int, *, actor, trainer_state: dict, keep: int, is_rank0: bool,
                    background: bool = False) -> str | PendingSave:
    """Write checkpoint `step` atomically; returns its directory. With `background` (trainer.async_save) the
    model and optimizer shards are written by a helper process while training goes on, and a PendingSave
    is returned: its `finish()` (a collective) completes the checkpoint (see PendingSave)."""
    from megatron.core import dist_checkpointing

    _writer_results_file()
    final, tmp = step_dir(root, step), os.path.join(root, f"tmp_global_step_{step}")
    if is_rank0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "model"))
    _barrier()
    pending = PendingSave(root, step, keep=keep, is_rank0=is_rank0)
    try:
        request = dist_checkpointing.save(_sharded_state_dict(actor), os.path.join(tmp, "model"),
                                          async_sharded_save=background)
        if is_rank0:
            torch.save(trainer_state, os.path.join(tmp, "trainer_state.pt"))
        if background:
            pending.start(request)
            return pending
        faults.maybe_crash("checkpoint_write", step)
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        pending.abandon()
        raise _write_failed(exc, root, tmp) from exc
    pending.complete()
    return final


def _write_in_background(fn, args, kwargs, files: list[str], directory: str, digests, step: int) -> None:
    """The helper process of an asynchronous save: it dies with the trainer, writes the shards, then hashes
    the files it wrote for the manifest (sent on `digests`, so the trainer does not hash them while it
    waits); a failure is its exit code."""
    _die_with_parent()
    if faults.armed("background_write", step):  # the trainer dies mid-save: so must this process, at once
        os.kill(os.getppid(), 9)
        time.sleep(60)
    try:
        fn(*args, **kwargs)
        digests.send({os.path.relpath(f, directory): _entry(f) for f in files})
    except BaseException:  # noqa: BLE001 - reported to the trainer as the exit code; the trace goes to stderr
        log.exception("checkpoint writer failed")
        os._exit(1)
    os._exit(0)


class PendingSave:
    """A checkpoint in `tmp_global_step_<k>` whose shards a helper process is writing (trainer.async_save).

    Training goes on meanwhile: the helper was forked once the shards were staged in host memory (a copy
    from the GPU, or on CPU the fork's copy-on-write snapshot), so later optimizer steps do not reach it.
    `done()` asks every rank whether its helper has ended (a collective); `finish()` (a collective) waits
    for the helpers, then does what a synchronous save does after the shards: Megatron's metadata, the
    manifest, the rename and the `latest` file. Until then the previous checkpoint is the last good one; a
    crash leaves the torn directory, which the next start removes (`remove_torn`).
    """

    def __init__(self, root: str, step: int, *, keep: int, is_rank0: bool):
        self.root, self.step, self.keep, self.is_rank0 = root, step, keep, is_rank0
        self.final, self.tmp = step_dir(root, step), os.path.join(root, f"tmp_global_step_{step}")
        self._process = None
        self._finalize_fns: list = []
        self._digests = None  # the helper's end of a pipe: the digests of the files it wrote
        self._known: dict = {}

    def start(self, request) -> None:
        import multiprocessing as mp

        args = list(request.async_fn_args)
        if request.preload_fn is not None:  # stage the shards in host memory before the fork
            args[1] = request.preload_fn()
        self._finalize_fns = list(request.finalize_fns)
        if request.async_fn is not None:
            files = [bucket[0] for bucket in args[1]]  # Megatron's write buckets: (path, name, data)
            ctx = mp.get_context("fork")
            self._digests, sender = ctx.Pipe(duplex=False)
            self._process = ctx.Process(target=_write_in_background, daemon=False,
                                        args=(request.async_fn, args, request.async_fn_kwargs, files, self.tmp,
                                              sender, self.step))
            self._process.start()
            sender.close()

    def done(self) -> bool:
        """Whether every rank's helper has ended (a collective: every rank calls it at the same point)."""
        local = self._process is None or not self._process.is_alive()
        return all(_gather(local))

    def finish(self) -> str:
        """Wait for the helpers and complete the checkpoint (a collective); returns its directory. Raises
        CheckpointWriteError, after removing the torn directory, when a helper failed."""
        failed = None
        try:
            if self._process is not None:
                self._process.join()
                if self._process.exitcode != 0:
                    raise RuntimeError(f"the checkpoint writer process exited with code {self._process.exitcode}")
                self._known = self._digests.recv()
                self._digests.close()
            faults.maybe_crash("checkpoint_write", self.step)
        except (Exception, CheckpointException) as exc:
            failed = exc
        problems = _gather(None if failed is None else f"{type(failed).__name__}: {failed}")
        if any(problems):  # on every rank, whichever rank's writer failed
            exc = failed or RuntimeError(next(p for p in problems if p))
            raise _write_failed(exc, self.root, self.tmp) from failed
        return self.complete()

    def complete(self) -> str:
        """After the shards: Megatron's finalization (metadata), the manifest, the rename, `latest`, pruning."""
        try:
            for fn in self._finalize_fns:
                fn()
            _barrier()
            write_manifest(self.tmp, is_rank0=self.is_rank0, known=self._known)
        except (Exception, CheckpointException) as exc:
            raise _write_failed(exc, self.root, self.tmp) from exc
        _barrier()
        if self.is_rank0:
            shutil.rmtree(self.final, ignore_errors=True)
            os.replace(self.tmp, self.final)
            _atomic_write_text(os.path.join(self.root, LATEST), str(self.step))
            _prune(self.root, self.keep, written=self.step)
        _barrier()
        return self.final

    def abandon(self) -> None:
        """Stop the helper (a run that fails or is interrupted); the torn directory stays for the next start."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join()


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message names the directory and, for a full disk, says so
    (`disk_full`)."""

    def __init__(self, message: str, *, disk_full: bool):
        super().__init__(message)
        self.disk_full = disk_full


_FULL_BYTES = 64 * 2**20  # a filesystem with less free space than this after a failed write is full


def _write_failed(exc: BaseException, root: str, tmp: str) -> CheckpointWriteError:
    """The error for a save that failed: its torn directory is removed (the last good checkpoint stays the
    newest), and a full disk is named as such. Megatron's shard writers report one only as a short write
    ("unexpected pos ..."), so besides ENOSPC / EDQUOT anywhere in the chain, the free space decides."""
    free = shutil.disk_usage(root).free
    chain, cause = [], exc
    while cause is not None and len(chain) < 16:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    full = free < _FULL_BYTES or any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain)
    shutil.rmtree(tmp, ignore_errors=True)
    marker = os.path.join(root, LATEST)
    last = open(marker).read().strip() if os.path.isfile(marker) else None
    last = f"global_step_{last}" if last else "none"
    said = ([line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__])[-1]
    what = f"No space left on device ({free / 2**20:.1f} MiB free)" if full else f"{type(exc).__name__}: {said}"
    return CheckpointWriteError(f"writing checkpoint {tmp}: {what}; the incomplete directory was removed, the last "
                                f"good checkpoint is {last}" + (f" (the writer said: {said})" if full else ""),
                                disk_full=full)


def remove_torn(root: str) -> list[str]:
    """Remove the tmp_global_step_* directories of saves that never completed (a crash or kill mid-save);
    returns them. Rank 0, before a run writes its own."""
    if not os.path.isdir(root):
        return []
    torn = sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("tmp_global_step_"))
    for path in torn:
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s, left by a save that did not complete", path)
    return torn


def _prune(root: str, keep: int, *, written: int) -> None:
    """Keep the newest `keep` step directories; never the one just `written` (a resume from an explicit
    path may write below steps already there)."""
    steps = sorted(int(d.split("_")[-1]) for d in os.listdir(root)
                   if d.startswith("global_step_") and d.split("_")[-1].isdigit())
    for s in steps[:-keep]:
        if s != written:
            shutil.rmtree(step_dir(root, s), ignore_errors=True)


def load_checkpoint(path: str, *, actor) -> dict:
    """Load model + optimizer into `actor` from a step directory; returns the trainer state."""
    from megatron.core import dist_checkpointing

    trainer_state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
    # Written before the optimizer's first step, a checkpoint holds no Adam moments, which the load template
    # of a stepped optimizer would ask for: load the model alone, the optimizer starts as fresh as it was.
    stepped = trainer_state.get("optimizer_stepped", bool(trainer_state.get("loss_history")))
    if stepped:
        prepare_distributed_optimizer_for_load(actor.optimizer)
    state = dist_checkpointing.load(_sharded_state_dict(actor, is_loading=True, with_optimizer=stepped),
                                    os.path.join(path, "model"))
    chunks = actor.policy.chunks
    for i, c in enumerate(chunks):
        unwrap_model(c).load_state_dict(state[f"model{i}" if len(chunks) > 1 else "model"])
    if stepped:
        with torch.no_grad():  # fp32 distributed optimizer: main params are views of model params
            actor.optimizer.load_state_dict(state["optimizer"])
        fix_distributed_optimizer_step_after_load(actor.optimizer, state["optimizer"])
    else:
        actor.optimizer.reload_model_params()  # main (fp32) copies of the loaded weights, for mixed precision
    return trainer_state


def prepare_distributed_optimizer_for_load(opt) -> None:
    """The distributed optimizer's load template needs optimizer state to exist (a fresh one has none)."""
    for o in getattr(opt, "chained_optimizers", [opt]):
        if hasattr(o, "_init_optimizer_states_with_dummy_values"):
            o._init_optimizer_states_with_dummy_values()


def fix_distributed_optimizer_step_after_load(opt, loaded: dict) -> None:
    """torch's AdamW fallback shares one `step` tensor across params after a distributed-optimizer load,
    so it would advance once per param: give each param its own step with the saved value (notes, item 5)."""
    chained = getattr(opt, "chained_optimizers", [opt])
    states = [loaded[k] for k in sorted(loaded)] if len(chained) > 1 else [loaded]
    for o, s_ in zip(chained, states):
        if hasattr(o, "_init_optimizer_states_with_dummy_values"):
            step = float(s_["optimizer"]["param_groups"][0]["step"])
            for s in o.optimizer.state.values():
                s["step"] = torch.tensor(step)


def save_inflight(root: str, state: dict, new_parts: list[dict], *, first: int) -> None:
    """The in-flight buffer of the step in progress: `new_parts` are parts first, first + 1, ... (the
    parts before `first` are on disk already, from this step's earlier calls), then `state` with the part
    count. Each generation batch's kept groups are thus written once, not again with every later batch."""
    where = os.path.join(root, INFLIGHT)
    if first == 0:
        clear_inflight(root)  # another step's parts must not mix with this one's
    os.makedirs(where, exist_ok=True)
    for i, part in enumerate(new_parts, start=first):
        _atomic_torch_save(part, os.path.join(where, f"part_{i}.pt"))
    _atomic_torch_save({**state, "num_parts": first + len(new_parts)}, os.path.join(where, _INFLIGHT_STATE))


def load_inflight(root: str) -> tuple[dict, list[dict]] | None:
    """(state, parts) as save_inflight wrote them, or None when no step was in progress."""
    where = os.path.join(root, INFLIGHT)
    path = os.path.join(where, _INFLIGHT_STATE)
    if not os.path.exists(path):
        return None
    state = torch.load(path, weights_only=True)
    parts = [torch.load(os.path.join(where, f"part_{i}.pt"), weights_only=True) for i in range(int(state["num_parts"]))]
    return state, parts


def clear_inflight(root: str) -> None:
    shutil.rmtree(os.path.join(root, INFLIGHT), ignore_errors=True)


def _files(directory: str) -> list[str]:
    """Every regular file under `directory` but the manifest, as sorted relative paths."""
    out = []
    for base, _, names in os.walk(directory):
        out += [os.path.relpath(os.path.join(base, n), directory) for n in names]
    return sorted(f for f in out if f != MANIFEST)


def _digest(path: str) -> str:
    h = hashlib.new(HASH)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _entry(path: str) -> dict:
    return {"size": os.path.getsize(path), HASH: _digest(path)}


def write_manifest(directory: str, *, is_rank0: bool, known: dict | None = None) -> None:
    """Hash the directory's files (shared over the ranks: a collective) and write manifest.json on rank 0.
    `known`: entries this rank already has (an asynchronous save's writer hashed what it wrote)."""
    rank, world = _rank_world()
    known = dict(known or {})
    files = [f for f in _files(directory) if f not in known]
    mine = {**known, **{f: _entry(os.path.join(directory, f)) for f in files[rank::world]}}
    entries = {}
    for part in _gather(mine):
        entries.update(part)
    if is_rank0:
        _atomic_write_text(os.path.join(directory, MANIFEST),
                           json.dumps({"algorithm": HASH, "files": dict(sorted(entries.items()))}, indent=0))


def verify_checkpoint(directory: str) -> str | None:
    """None when every file the manifest lists has its size and digest (a collective: each rank checks its
    share), else what is wrong, naming the file; "no manifest" for a directory written without one."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return "no manifest"
    try:
        with open(path) as f:
            listed = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"{path}: unreadable manifest ({type(e).__name__}: {e})"
        return next(p for p in _gather(problem) if p)
    rank, world = _rank_world()
    problem = None
    for name in sorted(listed)[rank::world]:
        file, want = os.path.join(directory, name), listed[name]
        if not os.path.isfile(file):
            problem = f"{file} is missing"
        elif os.path.getsize(file) != want["size"]:
            problem = f"{file} has {os.path.getsize(file)} bytes, the manifest {want['size']} (truncated or overwritten)"
        elif _digest(file) != want[HASH]:
            problem = f"{file} does not match its {HASH} in the manifest (corrupted)"
        if problem:
            break
    return next((p for p in _gather(problem) if p), None)


def newest_verified(root: str) -> str | None:
    """The newest global_step_<k> under `root` that verifies (see the module docstring); None when there
    is none. A collective: every rank must call it. Raises CheckpointCorrupt when step directories exist
    but none verifies."""
    if not os.path.isdir(root):
        return None
    steps = sorted((int(d.split("_")[-1]) for d in os.listdir(root)
                    if d.startswith("global_step_") and d.split("_")[-1].isdigit()), reverse=True)
    marker = os.path.join(root, LATEST)
    named = None
    if os.path.isfile(marker):
        with open(marker) as f:
            named = f.read().strip()
    rejected = []
    for step in steps:
        path = step_dir(root, step)
        problem = verify_checkpoint(path)
        if problem == "no manifest":
            log.warning("%s has no manifest (written before checkpoints carried one): resuming without verifying", path)
            problem = None
        if problem is None:
            if rejected or named != str(step):
                log.warning("resuming from %s: %s names %s%s", path, LATEST, named if named is not None else "nothing",
                            "".join(f"; skipped {r}" for r in rejected))
            return path
        log.error("checkpoint %s fails verification: %s", path, problem)
        rejected.append(f"{path} ({problem})")
    if rejected:
        raise CheckpointCorrupt("no checkpoint under " + root + " verifies: " + "; ".join(rejected))
    return None


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
