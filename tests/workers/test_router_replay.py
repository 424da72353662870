"""MoE routing replay (actor.router_replay) on one process, through the trainer's own build path.

- Replaying a chosen routing gives the log-probs of routing those experts by hand (a hook that replaces
  each router's output with probabilities computed here from its logits and the chosen experts).
- The self-check: router_replay/engaged_layers and router_replay/mismatch_frac, and the error when the
  targets went to routers the forward never runs (a second build of the decoder).
The layouts (TP2 x EP2, PP2 x EP2 on 4 gloo processes): test_router_replay_mp.py.
"""

import pytest
import torch

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.workers.routing import RankRouters, RoutingReplay, seq_first
from tests.workers._actor_cases import PAD, VOCAB, capture_grads, overrides, policy_batch, random_batch

MOE = {"model.arch": "tiny_moe", "actor.ppo_mini_batch_size": 4}


@pytest.fixture(scope="module")
def pgs():
    from megatron_dapo.parallel import init_parallel

    return init_parallel()


def make_actor(pgs, **extra):
    from megatron_dapo.workers.build import build_actor

    return build_actor(load_config("configs/tiny_cpu.yaml", overrides(**{**MOE, **extra})), pgs, vocab_size=VOCAB,
                       pad_id=PAD)


def args(raw):
    return raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"]


