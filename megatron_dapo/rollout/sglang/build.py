"""SGLang from a Config: the servers launched (or given), the connected engine rank 0 drives, and the
per-step weight push into them. The one module the trainer's composition root (trainer/run.py) calls for
rollout.engine=sglang; what each piece does lives in this package (server.py, engine.py, control.py,
sync.py, drafter.py, autospec.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import torch

from megatron_dapo.config import Config, ConfigError

log = logging.getLogger("megatron_dapo")


@dataclasses.dataclass
class _PushParts:
    """What the weight push reads of the trainer's parts."""

    pgs: object
    engine: object
    chunks: list
    vocab_size: int
    free_memory: object


def build_engine(cfg: Config, pgs, *, vocab_size: int):
    """SGLang servers (given by rollout.sglang_urls, or launched here: launch_sglang) driven by rank 0, as
    the engine every rank calls (rollout/rank0.py). What no SGLang release can draft fails before any
    server starts."""
    from megatron_dapo.rollout.rank0 import RankZeroEngine

    _drafter(cfg, vocab_size=vocab_size)
    r = cfg.rollout
    engine, servers = None, []
    if pgs.rank == 0:
        servers = [] if r.sglang_urls else launch_sglang(cfg)
        engine = connect(cfg, list(r.sglang_urls) or _urls(servers), servers)
    return RankZeroEngine(engine, rank=pgs.rank, world_size=pgs.world_size, group=pgs.ctrl, servers=servers)


def _urls(servers) -> list[str]:
    return [u for s in servers for u in getattr(s, "urls", [getattr(s, "url", None)])]


def connect(cfg: Config, urls: list[str], servers=()):
    """The engine over `urls`; `servers`: the ones this trainer launched, restarted when they die
    (rollout.restart_servers)."""
    from megatron_dapo.rollout.sglang.engine import SGLangEngine

    r = cfg.rollout
    engine = SGLangEngine(urls, max_concurrency=r.max_concurrency, request_timeout_s=r.request_timeout_s,
                          max_retries=r.max_retries, tp_size=r.tensor_model_parallel_size,
                          require_deterministic=r.deterministic_inference,
                          require_memory_saver=r.mode == "colocate" and r.require_memory_saver,
                          health_check_interval_s=r.health_check_interval_s,
                          server_down_timeout_s=r.server_down_timeout_s,
                          restart=_restarter(servers) if servers and r.restart_servers else None,
                          stop_server=_stopper(servers) if servers and r.restart_servers else None,
                          return_routed_experts=routing_layout(cfg))
    try:
        check_served_model(cfg, engine.model_identity)
    except BaseException:
        engine.close()
        raise
    return engine


def routing_layout(cfg: Config):
    """actor.router_replay=r3: the model's router layout every request asks SGLang for; else None."""
    if cfg.actor.router_replay != "r3":
        return None
    from megatron_dapo.models.config_arch import model_arch
    from megatron_dapo.rollout.sglang.routing import RoutingLayout

    arch = model_arch(cfg, vocab_size=0)
    return RoutingLayout(num_layers=arch.num_layers, top_k=arch.moe_router_topk, num_experts=arch.num_moe_experts)


def check_served_model(cfg: Config, served: tuple | None) -> None:
    """The servers serve the actor's model: the model_type and architectures they report in /model_info
    equal those of model.hf_path's config.json (when it is a local checkpoint and they report them)."""
    import json

    path = os.path.join(cfg.model.hf_path, "config.json") if cfg.model.hf_path else ""
    if served is None or served[0] is None or not os.path.isfile(path):
        return
    with open(path) as f:
        hf = json.load(f)
    want = (hf.get("model_type"), tuple(hf.get("architectures") or ()))
    if served[0] != want[0] or (served[1] and want[1] and tuple(served[1]) != want[1]):
        raise ConfigError("model.hf_path", f"the SGLang servers serve model_type {served[0]!r}, architectures "
                                           f"{list(served[1])}, but {path} is model_type {want[0]!r}, architectures "
                                           f"{list(want[1])}: the actor and the servers must run one model")


