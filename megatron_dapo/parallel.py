"""Parallel setup: the ONLY module that reads Megatron's global `parallel_state`.

`init_parallel(tp, pp, ep, cp, etp, vpp)` starts torch.distributed from the torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or as a single-process
world on a free loopback port when those are absent, initialises Megatron's model-parallel
groups, seeds, and returns a frozen `ParallelGroups`. Everything below the workers receives
that object (or single groups from it) as an argument; `pgs.collection` is Megatron's own
`ProcessGroupCollection`, to pass as `pg_collection=` to GPTModel, DDP and the schedules.

Backend: gloo on CPU (and then the CPU compatibility layer is installed), NCCL on CUDA.

Megatron's rank order is "tp-cp-ep-dp-pp": TP ranks are adjacent, PP is outermost. Dense
parameters are replicated over dp (which contains ep); expert parameters over expert-dp,
where world = etp * ep * expert_dp * pp.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ParallelGroups", "init_parallel", "validate_parallel_sizes", "destroy_parallel",
           "current_parallel_groups", "seed_parallel_rng"]

_CURRENT: ParallelGroups | None = None
CONTROL_TIMEOUT = datetime.timedelta(days=7)
"""Timeout of `ParallelGroups.ctrl`: no generation batch takes a week, and when a rank dies torchrun's
agent stops the others, so a wait on this group never outlives a crash."""
_OWNS_WORLD = False          # True when init_parallel created the default process group


@dataclass(frozen=True)
class ParallelGroups:
    """Process groups and this rank's coordinates in them (built once by init_parallel)."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    ep: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    """Dense data parallel (without CP); contains the EP dimension."""
    dp_cp: dist.ProcessGroup
    """Data x context parallel: where dense gradients and token counts are reduced."""
    expt_tp: dist.ProcessGroup
    expt_dp: dist.ProcessGroup
    """Replicas of this rank's experts: where expert gradients are reduced."""
    mp: dist.ProcessGroup
    """Model parallel (tp x pp): one full model replica."""
    embd: dist.ProcessGroup | None
    """First and last PP stage (tied-embedding gradient sync); None when PP == 1."""
    ctrl: dist.ProcessGroup
    """The whole world on gloo with CONTROL_TIMEOUT: host-side traffic that may wait a long time (rank 0's
    rollout results and errors, reward gathers, weight-sync turn taking). A gloo group, so NCCL's
    watchdog never fires while rank 0 waits on the servers."""
    collection: object
    """megatron.core.process_groups_config.ProcessGroupCollection with all of the above."""
    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    ep_rank: int
    ep_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int
    etp_rank: int
    etp_size: int
    expt_dp_rank: int
    expt_dp_size: int
    vpp_size: int | None
    """Virtual pipeline stages per rank (interleaved 1F1B), or None."""
    backend: str
    """"gloo" or "nccl"."""
    device: torch.device
    """Where this rank's model lives: cpu, or cuda:LOCAL_RANK."""

    @property
    def is_first_pp_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def sizes(self) -> dict[str, int | None]:
        """The sizes init_parallel was called with (for comparisons and logging)."""
        return {"tp": self.tp_size, "pp": self.pp_size, "ep": self.ep_size, "cp": self.cp_size,
                "etp": self.etp_size, "vpp": self.vpp_size}


def validate_parallel_sizes(world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
                            etp: int | None = None) -> tuple[int, int]:
    """Check that the sizes tile the world; return (dp, expert_dp).

    Raises ValueError naming the size that does not fit.
    """
    etp = tp if etp is None else etp
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("ep", ep),
                        ("cp", cp), ("etp", etp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"parallel size {name} must be a positive int, got {value!r}")
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"world_size={world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}")
    dp = world_size // (tp * pp * cp)
    if world_size % (etp * ep * pp):
        raise ValueError(
            f"world_size={world_size} is not divisible by etp*ep*pp = {etp}*{ep}*{pp} = "
            f"{etp * ep * pp} (expert layout; etp defaults to tp)")
    return dp, world_size // (etp * ep * pp)


def listen_on(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket bound to the address `host` resolves to, not to every interface. A taken port
    raises RuntimeError("Address already in use"), as torch's own store does."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise RuntimeError("Address already in use" if exc.errno == errno.EADDRINUSE else str(exc)) from exc
    return sock


def bound_tcp_store(host: str, world_size: int, *, timeout: datetime.timedelta,
                    wait_for_workers: bool = True) -> dist.TCPStore:
    """A TCPStore server that listens on `host` only, on a free port (`store.port`). Given just a port,
    torch's store listens on every interface, where anyone on the network could read and write the
    rendezvous keys; here it gets a socket already bound to `host` (master_listen_fd)."""
    sock = listen_on(host)
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=wait_for_workers,
                         master_listen_fd=sock.detach())  # the store owns the descriptor from here


