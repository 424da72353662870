"""A real SGLang 0.5.23 server of a tiny Qwen3-MoE (4 experts, top-2; tests/sglang_real/model.py), launched
once for this module with --enable-return-routed-experts, beside the session's two Qwen2 servers:

- a server of another model than the others is refused at connect, naming both;
- the sync trainer trains against it, without and with R3 (the routing the server chose, replayed);
- R3 in the queue trainer's async mode: the producer process asks the server for each request's routing,
  decodes it and writes it with its claim; rank 0 reads the trained rows' routing back from the queue, and
  the actor replays it.

The module's tests run on the pytest-xdist worker of the shared servers, one after the other, so the MoE
server starts once."""

from __future__ import annotations

import dataclasses
import sys
import time

import pytest

from tests.sglang_real.conftest import ROOT, cpu_server_overrides, free_port_pair
from tests.sglang_real.test_train import (
    MEAN_DIFF_TOL,
    STEPS,
    _check_log_probs,
    _run,
    _scalars,
    train_overrides,
)

pytestmark = pytest.mark.xdist_group("sglang_shared_servers")


@dataclasses.dataclass
class MoEServer:
    model_dir: str
    tokenizer_dir: str
    server: object


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    """One real Qwen3-MoE server (TP 1, fp32, routed experts returned, no radix cache: the queue trainer pushes
    into running generation), launched through the trainer's own launch plan with actor.router_replay=r3."""
    from megatron_dapo.config import load_config
    from megatron_dapo.rollout.sglang.build import sglang_launch_plan
    from megatron_dapo.rollout.sglang.server import launch_servers
    from tests.sglang_real.conftest import assert_all_gone, server_tree
    from tests.sglang_real.model import write_tiny_qwen3_moe

    moe_dir, moe_tok = write_tiny_qwen3_moe(str(tmp_path_factory.mktemp("real_moe") / "model"))
    log_dir = tmp_path_factory.mktemp("real_moe_server")
    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        *train_overrides(moe_dir, moe_tok), *cpu_server_overrides(), f"rollout.server_base_port={free_port_pair()}",
        "actor.router_replay=r3", f"trainer.output_dir={log_dir}"])
    specs, launcher, env = sglang_launch_plan(cfg)
    spec = dataclasses.replace(specs[0], extra_args=(*specs[0].extra_args, "--disable-radix-cache"))
    t0 = time.monotonic()
    (server,) = launch_servers([spec], log_dir=log_dir, timeout_s=600, launcher=launcher, env=env)
    print(f"\nreal SGLang Qwen3-MoE server {server.url} up in {time.monotonic() - t0:.1f} s")
    yield MoEServer(moe_dir, moe_tok, server)
    pids = server_tree([server])
    server.stop()
    assert_all_gone(pids)


def test_a_server_of_another_model_is_refused_at_connect_naming_both(real_servers, moe_server, tmp_path):
    """The Qwen3-MoE server next to the session's Qwen2 servers: the engine refuses the set at connect (each
    server's /model_info model_type and architectures), and the trainer refuses a server whose model is not
    model.hf_path's, naming the key. (Another release is refused the same way: tests/rollout, stand-ins
    of each release, since one venv holds one SGLang.)"""
    from megatron_dapo.config import ConfigError, load_config
    from megatron_dapo.rollout.base import RolloutEngineError
    from megatron_dapo.rollout.sglang.build import connect as _connect
    from megatron_dapo.rollout.sglang.engine import SGLangEngine

    moe = moe_server.server
    qwen2 = real_servers.urls[0]
    with pytest.raises(RolloutEngineError, match=rf"serve different models \({qwen2}: model_type 'qwen2', "
                                                 rf"architectures \['Qwen2ForCausalLM'\]; {moe.url}: model_type "
                                                 r"'qwen3_moe', architectures \['Qwen3MoeForCausalLM'\]\)"):
        SGLangEngine([qwen2, moe.url])
    actor_qwen2 = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        *train_overrides(real_servers.model_dir, real_servers.tokenizer_dir), f"rollout.sglang_urls=[{moe.url}]",
        "rollout.require_memory_saver=false", f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model.hf_path.*serve model_type 'qwen3_moe'.*is model_type 'qwen2'"):
        _connect(actor_qwen2, [moe.url])
    own = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        *train_overrides(moe_server.model_dir, moe_server.tokenizer_dir), f"rollout.sglang_urls=[{moe.url}]",
        f"trainer.output_dir={tmp_path}"])
    _connect(own, [moe.url]).close()  # its own model: accepted