def _restarter(servers):
    """url -> restart of the launched server that serves it (a ServerProcess, or Ray-placed servers)."""
    by_url = {}
    for s in servers:
        if hasattr(s, "restart_url"):
            by_url.update({u: (lambda u=u, s=s: s.restart_url(u)) for u in s.urls})
        else:
            by_url[s.url] = s.restart
    return lambda url: by_url[url]()


def _stopper(servers):
    """url -> stop of the launched server that serves it, where one server can be stopped alone (a local
    ServerProcess; Ray-placed servers restart inside their actor, which runs one call at a time): None else."""
    by_url = {s.url: s.stop for s in servers if not hasattr(s, "restart_url") and hasattr(s, "stop")}
    if not by_url:
        return None
    return lambda url: by_url[url]() if url in by_url else None


def planned_kv_tokens(cfg: Config, *, gpu_memory_gib: float | None, vocab_size: int = 0) -> int | None:
    """--max-total-tokens of colocated GPU servers when rollout.server_max_total_tokens is null: the KV pool
    the planner gives them beside the trainer's steady state (plan/memory.py). SGLang sizes its pool from the
    memory free at launch, before the first optimizer step, which is more than stays free once training
    runs; the cap keeps the difference out of SGLang's runtime reserve. None: no cap (not colocated,
    CPU servers, a value given, or no GPU to plan for)."""
    r = cfg.rollout
    if (r.mode != "colocate" or r.server_max_total_tokens is not None or r.server_device not in ("", "cuda")
            or not gpu_memory_gib):
        return None
    from megatron_dapo.models.config_arch import model_arch
    from megatron_dapo.plan import plan_from_config

    plan = plan_from_config(cfg, arch=model_arch(cfg, vocab_size=vocab_size), gpu_memory_gib=gpu_memory_gib)
    log.info("colocated SGLang KV pool: %d tokens per server (planned beside the trainer's steady state of "
             "%.2f GiB; %d tokens if sized at launch)", plan.rollout_kv_tokens, plan.trainer_at_rollout / 2**30,
             plan.rollout_kv_tokens_at_launch)
    return max(plan.rollout_kv_tokens, 1)


