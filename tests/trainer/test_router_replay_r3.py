"""R3 end to end: the trainer asks the SGLang servers (stand-ins serving the HF Qwen3-MoE, routing with its
own routers, answering in SGLang's encoding) for each request's routed experts, sends each row's routing to
the ranks that train it, and replays it in the old_log_prob and update passes.

The servers route with the weights the actor pushed, in fp32: replaying their routing, the actor routes as
the servers did (rollout_mismatch_frac 0: the Megatron routers' own top-k equals the HF routers' at every
prompt and response position of every row and layer), every MoE layer takes it (engaged_layers 4), and the
log-probs agree with the servers' to round-off. One process, the MoE recipe's TP 2 x EP 2 on 4, and
PP 2 x EP 2 with full recompute on 4 (R3 and R2).
"""

from __future__ import annotations

import pytest

from tests.standin import StandinServer, free_port
from tests.trainer.test_cluster_in_a_box import _check_every_step, _hf_model, _launch, _overrides


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("r3")
    hf_dir = _hf_model(tmp, "moe")
    args = ["--enable-deterministic-inference", "--enable-memory-saver", "--enable-return-routed-experts"]
    servers = [StandinServer(model_path=hf_dir, tp_size=2, args=args, log_dir=tmp / f"srv{i}").start()
               for i in range(2)]
    yield tmp, hf_dir, [s.url for s in servers]
    for s in servers:
        s.stop()


def _check_replay(scalars, steps, mode: str):
    for step in steps:
        assert scalars["router_replay/engaged_layers"][step] == 4.0, step
        if mode == "r3":
            assert scalars["router_replay/rows_with_routing"][step] == 1.0
            assert scalars["router_replay/rollout_mismatch_frac"][step] == 0.0, step
        else:  # the first mini-batch replays at the recorded weights, the second after one optimizer step
            assert 0.0 <= scalars["router_replay/mismatch_frac"][step] < 0.5, step


@pytest.mark.timeout(1200)
@pytest.mark.multiproc
def test_r3_replays_the_servers_routing_on_one_process(moe):
    tmp, hf_dir, urls = moe
    # with a KL loss: the reference replays the rollout's routing too
    scalars, report, _ = _launch(tmp / "one", _overrides(hf_dir, urls, "actor.router_replay=r3",
                                                         "actor.use_kl_loss=true"), 1, 0)
    _check_every_step(scalars, report, [1, 2, 3])
    _check_replay(scalars, [1, 2, 3], "r3")
    assert all(v >= 0 for v in scalars["actor/kl_loss"].values())


LAYOUTS = {"tp2_ep2": ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2",
                       "parallel.expert_tensor_parallel_size=1"],
           "pp2_ep2": ["parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=2",
                       "model.recompute=full"]}


@pytest.mark.timeout(1800)
@pytest.mark.multiproc
@pytest.mark.parametrize(("layout", "mode"), [("tp2_ep2", "r3"), ("pp2_ep2", "r3"), ("pp2_ep2", "r2")])
def test_replay_at_the_moe_layout_on_4_processes(moe, layout, mode):
    """r3: rank 0 sends each row's routing to the ranks of the DP rank that trains it (TP peers, PP stages
    take their layers); r2 in the full trainer at PP 2 with full recompute."""
    tmp, hf_dir, urls = moe
    overrides = _overrides(hf_dir, urls, "trainer.n_gpus_per_node=4", *LAYOUTS[layout], f"actor.router_replay={mode}")
    port = free_port()
    scalars, report, _ = _launch(tmp / f"{layout}_{mode}", overrides, 4, port)
    _check_every_step(scalars, report, [1, 2, 3])
    _check_replay(scalars, [1, 2, 3], mode)