def test_r3_in_the_async_queue_trainer_replays_the_routing_the_real_server_chose(moe_server, tmp_path):
    """actor.router_replay=r3 with queue.max_staleness=1 and pushes into running generation: every trained row
    carries the routing the server returned (the producer process decoded SGLang's base64 and wrote it into
    the SQLite queue with its claim), and both MoE layers take it at every step. Step 1 trains rows of the
    weights the actor holds (nothing was pushed before it): the actor's own routers choose the replayed
    experts at every routed position (rollout_mismatch_frac 0: layer order, positions and ids came through
    the queue intact) and its log-probs equal the server's to round-off. Later steps train rows one push old
    (some spanning a push, their routing too): at lr 1e-4 the actor's routers move off the replayed experts
    at ~2% of positions (measured 0.020 and 0.006), while routing read at a wrong position or layer would
    disagree at about half of them (top-2 of 4 experts)."""
    url = moe_server.server.url
    _run([sys.executable, "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml",
          *train_overrides(moe_server.model_dir, moe_server.tokenizer_dir, f"rollout.sglang_urls=[{url}]",
                           "rollout.mode=disaggregate", "actor.router_replay=r3", "queue.enable=true",
                           "queue.max_staleness=1", "queue.partial_rollout=true", "queue.num_producers=1",
                           "queue.claim_prompts=2", "actor.lr=1e-4", f"trainer.output_dir={tmp_path}")], tmp_path)
    scalars = _scalars(tmp_path)
    for step in (1, 2, 3):
        assert scalars["router_replay/rows_with_routing"][step] == 1.0, step
        assert scalars["router_replay/engaged_layers"][step] == 2.0, step
        assert 0.0 <= scalars["router_replay/rollout_mismatch_frac"][step] < 0.1, step
    assert scalars["router_replay/rollout_mismatch_frac"][1] == 0.0
    assert scalars["rollout_corr/log_prob_abs_diff"][1] < MEAN_DIFF_TOL


def _sync_train(moe_server, tmp_path, *more: str) -> dict:
    url = moe_server.server.url
    _run([sys.executable, "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml",
          *train_overrides(moe_server.model_dir, moe_server.tokenizer_dir, f"rollout.sglang_urls=[{url}]",
                           "rollout.mode=disaggregate", f"trainer.output_dir={tmp_path}", *more)], tmp_path)
    return _scalars(tmp_path)


def test_the_sync_trainer_trains_against_the_qwen3_moe_server(moe_server, tmp_path):
    """Qwen3-MoE (4 experts, top-2) serves on the CPU server: the actor (Megatron MoE layers from the same
    checkpoint, its own routers) trains 3 steps against it and recomputes the server's log-probs to round-off.
    Top-2 routing of fp32 scores that agree to ~1e-6 picks the same experts on both sides unless two scores
    tie that closely, which these random weights do not produce."""
    _check_log_probs(_sync_train(moe_server, tmp_path))
    assert "Qwen3MoeForCausalLM" in moe_server.server.log_path.read_text(errors="replace")


def test_r3_replays_the_routing_the_real_server_chose(moe_server, tmp_path):
    """actor.router_replay=r3 against the real server: the trainer's launch plan starts it with
    --enable-return-routed-experts, every request returns its routed experts (SGLang's own int32 base64),
    and the actor replays them in the old_log_prob and update passes. The actor's own routers would choose
    the same experts at every routed position of every row and layer (rollout_mismatch_frac 0: the
    server's layer order, token positions and expert ids are read right), both MoE layers took the
    replayed routing, and the log-probs still agree with the server's to round-off."""
    scalars = _sync_train(moe_server, tmp_path, "actor.router_replay=r3")
    _check_log_probs(scalars)
    assert "'enable_return_routed_experts': True" in moe_server.server.log_path.read_text(errors="replace")
    for name, want in (("router_replay/rows_with_routing", 1.0), ("router_replay/rollout_mismatch_frac", 0.0),
                       ("router_replay/engaged_layers", 2.0)):
        assert scalars[name] == dict.fromkeys(range(1, STEPS + 1), want), (name, scalars[name])
