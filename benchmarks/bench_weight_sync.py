"""Actor -> SGLang weight sync at the recipes' structure: tensor count, not bytes, on a real CPU server.

The recipes push 64 dense layers (Qwen2.5-32B, 771 HF tensors) or 48 layers x 128 experts x 3 matrices
(Qwen3-30B-A3B: 18,432 expert tensors, 18,867 in all) every step. This keeps that structure (layers, experts,
top-k, attention heads, untied embeddings) at tiny widths that a CPU serves, fp32, so the tensor count of the
recipe is measured and the bytes are small. Per structure it

- builds the project's Megatron-Core actor model (`models.builder.build_gpt_model_chunks`, random init, world
  of one gloo rank) and writes it as the HF checkpoint the server loads (`models.hf.save_mcore_as_hf`, the
  character tokenizer of tests/sglang_real);
- launches one real SGLang 0.5.23 CPU server through the trainer's own launcher
  (`rollout.sglang.build.sglang_launch_plan` -> `server.launch_servers`, the CPU flags of tests/sglang_real),
  with benchmarks/sglang_load_timer on its PYTHONPATH (a timer around the model's `load_weights`, below);
- per transport ("distributed": /update_weights_from_distributed + gloo broadcasts on a weight-update group;
  "ipc": /update_weights_from_tensor with shared-memory handles) and per bucket size, builds the trainer's push
  (`rollout.sglang.build.weight_push`, connected through `build_engine` with rollout.sglang_urls) and times its
  `SGLangWeightSync.sync(version)`: session begin, every bucket, the final flush + version, session end.
  `--syncs N` syncs after one warm-up sync; the median is reported (the lower middle one for an even N,
  for the sync and the floor alike).

Per sync it prints: seconds, HF tensors, buckets, bytes, and
- `load_s`: the server's own seconds inside the model's `load_weights`, summed over the sync's update calls
  (`load_calls`). SGLang 0.5.23 neither logs nor returns this per update (its only timer,
  scheduler_components/weight_updater.py:106 `_observe_weight_load`, sets a Prometheus gauge to the most
  recent call's wall time, receive included, only with --enable-metrics), so the server runs with
  benchmarks/sglang_load_timer/sitecustomize.py, which wraps Qwen2ForCausalLM / Qwen3MoeForCausalLM
  `load_weights` with a perf_counter timer and writes one `BENCH_LOAD_WEIGHTS` line per call to the server log;
  the benchmark sums the lines each sync added.
- `actor_s`: the actor side alone, once: the sync's own bucket iteration (`_stage_buckets`: each parameter
  gathered and split into its HF tensors, bucketed) with nothing sent.
- `floor_s`: the same bytes over the same route as few large tensors. The floor runs the sync's exact sequence
  of calls with each bucket's tensors replaced by ONE flat fp32 tensor of the bucket's bytes, named
  `bench.floor.flat` (a name the model does not have: the server receives it, runs `load_weights` over one
  tensor, which skips it, and replies): inside the same weight-update session, per bucket one
  /update_weights_from_distributed naming that tensor plus its gloo broadcast on the sync's own weight-update
  group ("distributed"), or one /update_weights_from_tensor posting its shared-memory handle ("ipc"), then the
  same final flush + version call. What the floor leaves out is everything that grows with the tensor count:
  the actor's per-parameter gather and HF split, one broadcast or pickled handle per tensor, and the server's
  per-tensor `load_weights` work.

`--sweep` runs, instead of one structure, the expert count 8 / 32 / 128 at fixed total expert bytes (the expert
width scaled by 128 / experts) on the 48-layer MoE, and the layer count 16 / 32 / 64 at fixed total bytes (the
dense ffn width solved so the model's bytes stay within one row of the 64-layer model's) on the Qwen2, one
server each, each transport and --bucket-mb size; the fits at the end (seconds against tensors at the first
bucket size) say which terms are linear.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 MEGATRON_DAPO_SGLANG_PYTHON=.venv-sglang/bin/python \\
        .venv/bin/python benchmarks/bench_weight_sync.py [--model qwen3_moe] [--layers 48] [--experts 128] \\
        [--transport distributed ipc] [--bucket-mb 512 16] [--syncs 3] [--sweep]

It ends with one JSON line: `runs`, one entry per structure x transport x bucket size with `sync_s`, `floor_s`,
`load_s`, `tensors`, `buckets`, `bytes`, `experts`, `layers`, `model`, `transport`, `bucket_mb`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LOAD_TIMER = ROOT / "benchmarks" / "sglang_load_timer"
FLOOR_NAME = "bench.floor.flat"
DEFAULT_BUCKET_MB = 512.0
"""rollout.weight_sync_bucket_mb's default (config/schema.py)."""
SWEEP_EXPERTS = (8, 32, 128)
SWEEP_LAYERS = (16, 32, 64)
F32 = 4