def _start_world(backend: str, timeout_minutes: int) -> tuple[int, int, int]:
    """Start the default process group if needed; return (rank, world_size, local_rank)."""
    global _OWNS_WORLD
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"torchrun environment incomplete: {missing} not set")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timeout)
    else:
        # A plain Python process: a world of one, its store listening on loopback only.
        rank, world, local_rank = 0, 1, 0
        dist.init_process_group(backend, store=bound_tcp_store("127.0.0.1", 1, timeout=timeout), rank=0,
                                world_size=1, timeout=timeout)
    _OWNS_WORLD = True
    atexit.register(_destroy_at_exit)
    return rank, world, local_rank


def _destroy_at_exit() -> None:
    """Destroy the groups this process created before the interpreter tears down: a gloo group left
    to the C++ destructors at exit can abort the process ("terminate called without an active
    exception", exit code -6) after all its work succeeded."""
    if _OWNS_WORLD and dist.is_initialized():
        try:
            destroy_parallel(destroy_world=True)
        except Exception:  # noqa: BLE001 - exiting anyway; never mask the real exit status
            pass


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, etp: int | None = None,
                  vpp: int | None = None, *, backend: str | None = None, seed: int = 1234,
                  timeout_minutes: int = 30) -> ParallelGroups:
    """Initialise torch.distributed and Megatron's model-parallel groups; return the groups.

    Calling it again with the same sizes returns the same object; different sizes raise
    until `destroy_parallel()` is called. `backend=None` picks nccl when CUDA is available,
    else gloo (and installs `models.cpu_compat`). `seed` seeds torch and Megatron's RNG tracker.
    """
    global _CURRENT
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    if vpp is not None and (not isinstance(vpp, int) or vpp < 2 or pp < 2):
        raise ValueError(f"vpp must be None or an int >= 2 with pp >= 2, got vpp={vpp}, pp={pp}")
    requested = {"tp": tp, "pp": pp, "ep": ep, "cp": cp, "etp": tp if etp is None else etp, "vpp": vpp}
    if _CURRENT is not None:
        if _CURRENT.sizes() != requested:
            raise ValueError(f"parallel state already initialised with {_CURRENT.sizes()}; "
                             f"call destroy_parallel() before init_parallel({requested})")
        return _CURRENT
    if ps.model_parallel_is_initialized():
        raise ValueError("Megatron parallel_state was initialised outside init_parallel(); "
                         "call destroy_parallel() first")

    if backend is None and dist.is_initialized():       # someone else started the world
        backend = dist.get_backend()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "gloo":
        from megatron_dapo.models import cpu_compat
        cpu_compat.install()
    rank, world, local_rank = _start_world(backend, timeout_minutes)
    validate_parallel_sizes(world, tp, pp, ep, cp, etp)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes)
    collection = ProcessGroupCollection.use_mpu_process_groups()
    ctrl = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    pgs = ParallelGroups(
        tp=collection.tp, pp=collection.pp, ep=collection.ep, cp=collection.cp, dp=collection.dp,
        dp_cp=collection.dp_cp, expt_tp=collection.expt_tp, expt_dp=collection.expt_dp,
        mp=collection.mp, embd=collection.embd if pp > 1 else None, ctrl=ctrl, collection=collection,
        rank=rank, world_size=world, local_rank=local_rank,
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp,
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep,
        cp_rank=ps.get_context_parallel_rank(), cp_size=cp,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        expt_dp_rank=ps.get_expert_data_parallel_rank(),
        expt_dp_size=ps.get_expert_data_parallel_world_size(),
        vpp_size=vpp, backend=backend, device=device)
    _CURRENT = pgs
    seed_parallel_rng(pgs, seed)
    return pgs


def seed_parallel_rng(pgs: ParallelGroups, seed: int) -> None:
    """Seed torch and Megatron's RNG tracker (model-parallel, expert-parallel and data streams).

    On CPU the tracker is Megatron's inference tracker (fork() is a no-op; see cpu_compat).
    """
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    torch.manual_seed(seed)
    cpu = pgs.device.type == "cpu"
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=cpu, force_reset_rng=cpu,
                                    tp_rank=pgs.tp_rank, ep_rank=pgs.ep_rank,
                                    etp_rank=pgs.etp_rank)


def current_parallel_groups() -> ParallelGroups | None:
    """The groups of the last init_parallel() in this process, or None."""
    return _CURRENT


def destroy_parallel(*, destroy_world: bool = False) -> None:
    """Tear down Megatron's model-parallel groups (so init_parallel can run with new sizes).

    `destroy_world=True` also destroys the default process group if init_parallel created it.
    """
    global _CURRENT, _OWNS_WORLD
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    if _CURRENT is not None and dist.is_initialized():
        dist.destroy_process_group(_CURRENT.ctrl)
    _CURRENT = None
    if destroy_world and _OWNS_WORLD and dist.is_initialized():
        dist.destroy_process_group()
        _OWNS_WORLD = False
