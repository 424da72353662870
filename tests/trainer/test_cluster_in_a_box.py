"""A cluster in a box: the trainer on 4 gloo processes in the recipes' layouts (scaled down) drives 2
SGLang stand-in servers with server TP 2, each its own process and generating with a real HF model
built from the weights it received.

After every step every HF tensor at every server TP rank equals the actor's own HF export (sha256),
`rollout_corr/log_prob_abs_diff` (servers' log-probs against the actor's, fp32) stays at round-off,
colocated servers released and resumed their memory in verl's order (the stand-in refuses to generate
otherwise), and resuming at step 2 gives the uninterrupted run's losses; a checkpoint written at
TP2 x PP2 resumes at TP1 x PP1. A killed server never hangs the run.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.standin import StandinServer, free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = 18  # the arithmetic task's character tokenizer


def _hf_model(out: pathlib.Path, kind: str) -> str:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_hidden_layers=4, tie_word_embeddings=False)
    if kind == "dense":
        config = transformers.Qwen2Config(rope_theta=10000.0, **common)
    else:
        config = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             norm_topk_prob=True, **common)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # far from uniform, so a wrong or missing tensor shows in the log-probs
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.1 * torch.randn(p.shape, generator=g)) if "norm" in name
                    else 0.08 * torch.randn(p.shape, generator=g))
    path = out / f"hf_{kind}"
    model.save_pretrained(path)
    return str(path)


def _servers(tmp_path, hf_dir, n=2):
    args = ["--enable-deterministic-inference", "--enable-memory-saver"]
    return [StandinServer(model_path=hf_dir, tp_size=2, args=args, log_dir=tmp_path / f"srv{i}").start()
            for i in range(n)]


def _overrides(hf_dir, urls, *layout):
    return ["model.arch=hf", f"model.hf_path={hf_dir}", "rollout.engine=sglang",
            f"rollout.sglang_urls=[{','.join(urls)}]", "rollout.tensor_model_parallel_size=2",
            "rollout.deterministic_inference=true", "rollout.weight_sync_bucket_mb=0.02",
            "data.train_batch_size=4", "data.gen_batch_size=null", "rollout.n=4", "actor.ppo_mini_batch_size=2",
            "data.max_response_length=6", "reward.overlong_buffer.len=4", "algorithm.filter_groups.enable=false",
            "trainer.sft_warmup_steps=0", "trainer.test_freq=0", "trainer.val_before_train=false",
            "trainer.logger=[tensorboard]", "trainer.total_training_steps=3", "trainer.save_freq=2",
            "actor.lr=1e-3", *layout]


def _launch(out: pathlib.Path, overrides, nproc: int, port: int):
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
        "127.0.0.1", "--master_port", str(port)]
    # Output to a file, not a pipe: with the ipc transport on CPU the ranks start torch_shm_manager, which
    # inherits their stdout and lives as long as the stand-in servers holding the shared tensors, so a
    # pipe would not reach EOF when the launch ends.
    log = out / "launch.log"
    with open(log, "w") as f:
        rc = subprocess.run([*launcher, str(ROOT / "tests/trainer/_mp_cluster.py"), str(out), *overrides],
                            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900).returncode
    assert rc == 0, log.read_text()[-8000:]
    acc = EventAccumulator(str(out / "tiny_cpu/tb"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    report = json.loads((out / "report.json").read_text())
    stats = [json.loads((out / f"sync_stats.rank{k}.json").read_text()) for k in range(nproc)]
    return scalars, report, stats


def _check_every_step(scalars, report, steps):
    assert [e["version"] for e in report] == list(range(steps[0] - 1, steps[-1] + 1))  # the start sync too
    for entry in report:
        assert entry["expected"] > 0 and not entry["mismatch"], (entry["version"], entry["mismatch"][:5])
    for step in steps:  # servers' log-probs (HF model, fp32) against the actor's (Megatron, fp32)
        assert scalars["rollout_corr/log_prob_abs_diff"][step] < 1e-5, (step, scalars["rollout_corr/log_prob_abs_diff"])


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster_dense")
    hf_dir = _hf_model(tmp, "dense")
    servers = _servers(tmp, hf_dir)
    yield tmp, hf_dir, [s.url for s in servers], servers
    for s in servers:
        s.stop()


@pytest.mark.timeout(1500)  # 4 trainer + 2 server processes on 2 cores: minutes, more on a loaded machine
@pytest.mark.multiproc
def test_tp2_pp2_trains_3_steps_with_every_tensor_at_every_server_and_resumes(dense):
    tmp, hf_dir, urls, servers = dense
    layout = ["trainer.n_gpus_per_node=4", "parallel.tensor_model_parallel_size=2",
              "parallel.pipeline_model_parallel_size=2", "actor.offload_optimizer=true"]
    port = free_port()
    scalars, report, stats = _launch(tmp / "full", _overrides(hf_dir, urls, *layout), 4, port)
    _check_every_step(scalars, report, [1, 2, 3])
    # Every rank, every step: the servers release, the optimizer comes back, the update's two optimizer
    # steps, then the optimizer goes to the host, gc.collect and empty_cache, and only then the servers
    # resume their weights and, after the sync, their KV cache (the start-up sync: nothing to resume).
    step = ["release:weights,kv_cache", "reload", "optimizer.step", "optimizer.step",
            "offload", "gc.collect", "empty_cache", "resume:weights", "resume:kv_cache"]
    for rank in range(4):
        events = json.loads((tmp / f"full/memory_events.rank{rank}.json").read_text())
        assert [e for e in events if not e.endswith(":none")] == ["offload", "gc.collect", "empty_cache"] + 3 * step, (
            rank, events)
    n_tensors = report[0]["expected"]
    # Two stage senders (ranks 0 and 2) between them send every tensor; ranks 1 and 3 only their TP shards.
    sent = [sum(s["tensors"] for s in per_rank) for per_rank in stats]
    assert sent[0] + sent[2] == 4 * n_tensors and sent[1] == sent[3] == 0, sent
    # The bytes each rank moved are the planner's (megatron_dapo/plan/weights.py), exactly.
    from megatron_dapo.models.hf import arch_from_hf
    from megatron_dapo.plan.weights import plan_weight_sync

    plan = plan_weight_sync(arch_from_hf(hf_dir), tp=2, pp=2, dtype_bytes=4, transport="distributed", server_ranks=4)
    for stage, (sender, peer) in enumerate(((0, 1), (2, 3))):
        for got_s, got_p in zip(stats[sender], stats[peer], strict=True):
            assert got_s["bytes_gathered"] == plan.stages[stage].sender_gathers > 0
            assert got_s["bytes_sent"] == plan.sender_egress(stage) == 4 * plan.stages[stage].stage_bytes
            assert got_p["bytes_sent"] == plan.stages[stage].peer_sends and got_p["bytes_gathered"] == 0
    for s in servers:  # colocated: the memory was released during training and is back now
        st = s.stats()
        assert st["weight_version"] == "3" and st["released"] == [], st
        # verl's order each step: generate, release everything, resume weights, update, resume the KV cache
        events = []
        for path, body in s.requests():
            if path.endswith("_memory_occupation"):
                events.append(f"{path.strip('/').split('_')[0]}:{','.join(body.get('tags') or ['all'])}")
            elif path in ("/generate", "/update_weights_from_distributed") and (not events or events[-1] != path):
                events.append(path)
        # (a server may get no /generate in a step: rank 0 spreads each batch by load)
        held, releases = {"weights", "kv_cache"}, 0
        for e in events:
            if e == "/generate":
                assert held == {"weights", "kv_cache"}, events  # never while anything is released
            elif e == "/update_weights_from_distributed":
                assert held == {"weights"} or (releases == 0 and len(held) == 2), events
            elif e.startswith("release:"):
                assert held == {"weights", "kv_cache"} and e == "release:kv_cache,weights", events
                held, releases = set(), releases + 1
            else:  # resume: weights first, then the KV cache after the update
                tag = e.split(":")[1]
                assert tag == ("weights" if not held else "kv_cache"), events
                held.add(tag)
        assert releases == 3 and held == {"weights", "kv_cache"}, events

    # Resuming at step 2 (its checkpoint) in fresh processes gives the uninterrupted run's step 3.
    ckpt = tmp / "full/tiny_cpu/ckpt/global_step_2"
    resumed, report2, _ = _launch(tmp / "resumed", _overrides(hf_dir, urls, *layout, f"trainer.resume_mode={ckpt}"),
                                  4, free_port())
    _check_every_step(resumed, report2, [3])
    for tag in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
        assert resumed[tag][3] == pytest.approx(scalars[tag][3], rel=1e-5, abs=1e-7), tag
    # The TP2 x PP2 checkpoint resumes at TP1 x PP1 (dist_checkpointing reshards): the same step 3.
    single, report1, _ = _launch(tmp / "single", _overrides(hf_dir, urls, f"trainer.resume_mode={ckpt}"), 1, 0)
    _check_every_step(single, report1, [3])
    for tag in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
        assert single[tag][3] == pytest.approx(scalars[tag][3], rel=1e-4, abs=1e-6), tag


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.multiproc
def test_tp2_ep2_moe_trains_3_steps_with_every_expert_at_every_server(tmp_path):
    """The MoE recipe's shape: TP 2 x EP 2 with expert-TP 1 (sequence parallel): every expert of both EP
    ranks reaches both servers (Qwen3-MoE in the stand-in) after every step."""
    hf_dir = _hf_model(tmp_path, "moe")
    servers = _servers(tmp_path, hf_dir)
    try:
        layout = ["trainer.n_gpus_per_node=4", "parallel.tensor_model_parallel_size=2",
                  "parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=1"]
        scalars, report, _ = _launch(tmp_path / "moe", _overrides(hf_dir, [s.url for s in servers], *layout), 4,
                                     free_port())
        _check_every_step(scalars, report, [1, 2, 3])
        assert any(".mlp.experts.3." in name for name in servers[0].checksums()[1])
    finally:
        for s in servers:
            s.stop()


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.multiproc
def test_pp2_dp2_with_virtual_stages_trains_3_steps(dense, tmp_path):
    """PP 2 x DP 2 with 2 virtual stages per rank: each rank's two chunks stream through its stage's
    sender; data-dependent micro-batch counts are rounded for the interleaved schedule."""
    _, hf_dir, urls, _ = dense
    layout = ["trainer.n_gpus_per_node=4", "parallel.pipeline_model_parallel_size=2",
              "parallel.virtual_pipeline_model_parallel_size=2"]
    scalars, report, _ = _launch(tmp_path / "vpp", _overrides(hf_dir, urls, *layout), 4, free_port())
    _check_every_step(scalars, report, [1, 2, 3])


@pytest.mark.multiproc
def test_a_server_killed_mid_generation_leaves_the_rotation_and_the_run_finishes_on_the_other(tmp_path):
    """Two DP ranks, two toy servers given by URL; the second dies after a few generated tokens. Rank 0's
    engine takes it out of the rotation, re-issues its request on the first, the weight syncs (a gloo
    group of the trainer and the servers) are re-formed without it, and both steps finish. (The real-server
    version, with the trainer restarting the server: tests/sglang_real/test_server_death.py.)"""
    from megatron_dapo.data.tokenizer import CharTokenizer

    toy = ["--toy-vocab-size", str(CharTokenizer().vocab_size), "--enable-deterministic-inference"]
    servers = [StandinServer(toy=True, args=toy, log_dir=tmp_path / f"s{i}").start() for i in range(2)]
    try:
        servers[1].knobs(kill_after_tokens=3)
        cfg = ["rollout.engine=sglang", f"rollout.sglang_urls=[{servers[0].url},{servers[1].url}]",
               "rollout.deterministic_inference=true", "rollout.max_retries=1", "trainer.n_gpus_per_node=2",
               "data.train_batch_size=4", "data.gen_batch_size=null", "rollout.n=4", "actor.ppo_mini_batch_size=2",
               "data.max_response_length=6", "reward.overlong_buffer.len=4", "algorithm.filter_groups.enable=false",
               "trainer.sft_warmup_steps=0", "trainer.test_freq=0", "trainer.val_before_train=false",
               "trainer.logger=[]", "trainer.total_training_steps=2", "trainer.save_freq=-1",
               "rollout.mode=disaggregate"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "megatron_dapo.train", "--config",
               "configs/tiny_cpu.yaml", *cfg, f"trainer.output_dir={tmp_path}"]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and not servers[1].is_running(), out[-3000:]
        assert f"SGLang server {servers[1].url}: down" in out and "request re-sent to" in out, out[-3000:]
        assert servers[0].stats()["weight_version"] == "2", out[-3000:]
    finally:
        for s in servers:
            s.stop()


@pytest.mark.timeout(1200)
@pytest.mark.multiproc
def test_colocated_ipc_transport_reaches_every_server_from_the_node_leader(dense, tmp_path):
    """rollout.weight_transport=ipc (colocated; on CPU the handles are shared-memory file names, like CUDA
    IPC handles node-local): TP 2 on one node, whose first rank posts every bucket to both servers."""
    _, hf_dir, urls, _ = dense
    layout = ["trainer.n_gpus_per_node=2", "parallel.tensor_model_parallel_size=2", "rollout.weight_transport=ipc",
              "trainer.total_training_steps=2"]
    scalars, report, stats = _launch(tmp_path / "ipc", _overrides(hf_dir, urls, *layout), 2, free_port())
    _check_every_step(scalars, report, [1, 2])
    assert [s["tensors"] for s in stats[0]] == [report[0]["expected"]] * 3 and all(s["tensors"] == 0 for s in stats[1])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.multiproc
def test_ipc_transport_across_two_nodes_feeds_each_nodes_servers_from_its_leader(tmp_path):
    """Two torchrun agents on one host as two nodes (TP 2 x PP 2: stage 0 on node 0, stage 1 on node 1), one
    server per node (rollout.sglang_server_nodes): each stage's sender broadcasts its buckets to the other
    node's leader, and every node's leader posts them to its own server only."""
    hf_dir = _hf_model(tmp_path, "dense")
    servers = _servers(tmp_path, hf_dir)
    try:
        urls = [s.url for s in servers]
        overrides = _overrides(hf_dir, urls, "trainer.nnodes=2", "trainer.n_gpus_per_node=2",
                               "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                               "rollout.weight_transport=ipc", "rollout.sglang_server_nodes=[0,1]",
                               "trainer.total_training_steps=2")
        out = tmp_path / "two_nodes"
        out.mkdir()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        port = free_port()
        # Output to files, not pipes: the torch_shm_manager of the ipc handles outlives the agents (until the
        # stand-ins release the tensors) and would hold a pipe open, so reading it to EOF would wait for that.
        files = [open(out / f"agent{node}.log", "w") for node in (0, 1)]
        agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                                    str(node), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                                    str(port), str(ROOT / "tests/trainer/_mp_cluster.py"), str(out), *overrides],
                                   cwd=ROOT, env=env, stdout=files[node], stderr=subprocess.STDOUT)
                  for node in (0, 1)]
        for a, f in zip(agents, files, strict=True):
            a.wait(timeout=900)
            f.close()
        logs = [(out / f"agent{node}.log").read_text(errors="replace") for node in (0, 1)]
        assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
        report = json.loads((out / "report.json").read_text())
        assert [e["version"] for e in report] == [0, 1, 2] and all(not e["mismatch"] for e in report), report
        # Every bucket reached each server exactly once (node 0's leader posts to server 0, node 1's to server 1).
        counts = [len(s.requests("/update_weights_from_tensor")) for s in servers]
        assert counts[0] == counts[1] > 0, counts
    finally:
        for s in servers:
            s.stop()
