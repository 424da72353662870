"""Build every part from the config and run `fit`: the body of `python -m megatron_dapo.train`."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import time

import torch

from megatron_dapo.config import Config, ConfigError, to_dict, to_yaml
from megatron_dapo.trainer.schedule import schedule

log = logging.getLogger("megatron_dapo")


def _datasets(cfg: Config, tokenizer):
    from megatron_dapo.data.arithmetic import make_arithmetic_dataset
    from megatron_dapo.data.dataset import DatasetError, load_prompt_dataset

    d = cfg.data
    if d.task == "arithmetic":
        a = d.arithmetic
        kw = dict(seed=a.seed, min_digits=a.min_digits, max_digits=a.max_digits, operators=a.operators,
                  tokenizer=tokenizer)
        return (make_arithmetic_dataset("train", num_samples=a.num_train, **kw),
                make_arithmetic_dataset("val", num_samples=a.num_val, **kw))
    kw = dict(max_prompt_length=d.max_prompt_length, prompt_overflow=d.prompt_overflow, on_bad_row=d.on_bad_row,
              apply_chat_template=d.apply_chat_template)
    train = load_prompt_dataset(d.train_files, tokenizer, **kw)
    val = load_prompt_dataset(d.val_files, tokenizer, uid_prefix="val", **kw) if d.val_files else None
    for path, data in ((d.train_files, train), (d.val_files, val)):
        if data is not None and data.stats["rows_filtered_too_long"]:
            log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens", path,
                        data.stats["rows_filtered_too_long"], data.stats["rows_read"], d.max_prompt_length)
    if len(train) < d.effective_gen_batch_size:
        s = train.stats
        raise DatasetError(f"{d.train_files}: {len(train)} usable prompts, fewer than one generation batch "
                           f"({d.effective_gen_batch_size}): of {s['rows_read']} rows, {s['rows_filtered_too_long']} "
                           f"are longer than data.max_prompt_length={d.max_prompt_length} tokens and "
                           f"{s['rows_skipped_malformed']} are malformed")
    return train, val


def _engine(cfg: Config, actor, pgs, tokenizer):
    if cfg.rollout.engine == "local":
        from megatron_dapo.models.forward import unwrap_model
        from megatron_dapo.rollout.local_engine import LocalEngine

        if len(actor.policy.chunks) > 1:
            raise ValueError("rollout.engine=local needs parallel.virtual_pipeline_model_parallel_size=null")
        # Every rank generates the same batch (SPMD): a streaming stop is decided on rank 0 for all.
        return LocalEngine(unwrap_model(actor.policy.chunks[0]), pgs=pgs, eos_token_id=tokenizer.eos_id,
                           pad_token_id=tokenizer.pad_id, max_batch_size=cfg.rollout.max_num_seqs,
                           decision_group=pgs.ctrl if pgs.world_size > 1 else None)
    _drafter(cfg, vocab_size=tokenizer.vocab_size)  # what no release can draft fails before any server starts
    return _sglang_engine(cfg, pgs)


def _sglang_engine(cfg: Config, pgs):
    """SGLang servers (given by rollout.sglang_urls, or launched here on this node) driven by rank 0."""
    from megatron_dapo.rollout.rank0 import RankZeroEngine

    r = cfg.rollout
    engine, servers = None, []
    if pgs.rank == 0:
        servers = [] if r.sglang_urls else _launch_sglang(cfg)
        engine = _connect(cfg, list(r.sglang_urls) or _urls(servers), servers)
    return RankZeroEngine(engine, rank=pgs.rank, world_size=pgs.world_size, group=pgs.ctrl, servers=servers)


def _urls(servers) -> list[str]:
    return [u for s in servers for u in getattr(s, "urls", [getattr(s, "url", None)])]


def _connect(cfg: Config, urls: list[str], servers=()):
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
    from megatron_dapo.rollout.sglang.routing import RoutingLayout
    from megatron_dapo.models.config_arch import model_arch

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
    the planner gives them beside the trainer's steady state (plan.py). SGLang sizes its pool from the
    memory free at launch, before the first optimizer step, which is more than stays free once training
    runs; the cap keeps the difference out of SGLang's runtime reserve. None: no cap (not colocated,
    CPU servers, a value given, or no GPU to plan for)."""
    r = cfg.rollout
    if (r.mode != "colocate" or r.server_max_total_tokens is not None or r.server_device not in ("", "cuda")
            or not gpu_memory_gib):
        return None
    from megatron_dapo.plan import plan_from_config
    from megatron_dapo.models.config_arch import model_arch

    plan = plan_from_config(cfg, arch=model_arch(cfg, vocab_size=vocab_size), gpu_memory_gib=gpu_memory_gib)
    log.info("colocated SGLang KV pool: %d tokens per server (planned beside the trainer's steady state of "
             "%.2f GiB; %d tokens if sized at launch)", plan.rollout_kv_tokens, plan.trainer_at_rollout / 2**30,
             plan.rollout_kv_tokens_at_launch)
    return max(plan.rollout_kv_tokens, 1)