# Per-layer HF tensors (models/hf.py _PER_LAYER): input norm, q/k/v, o, post-attention norm, then
# Qwen3-MoE: q_norm, k_norm, the router, 3 per expert; Qwen2: q/k/v biases, gate/up/down.
MOE_LAYER_TENSORS, DENSE_LAYER_TENSORS, GLOBAL_TENSORS = 9, 12, 3


# -- structure and arithmetic (no server) -----------------------------------------------------------
def bench_arch(*, model: str, layers: int, experts: int, topk: int, hidden: int, moe_ffn: int, dense_ffn: int,
               vocab_size: int, heads: int = 4, kv_heads: int = 2):
    """The benchmark's ModelArch: the recipe's structure (Qwen3-30B-A3B: QK-norm, no QKV bias, every layer
    MoE; Qwen2.5-32B: QKV bias, dense), untied embeddings, tiny widths."""
    from megatron_dapo.models.arch import ModelArch

    common = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv_heads,
                  vocab_size=vocab_size, max_position_embeddings=512, untie_embeddings_and_output_weights=True)
    if model == "qwen3_moe":
        return ModelArch(name=f"bench-qwen3-moe-{layers}x{experts}", ffn_hidden_size=dense_ffn, qk_layernorm=True,
                         num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn, **common)
    if model == "qwen2":
        return ModelArch(name=f"bench-qwen2-{layers}", ffn_hidden_size=dense_ffn, add_qkv_bias=True, **common)
    raise ValueError(f"--model must be qwen3_moe or qwen2, got {model!r}")


def hf_tensor_shapes(arch) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor the sync sends, in closed form from the architecture."""
    h, hd, v = arch.hidden_size, arch.head_dim, arch.vocab_size
    q, kv = arch.num_attention_heads * hd, arch.num_query_groups * hd
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,))]
        if arch.add_qkv_bias:
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        if arch.qk_layernorm:
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        if arch.is_moe:
            f = arch.moe_ffn_hidden_size
            out.append((p + "mlp.gate.weight", (arch.num_moe_experts, h)))
            for e in range(arch.num_moe_experts):
                x = f"{p}mlp.experts.{e}."
                out += [(x + "gate_proj.weight", (f, h)), (x + "up_proj.weight", (f, h)), (x + "down_proj.weight", (h, f))]
        else:
            f = arch.ffn_hidden_size
            out += [(p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                    (p + "mlp.down_proj.weight", (h, f))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def tensor_count(arch) -> int:
    """HF tensors per sync: 3 + layers x (9 + 3 x experts) for the Qwen3-MoE, 3 + 12 x layers for the Qwen2."""
    per_layer = MOE_LAYER_TENSORS + 3 * arch.num_moe_experts if arch.is_moe else DENSE_LAYER_TENSORS
    return GLOBAL_TENSORS + arch.num_layers * per_layer


def expert_tensor_count(arch) -> int:
    return 3 * arch.num_layers * (arch.num_moe_experts or 0)


def sync_bytes(arch, element_size: int = F32) -> int:
    total = 0
    for _, shape in hf_tensor_shapes(arch):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total * element_size


def expert_ffn_at_fixed_bytes(*, base_experts: int, base_ffn: int, experts: int) -> int:
    """Expert width that keeps experts x width (so the expert bytes) equal to the base's."""
    if (base_experts * base_ffn) % experts:
        raise ValueError(f"{base_experts} x {base_ffn} is not divisible by {experts} experts")
    return base_experts * base_ffn // experts