def chosen_routing(raw, *, layers: int, experts: int, top_k: int, seed: int) -> dict[int, torch.Tensor]:
    """row -> [layers, prompt + response tokens, top_k] distinct random experts."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for row in range(len(raw["responses"])):
        n = int(raw["prompt_length"][row] + raw["response_length"][row])
        out[row] = torch.rand(layers, n, experts, generator=g).argsort(-1)[..., :top_k]
    return out


class ByHand:
    """Forward hooks that make every router output the routing of `chosen` ({row: [L, n, K]}), computed here
    from the router's own logits: probabilities = softmax over the chosen experts' logits (tiny_moe routes
    with softmax after top-k, no scaling), a boolean map of the chosen experts."""

    def __init__(self, routers: list, mb, chosen: dict[int, torch.Tensor]):
        tokens = mb.input_ids.numel()
        self.hooks = []
        for layer, r in enumerate(routers):
            assert r.config.moe_router_score_function == "softmax" and not r.config.moe_router_pre_softmax
            assert r.config.moe_router_topk_scaling_factor is None
            target = torch.arange(r.topk).repeat(tokens, 1)
            for k, row in enumerate(mb.rows.tolist()):
                rec = chosen[row][layer]
                target[seq_first(mb, mb.seq_start[k] + torch.arange(rec.shape[0]))] = rec
            self.hooks.append(r.register_forward_hook(self._hook(target)))

    @staticmethod
    def _hook(target):
        def hook(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            logits = x.float() @ module.weight.float().t()
            probs = torch.zeros_like(logits).scatter(1, target, torch.softmax(logits.gather(1, target), -1))
            routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, target, True)
            return probs.type_as(output[0]), routing_map
        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()


def test_replaying_a_chosen_routing_gives_the_log_probs_of_routing_it_by_hand(pgs):
    raw = random_batch(seed=9)
    a = make_actor(pgs, **{"actor.router_replay": "r2", "actor.max_tokens_per_microbatch": 4096})
    routers = a.policy._routers()
    (mb,) = a.policy.plan(*args(raw), [list(range(16))]).microbatches
    natural = a.compute_log_prob(*args(raw)).log_probs
    natural_routing = a.policy._routing["rows"]  # recorded (r2): the router's own choices
    mask = raw["response_mask"]

    # The hand computation reproduces the router itself when given its own choices.
    hand = ByHand(routers, mb, {r: t.long() for r, t in natural_routing.items()})
    try:
        assert torch.allclose(a.policy.compute_log_prob(*args(raw)).log_probs, natural, atol=1e-5, rtol=0)
    finally:
        hand.remove()

    chosen = chosen_routing(raw, layers=len(routers), experts=4, top_k=2, seed=3)
    a.policy.provide_routing(raw["responses"], chosen)
    replayed = a.compute_log_prob(*args(raw)).log_probs
    metrics = a.policy.last_replay_metrics
    a.policy._routing = None
    hand = ByHand(routers, mb, chosen)
    try:
        by_hand = a.compute_log_prob(*args(raw)).log_probs
    finally:
        hand.remove()
    torch.testing.assert_close(replayed * mask, by_hand * mask, atol=1e-5, rtol=0)
    assert float(((replayed - natural).abs() * mask).max()) > 0.05  # the chosen routing is not the router's own
    assert float(metrics["router_replay/engaged_layers"]) == 4
    assert 0.5 < float(metrics["router_replay/mismatch_frac"]) <= 1  # random pairs of 4: 5/6 differ


def test_the_update_replays_the_recorded_routing_and_reports_the_drift(pgs):
    raw = random_batch(seed=9)
    a = make_actor(pgs, **{"actor.router_replay": "r2"})
    b = policy_batch(a, raw)
    m = a.update_policy(b)  # one mini-batch: the update's weights are the recorded pass's
    assert m["router_replay/engaged_layers"] == 4 and m["router_replay/mismatch_frac"] == 0.0

    b = policy_batch(a, raw)
    with torch.no_grad():
        for r in a.policy._routers():
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(0)) * 5)
    m = a.update_policy(b)
    assert m["router_replay/engaged_layers"] == 4 and 0.2 < m["router_replay/mismatch_frac"] < 1


def test_full_recompute_replays_the_same_routing_in_the_recomputed_forward(pgs):
    """model.recompute=full (the MoE recipe's): Megatron runs each layer again in the backward pass; the
    recomputed routers take their micro-batch's recorded experts, so the gradient equals the one without
    recompute (several micro-batches: their targets queue per layer)."""
    raw = random_batch(seed=9)
    grads, routed = [], []
    for recompute in ("none", "full"):
        a = make_actor(pgs, **{"actor.router_replay": "r2", "model.recompute": recompute,
                               "actor.max_tokens_per_microbatch": 32})
        b = policy_batch(a, raw)
        with torch.no_grad():
            for r in a.policy._routers():
                r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(0)) * 5)
        seen = []
        hooks = [r.register_forward_hook(lambda m, i, o, seen=seen: seen.append((torch.is_grad_enabled(),
                                                                                  o[1].clone())))
                 for r in a.policy._routers()]
        snaps = capture_grads(a)
        try:
            m = a.update_policy(b)
        finally:
            for h in hooks:
                h.remove()
        assert m["router_replay/engaged_layers"] == 4
        grads.append(snaps[0])
        routed.append(seen)
    assert len(a.policy.plan(*args(raw), [list(range(16))]).microbatches) > 1
    plain, recomputed = routed
    assert len(recomputed) == 2 * len(plain)  # every layer of every micro-batch, twice
    forwards = [o for grad, o in recomputed if not grad]
    again = [o for grad, o in recomputed if grad]
    assert [torch.equal(x, y) for x, (_, y) in zip(forwards, plain)] == [True] * len(plain)
    # the backward recomputes in its own order: each recomputed map is one of the forwards' maps
    assert all(any(torch.equal(x, y) for y in forwards) for x in again)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_targets_sent_to_routers_the_forward_does_not_run_are_an_error(pgs):
    """verl #7340's failure: a second build of the decoder received the replay targets, the forward ran the
    first one's routers, nothing replayed. Here engaged_layers is 0 and the update raises."""
    raw = random_batch(seed=9)
    a = make_actor(pgs, **{"actor.router_replay": "r2"})
    orphan = make_actor(pgs, **{"actor.router_replay": "r2"})
    b = policy_batch(a, raw)
    policy = a.policy
    policy.replay = lambda responses: RoutingReplay(RankRouters(orphan.policy.chunks), policy._routing["rows"],
                                                    sequence_parallel=False, tp_size=1, tp_rank=0, device=pgs.device)
    with pytest.raises(RuntimeError, match="only 0 of the model's 4 MoE layers took the replayed routing"):
        a.update_policy(b)


def test_a_dense_model_with_replay_is_refused_at_build(pgs):
    with pytest.raises(ConfigError, match="actor.router_replay.*has no MoE layers"):
        make_actor(pgs, **{"model.arch": "tiny", "actor.router_replay": "r2"})


@pytest.mark.parametrize(("extra", "mode"), [({"actor.router_replay": "true"}, "r2"),
                                             ({"actor.router_replay": "false"}, "off"),
                                             ({"actor.router_replay": "off"}, "off"),
                                             ({"actor.router_replay": "r2", "trainer.n_gpus_per_node": 4,
                                               "parallel.tensor_model_parallel_size": 2,
                                               "parallel.pipeline_model_parallel_size": 2}, "r2")])
def test_router_replay_modes(extra, mode):
    assert load_config("configs/tiny_cpu.yaml", overrides(**{**MOE, **extra})).actor.router_replay == mode


@pytest.mark.parametrize(("extra", "text"), [
    ({"actor.router_replay": "r3"}, "needs rollout.engine=sglang"),
    ({"actor.router_replay": "r4"}, "expected one of 'off', 'r2', 'r3'"),
])
def test_unsupported_replay_settings_name_the_key(extra, text):
    with pytest.raises(ConfigError, match="actor.router_replay") as e:
        load_config("configs/tiny_cpu.yaml", overrides(**{**MOE, **extra}))
    assert text in str(e.value)


def test_the_supervised_warm_up_trains_without_replay(pgs):
    """The warm-up's NLL steps have no behaviour policy and no recorded routing: they route freely (before,
    a run with router replay and the warm-up failed at its first step)."""
    raw = random_batch(seed=9)
    a = make_actor(pgs, **{"actor.router_replay": "r2"})
    m = a.supervised_step(policy_batch(a, raw), lr=1e-3)
    assert "router_replay/engaged_layers" not in m and m["actor/grad_norm"] > 0
