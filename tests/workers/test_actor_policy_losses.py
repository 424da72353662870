"""actor.policy_loss selects gspo and cispo, and the actor passes them its loss fields by keyword."""

import pytest
import torch

from megatron_dapo.config import load_config
from tests.workers._actor_cases import PAD, VOCAB, flat_params, overrides, policy_batch, random_batch


@pytest.fixture(scope="module")
def pgs():
    from megatron_dapo.parallel import init_parallel

    return init_parallel()


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_actor_policy_loss_selects_the_loss_and_every_field_reaches_it(pgs, name):
    from megatron_dapo.workers.build import build_actor

    fields = {"actor.policy_loss": name, "actor.clip_ratio_low": 0.0003, "actor.clip_ratio_high": 0.0004,
              "actor.loss_agg_mode": "seq-mean-token-mean", "actor.ppo_mini_batch_size": 4}
    a = build_actor(load_config("configs/tiny_cpu.yaml", overrides(**fields)), pgs, vocab_size=VOCAB, pad_id=PAD)
    assert a.loss_fn.__name__ == f"compute_policy_loss_{name}"
    seen = []
    real = a.loss_fn
    a.loss_fn = lambda **kw: seen.append(kw) or real(**kw)
    before = flat_params(a).clone()
    metrics = a.update_policy(policy_batch(a, random_batch()))
    assert seen
    for kw in seen:
        assert (kw["clip_ratio_low"], kw["clip_ratio_high"], kw["loss_agg_mode"]) == (0.0003, 0.0004,
                                                                                      "seq-mean-token-mean")
    # One mini-batch from the weights that made old_log_prob: ratio 1, nothing clipped, and a step taken.
    assert abs(metrics["actor/ppo_kl"]) < 1e-6 and metrics["actor/pg_clipfrac"] == 0.0
    assert not torch.equal(flat_params(a), before)