def dense_ffn_at_fixed_bytes(arch, *, layers: int, target_bytes: int) -> int:
    """Dense ffn width of `arch` with `layers` layers whose sync bytes are nearest `target_bytes` (bytes are
    linear in the width: 3 x hidden x ffn per layer)."""
    lo = sync_bytes(dataclasses.replace(arch, num_layers=layers, ffn_hidden_size=1))
    per_unit = 3 * arch.hidden_size * layers * F32
    return max(1, round((target_bytes - lo) / per_unit) + 1)


def sweep_structures(args) -> list[dict]:
    """The --sweep structures: experts at fixed expert bytes (48-layer MoE), layers at fixed bytes (Qwen2)."""
    base = dict(topk=args.topk, hidden=args.hidden, dense_ffn=args.dense_ffn)
    out = [dict(base, model="qwen3_moe", layers=args.layers, experts=e, moe_ffn=expert_ffn_at_fixed_bytes(
        base_experts=SWEEP_EXPERTS[-1], base_ffn=args.moe_ffn, experts=e)) for e in SWEEP_EXPERTS]
    vocab = _vocab_size()
    ref = bench_arch(model="qwen2", layers=SWEEP_LAYERS[-1], experts=0, topk=1, hidden=args.hidden, moe_ffn=0,
                     dense_ffn=args.qwen2_ffn, vocab_size=vocab)
    target = sync_bytes(ref)
    for layers in SWEEP_LAYERS:
        out.append(dict(base, model="qwen2", layers=layers, experts=0, moe_ffn=0,
                        dense_ffn=dense_ffn_at_fixed_bytes(ref, layers=layers, target_bytes=target)))
    return out


def _vocab_size() -> int:
    from megatron_dapo.data.tokenizer import CharTokenizer

    return CharTokenizer().vocab_size


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("qwen3_moe", "qwen2"), default="qwen3_moe")
    p.add_argument("--layers", type=int, default=None, help="default: 48 (qwen3_moe), 64 (qwen2)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--moe-ffn", type=int, default=32, help="expert width (at 128 experts in --sweep)")
    p.add_argument("--dense-ffn", type=int, default=None,
                   help="dense MLP width; default 64 (qwen3_moe: unused, every layer MoE), 256 (qwen2)")
    p.add_argument("--transport", nargs="+", choices=("distributed", "ipc"), default=["distributed", "ipc"])
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[DEFAULT_BUCKET_MB, 16.0])
    p.add_argument("--flatten", nargs="+", choices=("on", "off"), default=["on"],
                   help="each bucket as one byte tensor (SGLang's flattened_bucket, the trainer's default) or "
                        "tensor by tensor (off: the sync before it)")
    p.add_argument("--profile", action="store_true", help="print the trainer side's top functions (cProfile) of "
                                                            "one more sync per run")
    p.add_argument("--syncs", type=int, default=3, help="timed syncs after one warm-up sync (median reported)")
    p.add_argument("--sweep", action="store_true", help="experts 8/32/128 and layers 16/32/64 at fixed bytes")
    p.add_argument("--keep", default=None, help="directory for the checkpoints and server logs (default: a temp dir)")
    args = p.parse_args(argv)
    args.layers = args.layers or (48 if args.model == "qwen3_moe" else 64)
    args.qwen2_ffn = 256 if args.dense_ffn is None else args.dense_ffn
    args.dense_ffn = args.dense_ffn or (64 if args.model == "qwen3_moe" else 256)
    if args.model == "qwen2":
        args.experts = 0
    if args.syncs < 1 or any(b <= 0 for b in args.bucket_mb):
        p.error("--syncs >= 1 and every --bucket-mb > 0")
    if args.model == "qwen3_moe" and not 1 <= args.topk <= args.experts:
        p.error(f"--topk must be in [1, --experts={args.experts}]")
    return args