def sglang_launch_plan(cfg: Config, *, gpu_memory_gib: float | None = None, vocab_size: int = 0):
    """What `_launch_sglang` starts: (one SGLangServerSpec per server, the launcher argv prefix, the extra
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


def _launch_sglang(cfg: Config) -> list:
    """The servers of sglang_launch_plan: placed on the Ray cluster when RAY_ADDRESS is set (the SLURM
    launcher starts one; servers bind to their node's cluster-internal address), otherwise launched on
    this node (loopback by default). Returns objects with `.stop()` (and `.url`/`.urls`)."""
    import dataclasses

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
    from megatron_dapo.models.hf import hf_model_type
    from megatron_dapo.rollout.sglang.drafter import drafter_sync
    from megatron_dapo.rollout.sglang.versions import features_for
    from megatron_dapo.models.config_arch import model_arch

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


def weight_sync(cfg: Config, parts):
    """The per-step actor -> engine sync: the local engine shares the actor's weights (only the version
    changes); SGLang servers get every tensor of every pipeline stage from the stages' senders
    (rollout/sglang/sync.py), in buckets of rollout.weight_sync_bucket_mb. With rollout.speculative.auto
    the sync also runs the with / without speculation comparison (rollout/sglang/autospec.py) and returns
    its metrics."""
    if cfg.rollout.engine == "local":
        return lambda version: parts.engine.update_weights(None, policy_version=version)
    spec = cfg.rollout.speculative
    if not spec.auto:
        return _sglang_push(cfg, parts)
    import dataclasses

    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.sglang.autospec import AutoSpeculation, SpeculationProbe, same_sampling

    def mode(on: bool) -> Config:
        off = dataclasses.replace(spec, algorithm=spec.algorithm if on else None, auto=False)
        return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, speculative=off))

    def relaunch(on: bool):  # rank 0: the servers of this run, stopped and started in the other mode
        for server in parts.engine.servers:
            server.stop()
        parts.engine.servers = _launch_sglang(mode(on))
        return _connect(cfg, _urls(parts.engine.servers), parts.engine.servers)

    r = cfg.rollout
    train = SamplingParams(max_new_tokens=cfg.data.max_response_length, n=r.n, temperature=r.temperature,
                           top_p=r.top_p, top_k=r.top_k, min_new_tokens=r.min_new_tokens)
    return AutoSpeculation(SpeculationProbe(steps=spec.auto_steps, start_step=spec.auto_start_step), pgs=parts.pgs,
                           engine=parts.engine, counted=same_sampling(train),
                           make_push=lambda on: _sglang_push(mode(on), parts), relaunch=relaunch)


def _sglang_push(cfg: Config, parts):
    """The plain SGLang sync (weight_sync) for servers of cfg's speculative mode."""
    from megatron_dapo.models.forward import unwrap_model
    from megatron_dapo.rollout.sglang.sync import MIB, SGLangWeightSync, WeightSyncError
    from megatron_dapo.workers.memory import free_for_rollout
    from megatron_dapo.models.config_arch import model_arch

    r, pgs, engine = cfg.rollout, parts.pgs, parts.engine
    transport = weight_transport(cfg, pgs)
    servers = _server_set(engine, pgs, r.sglang_server_nodes)
    if transport == "ipc" and -1 in servers.nodes:
        raise WeightSyncError(f"rollout.weight_transport=ipc: servers {servers.urls} are not all on a trainer node "
                              f"(nodes {servers.nodes}); use rollout.weight_transport=distributed")
    session = None
    if pgs.rank == 0 and hasattr(engine.engine, "weight_update_session"):
        session = _session_hook(engine.engine)
    version = [engine.engine.sglang_version if pgs.rank == 0 else None]  # the servers' release, known on rank 0
    if pgs.world_size > 1:
        torch.distributed.broadcast_object_list(version, src=0, group=pgs.ctrl)
    drafter = _drafter(cfg, vocab_size=parts.tokenizer.vocab_size, version=version[0], transport=transport)
    sync = SGLangWeightSync(servers, pgs=pgs, chunks=[unwrap_model(c) for c in parts.actor.policy.chunks],
                            arch=model_arch(cfg, vocab_size=parts.tokenizer.vocab_size), transport=transport,
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
            held = free_for_rollout(parts.actor.offload)
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


def _session_hook(engine):
    """engine.weight_update_session() (SGLang releases with /begin_weight_update) as begin/end calls."""
    state = {}

    def hook(event: str) -> None:
        if event == "begin":
            state["ctx"] = engine.weight_update_session()
            state["ctx"].__enter__()
        else:
            state.pop("ctx").__exit__(None, None, None)

    return hook


def build_parts(cfg: Config):
    from megatron_dapo.algos.advantage import get_adv_estimator_fn
    from megatron_dapo.algos.kl import get_kl_controller
    from megatron_dapo.data.sampler import ResumableSampler
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.metrics import MetricsLogger
    from megatron_dapo.parallel import init_parallel
    from megatron_dapo.rewards.build import build_reward_manager
    from megatron_dapo.trainer.fit import TrainerParts
    from megatron_dapo.workers.build import build_actor

    par = cfg.parallel
    pgs = init_parallel(tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
                        ep=par.expert_model_parallel_size, cp=par.context_parallel_size,
                        etp=par.expert_tensor_parallel_size, vpp=par.virtual_pipeline_model_parallel_size,
                        seed=cfg.trainer.seed)
    if pgs.world_size != cfg.trainer.world_size:
        raise ValueError(f"trainer.nnodes * trainer.n_gpus_per_node = {cfg.trainer.world_size} but the job has "
                         f"{pgs.world_size} processes")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if pgs.device.type == "cuda":  # refuse a layout that cannot fit before building anything
        from megatron_dapo.plan import check_fits, format_plan, plan_from_config
        from megatron_dapo.models.config_arch import model_arch

        gib = torch.cuda.get_device_properties(pgs.device).total_memory / 2**30
        from megatron_dapo.models.builder import default_backend

        plan = plan_from_config(cfg, arch=model_arch(cfg, vocab_size=tokenizer.vocab_size), gpu_memory_gib=gib,
                                backend=default_backend(pgs.device))
        log.info("memory plan:\n%s", format_plan(plan))
        check_fits(plan)
    train, val = _datasets(cfg, tokenizer)
    length = schedule(cfg, prompts=len(train))
    if pgs.rank == 0:
        log.info("schedule: %s", length.describe())
        if length.problem():
            log.warning("%s", length.problem())
    rm = build_reward_manager(cfg)
    actor = build_actor(cfg, pgs, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    sampler = ResumableSampler(len(train), cfg.data.effective_gen_batch_size, seed=cfg.data.seed,
                               shuffle=cfg.data.shuffle)
    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = (get_kl_controller(kc.type, kc.kl_coef, target_kl=kc.target_kl, horizon=kc.horizon)
               if cfg.algorithm.use_kl_in_reward else None)
    logger = None
    if pgs.rank == 0:
        logger = MetricsLogger(os.path.join(cfg.run_dir, "tb") if "tensorboard" in cfg.trainer.logger else None,
                               backends=tuple(cfg.trainer.logger), total_steps=cfg.trainer.total_training_steps,
                               project=cfg.trainer.project_name, experiment=cfg.trainer.experiment_name,
                               wandb_dir=cfg.run_dir, config=to_dict(cfg))
    parts = TrainerParts(actor=actor, engine=_engine(cfg, actor, pgs, tokenizer), tokenizer=tokenizer,
                         reward_manager=rm, train_data=train, val_data=val, sampler=sampler, logger=logger, pgs=pgs,
                         adv_fn=get_adv_estimator_fn(cfg.algorithm.adv_estimator), kl_ctrl=kl_ctrl,
                         reference=None)
    parts.sync_weights = weight_sync(cfg, parts)
    return parts


def _warmup_probe(cfg: Config, parts):
    """The warm-up's accuracy check (trainer.sft_warmup_target_acc): mean@n with rollout.val_kwargs on the
    first sft.PROBE_SIZE training problems, rank 0's value on every rank (all ranks stop together)."""
    from megatron_dapo.data.dataset import PromptDataset
    from megatron_dapo.trainer.sft import PROBE_SIZE
    from megatron_dapo.trainer.validate import validate

    subset = PromptDataset([parts.train_data[i] for i in range(min(PROBE_SIZE, len(parts.train_data)))])

    def probe() -> float:
        out = validate(parts.engine, subset, cfg, tokenizer=parts.tokenizer, reward_manager=parts.reward_manager,
                       seed=cfg.trainer.seed, group=parts.pgs.ctrl)
        accs = [v for k, v in out.items() if "/acc/mean@" in k]
        acc = torch.tensor([sum(accs) / len(accs)], device=parts.pgs.device)
        if torch.distributed.is_initialized() and parts.pgs.world_size > 1:
            torch.distributed.broadcast(acc, src=0)
        return float(acc.item())

    return probe


def close_parts(parts) -> None:
    """Release what build_parts opened: reward workers, SGLang weight-update groups, the engine (and the
    servers it launched), the metric sinks."""
    parts.reward_manager.close()
    sync = getattr(parts.sync_weights, "sync", None)  # SGLang weight-update groups
    if sync is not None:
        sync.close()
    parts.engine.close()
    if parts.logger is not None:
        parts.logger.close()
    from megatron_dapo.trainer.rundir import release_run_directories

    release_run_directories()


def _check_fresh_start(cfg: Config) -> None:
    """trainer.resume_mode=disable where checkpoints already are would mix two runs' steps, and the new run's
    pruning (max_ckpt_to_keep) would delete its own checkpoints as older than the old run's: refused."""
    import glob

    found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(cfg.ckpt_dir, "global_step_*")))
    if cfg.trainer.resume_mode == "disable" and found:
        raise ConfigError("trainer.resume_mode", f"disable, but {cfg.ckpt_dir} holds checkpoints ({', '.join(found)}) "
                          "that a fresh run there would mix with its own and prune: resume them (auto), or give this "
                          "run its own trainer.experiment_name or trainer.default_local_dir")