def sglang_launch_plan(cfg: Config, *, gpu_memory_gib: float | None = None, vocab_size: int = 0):
    """What `launch_sglang` starts: (one SGLangServerSpec per server, the launcher argv prefix, the extra
    environment or None). One server per rollout.tensor_model_parallel_size GPUs, every flag from the
    config: the same code path starts CPU servers in the tests and GPU servers on the cluster.
    gpu_memory_gib: the GPUs' memory, for the KV cap of colocated servers (planned_kv_tokens)."""
    from megatron_dapo.rollout.sglang.server import SGLangServerSpec
    from megatron_dapo.rollout.sglang.versions import SERVER_RESERVED_TOKENS

    r, spec = cfg.rollout, cfg.rollout.speculative
    max_total_tokens = r.server_max_total_tokens or planned_kv_tokens(cfg, gpu_memory_gib=gpu_memory_gib,
                                                                      vocab_size=vocab_size)
    n = max(cfg.trainer.world_size // r.tensor_model_parallel_size, 1)
    tokenizer = cfg.data.tokenizer if cfg.data.tokenizer and not cfg.data.tokenizer.startswith("builtin:") else None
    specs = [SGLangServerSpec(
        model_path=cfg.model.hf_path, tokenizer_path=tokenizer, host=r.server_host, port=r.server_base_port + i,
        tp_size=r.tensor_model_parallel_size,
        # CPU servers have no GPU range (SGLang 0.5.23 reads --base-gpu-id as a NUMA node index there)
        base_gpu_id=None if r.server_device == "cpu" else i * r.tensor_model_parallel_size,
        mem_fraction_static=r.gpu_memory_utilization,
        dtype="bfloat16" if cfg.model.params_dtype == "bf16" else "float32",
        enable_memory_saver=r.mode == "colocate" and r.require_memory_saver,
        deterministic_inference=r.deterministic_inference,
        context_length=cfg.data.max_prompt_length + cfg.data.max_response_length + SERVER_RESERVED_TOKENS,
        device=r.server_device or None, attention_backend=r.server_attention_backend or None,
        max_total_tokens=max_total_tokens, extra_args=tuple(r.server_extra_args) + (
            ("--disable-radix-cache",) if inplace_pushes(cfg) and "--disable-radix-cache" not in r.server_extra_args
            else ()),
        speculative_algorithm=spec.algorithm, speculative_num_steps=spec.num_steps,
        speculative_eagle_topk=spec.eagle_topk, speculative_num_draft_tokens=spec.num_draft_tokens,
        return_routed_experts=cfg.actor.router_replay == "r3")
        for i in range(n)]
    launcher = (r.sglang_python or sys.executable, "-m", "sglang.launch_server")
    return specs, launcher, dict(item.split("=", 1) for item in r.server_env) or None


def inplace_pushes(cfg: Config) -> bool:
    """Weight pushes into running generation (the queue trainer's async mode with queue.partial_rollout on
    SGLang): the servers keep their cache across a push, so they run without a radix cache (a prompt prefix
    cached under older weights would otherwise be reused by new requests)."""
    q = cfg.queue
    return q.enable and q.max_staleness > 0 and q.partial_rollout and cfg.rollout.engine == "sglang"


def launch_sglang(cfg: Config) -> list:
    """The servers of sglang_launch_plan: placed on the Ray cluster when RAY_ADDRESS is set (the SLURM
    launcher starts one; servers bind to their node's cluster-internal address), otherwise launched on
    this node (loopback by default). Returns objects with `.stop()` (and `.url`/`.urls`)."""
    from megatron_dapo.rollout.sglang.server import launch_servers

    r = cfg.rollout
    if not cfg.model.hf_path:
        raise ValueError("rollout.engine=sglang launches servers from model.hf_path; set it or rollout.sglang_urls")
    on_ray = bool(os.environ.get("RAY_ADDRESS"))
    if cfg.trainer.nnodes > 1 and not on_ray:
        raise ValueError("with trainer.nnodes > 1 the SGLang servers are placed on the Ray cluster (RAY_ADDRESS) "
                         "or given by rollout.sglang_urls")
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None
    specs, launcher, env = sglang_launch_plan(cfg, gpu_memory_gib=gib)
    log_dir = os.path.join(cfg.run_dir, "sglang")
    if on_ray:
        from megatron_dapo.rollout.sglang.placement import place_sglang_servers

        host = "auto" if r.server_host == "127.0.0.1" else r.server_host  # reachable from rank 0's node
        return [place_sglang_servers([dataclasses.replace(s, host=host) for s in specs], log_dir=log_dir,
                                     launcher=launcher, env=env)]
    return launch_servers(specs, log_dir=log_dir, timeout_s=1800, launcher=launcher, env=env)


def _drafter(cfg: Config, *, vocab_size: int, version: str | None = None, transport: str | None = None):
    """How the weight sync treats the MTP layers (rollout/sglang/drafter.py) for servers of release `version`
    (None: the checks that hold in every release)."""
    from megatron_dapo.models.config_arch import model_arch
    from megatron_dapo.models.hf import hf_model_type
    from megatron_dapo.rollout.sglang.drafter import drafter_sync
    from megatron_dapo.rollout.sglang.versions import features_for

    arch, algorithm = model_arch(cfg, vocab_size=vocab_size), cfg.rollout.speculative.algorithm
    return drafter_sync(algorithm=algorithm, arch=arch, model_type=hf_model_type(arch) if algorithm else "",
                        features=features_for(version) if version else None, transport=transport)


def weight_transport(cfg: Config, pgs) -> str:
    """rollout.weight_transport with "auto" resolved: CUDA IPC for servers colocated on the trainer's
    GPUs (NCCL refuses two ranks on one GPU), weight-update process groups otherwise."""
    t = cfg.rollout.weight_transport
    if t == "auto":
        return "ipc" if cfg.rollout.mode == "colocate" and pgs.device.type == "cuda" else "distributed"
    return t


def _server_set(engine, pgs, nodes_given=()):
    """The servers rank 0 drives, known on every rank (URLs, TP sizes, the node each runs on: given by
    rollout.sglang_server_nodes, else found from the URLs' hosts)."""
    import socket
    from urllib.parse import urlparse

    from megatron_dapo.rollout.sglang.sync import ServerSet

    info = [None]
    if pgs.rank == 0:
        inner = engine.engine
        info = [(tuple(inner.urls), (inner.tp_size,) * len(inner.urls))]
    if pgs.world_size > 1:
        torch.distributed.broadcast_object_list(info, src=0, group=pgs.ctrl)
    urls, tp_sizes = info[0]
    if nodes_given:
        if len(nodes_given) != len(urls):
            raise ConfigError("rollout.sglang_server_nodes", f"one node index per server ({len(urls)}), got "
                                                             f"{list(nodes_given)}")
        return ServerSet(urls=urls, tp_sizes=tp_sizes, nodes=tuple(int(n) for n in nodes_given))
    # A server runs on the node whose first rank owns its host address (loopback: node 0).
    node = int(os.environ.get("GROUP_RANK", 0))
    mine = set()
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        host = socket.gethostname()
        mine = {host, socket.getfqdn()} | {a[4][0] for a in socket.getaddrinfo(host, None)}
        if node == 0:
            mine |= {"127.0.0.1", "localhost", "::1"}
    addrs = [None] * pgs.world_size
    if pgs.world_size > 1:
        torch.distributed.all_gather_object(addrs, (node, sorted(mine)), group=pgs.ctrl)
    else:
        addrs = [(node, sorted(mine))]
    nodes = []
    for url in urls:
        host = urlparse(url).hostname
        owners = sorted({n for n, a in addrs if host in a})
        nodes.append(owners[0] if owners else -1)
    return ServerSet(urls=urls, tp_sizes=tp_sizes, nodes=tuple(nodes))


def weight_push(cfg: Config, *, pgs, engine, chunks, vocab_size: int, free_memory):
    """The per-step actor -> servers sync, called on every rank with the version: every tensor of every
    pipeline stage from the stages' senders (rollout/sglang/sync.py), in buckets of
    rollout.weight_sync_bucket_mb. `engine`: build_engine's; `chunks`: the actor's model chunks on this
    rank; `free_memory()`: what the trainer gives back before colocated servers resume (its metrics).
    With rollout.speculative.auto the sync also runs the with / without speculation comparison
    (rollout/sglang/autospec.py) and returns its metrics."""
    parts = _PushParts(pgs=pgs, engine=engine, chunks=chunks, vocab_size=vocab_size, free_memory=free_memory)
    spec = cfg.rollout.speculative
    if not spec.auto:
        return _sglang_push(cfg, parts)
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.sglang.autospec import AutoSpeculation, SpeculationProbe, same_sampling
    from megatron_dapo.rollout.sglang.server import stop_servers

    def mode(on: bool) -> Config:
        off = dataclasses.replace(spec, algorithm=spec.algorithm if on else None, auto=False)
        return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, speculative=off))

    def relaunch(on: bool):  # rank 0: the servers of this run, stopped and started in the other mode
        stop_servers(parts.engine.servers)
        parts.engine.servers = launch_sglang(mode(on))
        return connect(cfg, _urls(parts.engine.servers), parts.engine.servers)

    r = cfg.rollout
    train = SamplingParams(max_new_tokens=cfg.data.max_response_length, n=r.n, temperature=r.temperature,
                           top_p=r.top_p, top_k=r.top_k, min_new_tokens=r.min_new_tokens)
    return AutoSpeculation(SpeculationProbe(steps=spec.auto_steps, start_step=spec.auto_start_step), pgs=parts.pgs,
                           engine=parts.engine, counted=same_sampling(train),
                           make_push=lambda on: _sglang_push(mode(on), parts), relaunch=relaunch)