def structures(args) -> list[dict]:
    if args.sweep:
        return sweep_structures(args)
    return [dict(model=args.model, layers=args.layers, experts=args.experts, topk=args.topk, hidden=args.hidden,
                 moe_ffn=args.moe_ffn, dense_ffn=args.dense_ffn)]


# -- the server's load_weights timer ----------------------------------------------------------------
_LOAD_LINE = re.compile(r"BENCH_LOAD_WEIGHTS cls=(\w+) tensors=(-?\d+) seconds=([0-9.]+)")


def load_lines(text: str) -> list[tuple[int, float]]:
    """(tensors, seconds) of each load_weights call the timer logged in `text`."""
    return [(int(m.group(2)), float(m.group(3))) for m in _LOAD_LINE.finditer(text)]


class ServerLog:
    def __init__(self, path: str):
        self.path, self.offset = path, os.path.getsize(path)

    def since_last(self) -> list[tuple[int, float]]:
        with open(self.path, errors="replace") as f:
            f.seek(self.offset)
            text = f.read()
        self.offset += len(text.encode(errors="replace"))
        return load_lines(text)


# -- the measurement (a server per structure) ------------------------------------------------------------
def _config(overrides: list[str]):
    from megatron_dapo.config import load_config

    return load_config(str(ROOT / "configs/tiny_cpu.yaml"), overrides)