def build_trainer(cfg: Config):
    """Parts, the supervised warm-up, the reference (when a KL term is used), then the trainer:
    the queue trainer when `queue.enable`, else the sync `DAPOTrainer`."""
    from megatron_dapo.data.arithmetic import arithmetic_sft_examples
    from megatron_dapo.trainer.fit import DAPOTrainer
    from megatron_dapo.trainer.rundir import lock_run_directory
    from megatron_dapo.trainer.sft import sft_warmup
    from megatron_dapo.workers.build import build_reference

    if int(os.environ.get("RANK", "0")) == 0:  # before anything is written: a second job on the directory refuses
        lock_run_directory(cfg.run_dir)
        if os.path.commonpath([os.path.abspath(cfg.ckpt_dir), os.path.abspath(cfg.run_dir)]) != \
                os.path.abspath(cfg.run_dir):  # checkpoints elsewhere (trainer.default_local_dir)
            lock_run_directory(cfg.ckpt_dir)
    _check_fresh_start(cfg)
    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    parts = build_parts(cfg)
    if cfg.trainer.sft_warmup_steps and cfg.data.task == "arithmetic":
        m = sft_warmup(parts.actor, arithmetic_sft_examples(parts.train_data, parts.tokenizer), cfg,
                       pad_id=parts.tokenizer.pad_id, rank=parts.pgs.rank,
                       probe=_warmup_probe(cfg, parts) if cfg.trainer.sft_warmup_target_acc > 0 else None)
        log.info("supervised warm-up: %s", m)
    if cfg.needs_reference:  # a frozen copy of the (warmed-up) initial policy
        parts.reference = build_reference(cfg, parts.pgs, vocab_size=parts.tokenizer.vocab_size,
                                          pad_id=parts.tokenizer.pad_id, actor=parts.actor)
    freeze_startup_objects()
    if cfg.queue.enable:
        from megatron_dapo.trainer.queue_trainer import QueueTrainer

        return QueueTrainer(cfg, parts)
    return DAPOTrainer(cfg, parts)