def _sglang_push(cfg: Config, parts):
    """The plain SGLang sync (weight_push) for servers of cfg's speculative mode."""
    from megatron_dapo.models.config_arch import model_arch
    from megatron_dapo.models.forward import unwrap_model
    from megatron_dapo.rollout.sglang.sync import MIB, SGLangWeightSync, WeightSyncError

    r, pgs, engine = cfg.rollout, parts.pgs, parts.engine
    transport = weight_transport(cfg, pgs)
    servers = _server_set(engine, pgs, r.sglang_server_nodes)
    if transport == "ipc" and -1 in servers.nodes:
        raise WeightSyncError(f"rollout.weight_transport=ipc: servers {servers.urls} are not all on a trainer node "
                              f"(nodes {servers.nodes}); use rollout.weight_transport=distributed")
    session = None
    if pgs.rank == 0 and hasattr(engine.engine, "weight_update_session"):
        session = session_hook(engine.engine)
    version = [engine.engine.sglang_version if pgs.rank == 0 else None]  # the servers' release, known on rank 0
    if pgs.world_size > 1:
        torch.distributed.broadcast_object_list(version, src=0, group=pgs.ctrl)
    drafter = _drafter(cfg, vocab_size=parts.vocab_size, version=version[0], transport=transport)
    sync = SGLangWeightSync(servers, pgs=pgs, chunks=[unwrap_model(c) for c in parts.chunks],
                            arch=model_arch(cfg, vocab_size=parts.vocab_size), transport=transport,
                            bucket_bytes=max(1, int(r.weight_sync_bucket_mb * MIB)), timeout_s=r.weight_sync_timeout_s,
                            bucket_timeout_s=r.weight_sync_bucket_timeout_s,
                            host=r.weight_sync_host or None, session=session, drop_mtp=not drafter.send_mtp,
                            selector=drafter.selector)
    sync.setup()

    colocated = r.mode == "colocate"
    pooled = pgs.rank != 0 or getattr(engine.engine, "pool", None) is not None
    if pgs.world_size > 1:
        box = [pooled]
        torch.distributed.broadcast_object_list(box, src=0, group=pgs.ctrl)
        pooled = box[0]

    def push(version: int, *, flush_cache: bool = True) -> dict[str, float]:
        # Colocated servers free their memory while the actor trains (fit); every rank first gives back
        # what the servers were planned without (workers/memory.py), then verl's order around the sync:
        # weights back first (each server what it released; relaunches deferred during training start
        # now), the sync, then the KV cache (the cache is not needed to load weights).
        held = {}
        if colocated:
            held = parts.free_memory()
            engine.resume_memory(["weights"])
        # The servers answering now (rank 0's health view: a lost one is left out, a restarted one is
        # fed again), the same list on every rank; AllServersDown on every rank when none answers.
        targets, epochs = engine._on_rank0(lambda: _targets(engine.engine)) if pooled else (None, None)
        stats = sync.sync(version, targets, flush_cache=flush_cache, epochs=epochs)
        if stats.lost and pooled:  # ipc: a server that failed a bucket leaves the rotation (health.py)
            engine._on_rank0(lambda: [engine.engine.pool.mark_down(u, f"weight sync: {e}") for u, e in stats.lost.items()])
            targets = [u for u in targets if u not in stats.lost]
        if colocated:
            engine.resume_memory(["kv_cache"])
        engine.update_weights(None, policy_version=version)  # every rank records the version the servers hold
        log.info("weight sync v%d: %d tensors, %d buckets, %.1f MiB sent, %.1f MiB gathered in %.2f s",
                 version, stats.tensors, stats.buckets, stats.bytes_sent / MIB, stats.bytes_gathered / MIB,
                 stats.seconds)
        if not pooled:
            return held
        counts = engine._on_rank0(lambda: _confirmed(engine.engine, targets, version))
        return {**held, **{f"rollout/{name}": float(v) for name, v in counts.items()}}

    push.sync = sync  # for tests and the trainer's metrics
    return push


def _targets(engine) -> tuple[list[str], list[int]]:
    """The servers a sync feeds (engine.refresh) and how often each went down: a server that died and came
    back between two syncs is a new process without the weight-update groups of the last one."""
    targets = engine.refresh()
    return targets, engine.pool.epochs(targets)


def _confirmed(engine, targets, version: int) -> dict[str, int]:
    """After a sync: which targets report the version (health.py), and the server counts of the step."""
    engine.confirm_version(targets, version)
    c = engine.pool.take_counts()
    return {"servers_up": c["up"], "server_failures": c["failures"], "server_restarts": c["restarts"],
            "servers_readmitted": c["readmitted"], "requests_reissued": c["reissued_requests"]}


def session_hook(engine):
    """engine.weight_update_session() (SGLang releases with /begin_weight_update) as begin/end calls."""
    state = {}

    def hook(event: str) -> None:
        if event == "begin":
            state["ctx"] = engine.weight_update_session()
            state["ctx"].__enter__()
        else:
            state.pop("ctx").__exit__(None, None, None)

    return hook