def _write_checkpoint(chunks, arch, pgs, directory: str) -> tuple[str, str]:
    import torch

    from megatron_dapo.models.hf import save_mcore_as_hf
    from tests.sglang_real.model import write_char_tokenizer

    save_mcore_as_hf(chunks[0], directory, pgs=pgs, arch=arch, dtype=torch.float32,
                     hf_config={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, f)
    tokenizer = os.path.join(directory, "tokenizer")
    write_char_tokenizer(tokenizer)
    return directory, tokenizer


def _floor(sync, engine, bucket_bytes: list[int], version: int) -> float:
    """The floor (module docstring): the sync's calls with one flat tensor of each bucket's bytes."""
    import torch
    import torch.distributed as dist

    from megatron_dapo.rollout.sglang import weights as sw
    from megatron_dapo.rollout.sglang.payloads import post_control

    url = sync.active_servers.urls[0]
    timeout = sync.bucket_timeout_s

    def call(path: str, body: dict) -> None:
        err = post_control(url, path, body, timeout_s=timeout)
        if err is not None:
            raise RuntimeError(f"floor {path}: {err}")

    t0 = time.perf_counter()
    with engine.engine.weight_update_session(), ThreadPoolExecutor(max_workers=1) as pool:
        for nbytes in bucket_bytes:
            flat = torch.empty(nbytes // F32, dtype=torch.float32)
            if sync.transport == "distributed":  # the server receives while the POST waits, as in the sync
                body = sw.distributed_update_payload([(FLOOR_NAME, flat)], group_name=sync._group_name,
                                                     flush_cache=False, weight_version=None)
                posted = pool.submit(call, "/update_weights_from_distributed", body)
                sync._group.broadcast([flat], dist.BroadcastOptions()).wait()
                posted.result()
            else:
                call("/update_weights_from_tensor", sw.tensor_update_payload(
                    [sw.serialize_named_tensors([(FLOOR_NAME, flat)])], flush_cache=False, weight_version=None))
        if sync.transport == "distributed":
            call("/update_weights_from_distributed", sw.distributed_update_payload(
                [], group_name=sync._group_name, flush_cache=True, weight_version=str(version)))
        else:
            call("/update_weights_from_tensor", sw.tensor_update_payload(
                [sw.serialize_named_tensors([])], flush_cache=True, weight_version=str(version)))
    return time.perf_counter() - t0


def _bucket_bytes(sync) -> list[int]:
    """Bytes of each bucket the sync cuts (its own bucketing, on this world-of-one rank)."""
    from megatron_dapo.rollout.sglang.sync import SyncStats

    return [sum(nbytes for _, _, nbytes in bucket) for bucket in sync._stage_buckets(SyncStats(), {})]


def run_structure(s: dict, args, pgs, workdir: str) -> list[dict]:
    import torch

    from megatron_dapo.models.builder import build_gpt_model_chunks
    from megatron_dapo.rollout.sglang.build import build_engine, sglang_launch_plan, weight_push
    from megatron_dapo.rollout.sglang.server import launch_servers
    from tests.sglang_real.conftest import cpu_server_overrides, free_port_pair, model_overrides

    vocab = _vocab_size()
    arch = bench_arch(**s, vocab_size=vocab)
    tag = arch.name
    model_dir = os.path.join(workdir, tag)
    t0 = time.perf_counter()
    chunks = build_gpt_model_chunks(arch, pgs=pgs, seed=1, params_dtype=torch.float32)
    model_dir, tokenizer_dir = _write_checkpoint(chunks, arch, pgs, model_dir)
    build_s = time.perf_counter() - t0
    base = [*model_overrides(model_dir, tokenizer_dir), *cpu_server_overrides(), "rollout.engine=sglang",
            "trainer.n_gpus_per_node=1", "rollout.mode=disaggregate", f"trainer.output_dir={workdir}/run-{tag}"]
    specs, launcher, env = sglang_launch_plan(_config(base + [f"rollout.server_base_port={free_port_pair()}"]))
    paths = [str(LOAD_TIMER), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**(env or {}), "PYTHONPATH": os.pathsep.join(paths)}
    t0 = time.perf_counter()
    servers = launch_servers(specs, log_dir=os.path.join(workdir, f"logs-{tag}"), timeout_s=1800, launcher=launcher,
                             env=env)
    launch_s = time.perf_counter() - t0
    url = servers[0].url
    print(f"{tag}: {tensor_count(arch):,} tensors, {sync_bytes(arch) / 2**20:.1f} MiB; model built and written in "
          f"{build_s:.0f} s, server up in {launch_s:.0f} s at {url}", flush=True)
    log = ServerLog(servers[0].log_path)
    runs = []
    engine = None
    try:
        for transport in args.transport:
            for bucket_mb in args.bucket_mb:
                cfg = _config(base + [f"rollout.sglang_urls=[{url}]", f"rollout.weight_transport={transport}",
                                      f"rollout.weight_sync_bucket_mb={bucket_mb:g}"])
                engine = engine or build_engine(cfg, pgs, vocab_size=vocab)
                push = weight_push(cfg, pgs=pgs, engine=engine, chunks=chunks, vocab_size=vocab, free_memory=dict)
                sync = push.sync
                try:
                    for flatten in args.flatten:
                        sync.flatten = flatten == "on"
                        runs.append(_measure(sync, engine, log, arch, s, transport, bucket_mb, args.syncs))
                        if args.profile:
                            _profile(sync, version=1000 + len(runs))
                finally:
                    sync.close()
    finally:
        if engine is not None:
            engine.close()
        for server in servers:
            server.stop()
    return runs


def _measure(sync, engine, log: ServerLog, arch, s: dict, transport: str, bucket_mb: float, syncs: int) -> dict:
    version = 0
    timed, loads = [], []
    log.since_last()
    for i in range(syncs + 1):
        version += 1
        stats = sync.sync(version)
        calls = log.since_last()
        if stats.tensors != tensor_count(arch):
            raise RuntimeError(f"the sync sent {stats.tensors} tensors, the closed form says {tensor_count(arch)}")
        if i:
            timed.append(stats)
            loads.append(calls)
    t0 = time.perf_counter()
    sizes = _bucket_bytes(sync)
    actor_s = time.perf_counter() - t0
    floors = []
    for i in range(syncs + 1):
        version += 1
        f = _floor(sync, engine, sizes, version)
        log.since_last()
        if i:
            floors.append(f)
    mid = sorted(range(len(timed)), key=lambda k: timed[k].seconds)[(len(timed) - 1) // 2]
    stats, calls = timed[mid], loads[mid]
    row = {"model": s["model"], "layers": arch.num_layers, "experts": arch.num_moe_experts or 0,
           "moe_ffn": arch.moe_ffn_hidden_size or 0, "dense_ffn": arch.ffn_hidden_size, "transport": transport,
           "bucket_mb": bucket_mb, "sync_s": round(stats.seconds, 3), "floor_s": round(sorted(floors)[(len(floors) - 1) // 2], 3),
           "load_s": round(sum(sec for _, sec in calls), 3), "load_calls": len(calls), "actor_s": round(actor_s, 3),
           "tensors": stats.tensors, "buckets": stats.buckets, "flattened_buckets": stats.flattened_buckets,
           "bytes": sum(sizes),
           "sync_s_all": [round(t.seconds, 3) for t in timed], "floor_s_all": [round(f, 3) for f in floors]}
    print(f"  {transport:11s} {'flat' if stats.flattened_buckets else 'per-tensor'} bucket {bucket_mb:g} MiB: sync {row['sync_s']:.2f} s (floor {row['floor_s']:.2f} s), "
          f"server load_weights {row['load_s']:.2f} s in {row['load_calls']} calls; {row['tensors']:,} tensors, "
          f"{row['buckets']} buckets, {row['bytes'] / 2**20:.1f} MiB; actor gather + HF split alone {actor_s:.2f} s",
          flush=True)
    return row


def _profile(sync, *, version: int) -> None:
    """One more sync under cProfile: where the trainer side's seconds go (the server's are in load_s)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    sync.sync(version)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def main() -> None:
    args = parse_args()
    from megatron_dapo.parallel import init_parallel

    pgs = init_parallel(seed=1)
    workdir = args.keep or tempfile.mkdtemp(prefix="bench_weight_sync_")
    os.makedirs(workdir, exist_ok=True)
    runs = []
    for s in structures(args):
        runs += run_structure(s, args, pgs, workdir)
    print(f"{'model':9s} {'layers':>6s} {'experts':>7s} {'transport':11s} {'flat':>4s} {'bucket':>7s} {'sync_s':>7s} "
          f"{'floor_s':>7s} {'load_s':>7s} {'tensors':>7s} {'buckets':>7s} {'MiB':>7s}")
    for r in runs:
        print(f"{r['model']:9s} {r['layers']:6d} {r['experts']:7d} {r['transport']:11s} "
              f"{'yes' if r['flattened_buckets'] else 'no':>4s} {r['bucket_mb']:7g} "
              f"{r['sync_s']:7.2f} {r['floor_s']:7.2f} {r['load_s']:7.2f} {r['tensors']:7d} {r['buckets']:7d} "
              f"{r['bytes'] / 2**20:7.1f}")
    fits = {}
    if args.sweep:  # per transport, default bucket: seconds against tensors over the sweep's points
        for model in ("qwen3_moe", "qwen2"):
            for transport in args.transport:
                pts = [r for r in runs if r["model"] == model and r["transport"] == transport
                       and r["bucket_mb"] == args.bucket_mb[0] and bool(r["flattened_buckets"]) == (args.flatten[0] == "on")]
                if len(pts) >= 2:
                    for key in ("sync_s", "load_s", "floor_s"):
                        a, b = fit_line([r["tensors"] for r in pts], [r[key] for r in pts])
                        fits[f"{model}/{transport}/{key}"] = {"intercept_s": round(a, 3), "us_per_tensor": round(b * 1e6, 1)}
        for k, v in fits.items():
            print(f"fit {k}: {v}")
    print(json.dumps({"runs": [{k: r[k] for k in ("model", "layers", "experts", "moe_ffn", "dense_ffn", "transport",
                                                  "bucket_mb", "sync_s", "floor_s", "load_s", "load_calls", "actor_s", "tensors",
                                                  "buckets", "flattened_buckets", "bytes", "sync_s_all", "floor_s_all")} for r in runs],
                      "fits": fits, "sweep": args.sweep, "syncs": args.syncs, "dtype": "fp32"}))


if __name__ == "__main__":
    main()