def freeze_startup_objects() -> None:
    """Take what was built so far (modules, the model, datasets: about half a million objects) out of the
    cyclic garbage collector's full passes, which would otherwise walk all of it every time enough new
    containers survive. Parsing a 16 x 6k-token SGLang reply creates ~100k lists: with the startup objects
    frozen, the client's CPU per response token falls from 1.6 to 0.7 us (measured in a process holding
    torch and Megatron-Core, docs/benchmarks.md). Megatron-LM's --manual-gc answers the same stalls on
    training ranks."""
    gc.collect()
    gc.freeze()
    # At exit they go back to the collector: frozen objects are never finalized, so extension modules
    # (nanobind, in Triton) would report them as leaked on every run's last line.
    atexit.register(gc.unfreeze)


def _exhausted_hint(cfg: Config) -> str:
    """Why nearly every group may be constant when the policy starts from nothing it was taught."""
    if cfg.model.hf_path or cfg.trainer.sft_warmup_steps > 0:
        return ""
    return ("; the policy starts from random weights (model.hf_path is empty) without a supervised warm-up "
            "(trainer.sft_warmup_steps=0), so almost no answer is right: set trainer.sft_warmup_steps "
            "(the embedded default's configs/tiny_cpu.yaml sets it) or start from a model")


def run(cfg: Config) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    t0 = time.time()
    from megatron_dapo.data.dataset import DatasetError

    try:
        trainer = build_trainer(cfg)
    except DatasetError as e:  # a data file or row that cannot be used: one line, like a config error
        print(f"data error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:  # found while building (a reward file, a checkpoint directory): still one line
        print(f"config error: {e}", file=sys.stderr)
        return 2
    parts = trainer.p
    from megatron_dapo.trainer.dynamic_sampling import DynamicSamplingExhausted
    from megatron_dapo.trainer.mismatch import MismatchAlarmError
    from megatron_dapo.trainer.preemption import Preempted

    preempted = None
    try:
        val = trainer.fit()
    except Preempted as p:
        preempted = p
        log.warning("%s; exiting with trainer.preemption_exit_code=%d (resume_mode=auto continues from it)", p,
                    cfg.trainer.preemption_exit_code)
    except (DynamicSamplingExhausted, MismatchAlarmError) as e:  # every rank decides alike: one line, like a config error
        if parts.pgs.rank == 0:
            print(f"training error: {e}{_exhausted_hint(cfg)}", file=sys.stderr)
        return 2
    finally:
        close_parts(parts)
    if preempted is not None:
        torch.distributed.barrier() if torch.distributed.is_initialized() and parts.pgs.world_size > 1 else None
        return cfg.trainer.preemption_exit_code
    if parts.pgs.rank == 0:
        kind = f"queue trainer, {'sync' if trainer.sync_mode else 'async'} mode" if cfg.queue.enable else "sync trainer"
        print(f"\ndone: {trainer.global_step} steps in {time.time() - t0:.0f} s ({kind})")
        first_step, first = trainer.first_val or (None, {})
        for k, v in sorted((k, v) for k, v in val.items() if k.startswith("val/")):  # not verl's duplicates
            since = f"  (step {first_step}: {first[k]:.4f})" if k in first and first_step != trainer.global_step else ""
            print(f"  {k} = {v:.4f}{since}")
        print(f"TensorBoard: tensorboard --logdir {os.path.join(cfg.run_dir, 'tb')} --host 127.0.0.1")
    torch.distributed.barrier() if torch.distributed.is_initialized() and parts.pgs.world_size > 1 else None
    return 0
