"""The Megatron actor: log-probs, the DAPO update, and the guarantees the trainer relies on."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from megatron_dapo.config import load_config
from tests.standin import free_port
from tests.workers._actor_cases import (
    PAD,
    VOCAB,
    capture_grads,
    flat_params,
    overrides,
    policy_batch,
    random_batch,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def assert_same_grads(a, b):
    """Equal up to fp32 summation order (micro-batch shapes change matmul sizes): a wrong loss
    denominator would change the whole gradient by a factor, far beyond these bounds."""
    assert float((a - b).norm() / b.norm()) < 1e-5
    torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-4)


@pytest.fixture(scope="module")
def pgs():
    from megatron_dapo.parallel import init_parallel

    return init_parallel()


def make_actor(pgs, **extra):
    from megatron_dapo.workers.build import build_actor

    cfg = load_config("configs/tiny_cpu.yaml", overrides(**extra))
    return build_actor(cfg, pgs, vocab_size=VOCAB, pad_id=PAD)


def test_log_probs_do_not_depend_on_microbatching_or_padding(pgs):
    raw = random_batch()
    a = make_actor(pgs)
    args = (raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"])
    full = a.compute_log_prob(*args, with_entropy=True).log_probs
    a.policy.max_tokens = 16  # one or two rows per micro-batch
    split = a.compute_log_prob(*args).log_probs
    m = raw["response_mask"]
    torch.testing.assert_close(full * m, split * m, atol=1e-5, rtol=0)


def test_first_minibatch_ppo_kl_is_zero_when_nothing_changed(pgs):
    """The first-step invariant: old log-probs from the same weights give ratio 1 everywhere."""
    a = make_actor(pgs, **{"actor.ppo_mini_batch_size": 4})  # the whole batch is one mini-batch
    metrics = a.update_policy(policy_batch(a, random_batch()))
    assert abs(metrics["actor/ppo_kl"]) < 1e-6
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/pg_clipfrac_lower"] == 0.0


def test_on_policy_update_takes_old_log_probs_from_its_own_forward(pgs):
    """update_policy_on_policy == update_policy with a separately recomputed old_log_prob: the same
    gradient (ratio exactly 1), and the returned log-probs / sum p^2 are those of compute_log_prob."""
    import dataclasses

    raw = random_batch(seed=3)
    ref = make_actor(pgs, **{"actor.ppo_mini_batch_size": 4})  # the whole batch is one mini-batch
    before = ref.compute_log_prob(raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"],
                                  with_sum_sq=True)
    ref_grads = capture_grads(ref)
    m_ref = ref.update_policy(policy_batch(ref, raw))
    a = make_actor(pgs, **{"actor.ppo_mini_batch_size": 4})
    grads = capture_grads(a)
    m, lp = a.update_policy_on_policy(dataclasses.replace(policy_batch(a, raw), old_log_probs=None), with_sum_sq=True)
    assert len(grads) == len(ref_grads) == 1
    assert_same_grads(grads[0], ref_grads[0])
    mask = raw["response_mask"]
    torch.testing.assert_close(lp.log_probs, before.log_probs * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp.sum_sq_probs * mask, before.sum_sq_probs * mask, atol=1e-5, rtol=0)
    assert m["actor/ppo_kl"] == 0.0 and m["actor/pg_clipfrac"] == 0.0
    assert m["actor/pg_loss"] == pytest.approx(m_ref["actor/pg_loss"], abs=1e-5)
    assert torch.allclose(flat_params(a), flat_params(ref), atol=1e-6)
    with pytest.raises(ValueError, match="exactly one optimizer step"):  # two mini-batches
        make_actor(pgs).update_policy_on_policy(dataclasses.replace(policy_batch(a, raw), old_log_probs=None))
    with pytest.raises(ValueError, match="old_log_probs must be None"):
        a.update_policy_on_policy(policy_batch(a, raw))


def test_token_mean_update_is_invariant_to_microbatch_split(pgs):
    raw = random_batch(seed=1)
    results = []
    for max_tokens in (4096, 16):
        a = make_actor(pgs, **{"actor.max_tokens_per_microbatch": max_tokens} if max_tokens == 4096 else {})
        a.policy.max_tokens = max_tokens
        a.cfg = type(a.cfg)(**{**a.cfg.__dict__, "max_tokens_per_microbatch": max_tokens})
        grads = capture_grads(a)
        m = a.update_policy(policy_batch(a, raw, perturb_old=0.05))
        results.append((grads, m))
    (g1, m1), (g2, m2) = results
    assert len(g1) == len(g2) == 2  # two mini-batches, one optimizer step each
    for a_, b_ in zip(g1, g2):
        assert_same_grads(a_, b_)
    assert m1["actor/pg_loss"] == pytest.approx(m2["actor/pg_loss"], abs=1e-6)
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-5)


def test_every_actor_field_reaches_loss(pgs):
    """STYLE rule 2: each loss knob of the typed config is passed to the loss by keyword."""
    fields = {"actor.clip_ratio_low": 0.15, "actor.clip_ratio_high": 0.33, "actor.clip_ratio_c": 4.5,
              "actor.loss_agg_mode": "seq-mean-token-mean"}
    a = make_actor(pgs, **fields)
    seen = []
    real = a.loss_fn

    def spy(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    a.loss_fn = spy
    a.update_policy(policy_batch(a, random_batch()))
    assert seen
    for kw in seen:
        assert (kw["clip_ratio_low"], kw["clip_ratio_high"], kw["clip_ratio_c"]) == (0.15, 0.33, 4.5)
        assert kw["loss_agg_mode"] == "seq-mean-token-mean" and kw["dp_size"] == 1
        assert float(kw["batch_num_tokens"]) > 0 and float(kw["global_batch_size"]) == 8


def test_entropy_coeff_and_kl_loss_change_the_update(pgs):
    raw = random_batch(seed=2)
    base = make_actor(pgs)
    base.update_policy(policy_batch(base, raw))
    with_ent = make_actor(pgs, **{"actor.entropy_coeff": 0.5})
    with_ent.update_policy(policy_batch(with_ent, raw))
    assert not torch.allclose(flat_params(base), flat_params(with_ent))
    with_kl = make_actor(pgs, **{"actor.use_kl_loss": "true", "actor.kl_loss_coef": 1.0})
    b = policy_batch(with_kl, raw, perturb_old=0.1)
    b = type(b)(**{**b.__dict__, "ref_log_probs": b.old_log_probs - 0.3 * b.response_mask})
    m = with_kl.update_policy(b)
    assert m["actor/kl_loss"] > 0


@pytest.mark.multiproc
def test_dp2_update_equals_dp1_and_tp2_log_probs_equal_tp1(pgs, tmp_path):
    """One DAPO update on 2 gloo ranks (DP=2, per-rank plans of unequal micro-batch counts, run at equal
    counts) gives the DP=1 weights, and compute_log_prob all-gathers only the statistics asked for, at
    real tokens; TP=2 log-probs equal TP=1; the trainer's own PP=2 build, and PP=2 x VPP=2 with an odd
    micro-batch count (Megatron's interleaved schedule refused it before rounding), give PP=1's
    log-probs, loss and grad norm."""
    from megatron_dapo.models.forward import unwrap_model
    from megatron_dapo.models.weights import gather_canonical_state

    raw = random_batch(seed=3)
    a = make_actor(pgs)
    init = {name: t.clone() for name, t, _ in gather_canonical_state(unwrap_model(a.policy.chunks[0]), pgs=pgs)}
    torch.save(init, tmp_path / "init.pt")
    ref_lp = a.compute_log_prob(raw["prompt_ids"], raw["prompt_length"], raw["responses"],
                                raw["response_length"]).log_probs
    grads = capture_grads(a)
    ref_m = a.update_policy(policy_batch(a, raw, perturb_old=0.05))
    torch.save({"params": flat_params(a), "log_probs": ref_lp, "grads": grads}, tmp_path / "dp1.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / "tests/workers/_mp_actor.py"), str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ref = torch.load(tmp_path / "dp1.pt", weights_only=True)
    dp2 = torch.load(tmp_path / "dp2.pt", weights_only=True)
    tp2 = torch.load(tmp_path / "tp2.pt", weights_only=True)
    for g2, g1 in zip(dp2["grads"], ref["grads"], strict=True):
        assert_same_grads(g2, g1)
    torch.testing.assert_close(dp2["params"], ref["params"], atol=1e-4, rtol=0)
    m = raw["response_mask"]
    torch.testing.assert_close(tp2["log_probs"] * m, ref["log_probs"] * m, atol=1e-5, rtol=0)
    # per mini-batch (planned, agreed) on each rank: DP2_BUDGET makes the ranks plan 3 | 4 and 4 | 2
    assert dp2["counts"] == [[([3], [4]), ([4], [4])], [([4], [4]), ([2], [4])]]
    # [K, largest shard's real tokens] per all-gather: K = 1 (log-probs) unless entropy / sum p^2 are asked
    shard_tokens = max(int(raw["response_length"][rows].sum()) for rows in (dp2_shards(raw)))
    assert dp2["gathers"] == [(1, shard_tokens), (3, shard_tokens)]
    assert shard_tokens < raw["responses"].numel() // 2
    for name in ("pp2", "vpp2"):
        pp2 = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        torch.testing.assert_close(pp2["log_probs"] * m, ref["log_probs"] * m, atol=1e-5, rtol=0)
        assert float(pp2["pg_loss"]) == pytest.approx(ref_m["actor/pg_loss"], rel=1e-5, abs=1e-7), name
        assert float(pp2["grad_norm"]) == pytest.approx(ref_m["actor/grad_norm"], rel=1e-5), name
    vpp = torch.load(tmp_path / "vpp2.pt", weights_only=True)["counts"]
    # compute_log_prob (both mini-batches), policy_batch's, then the 2 updates: 3 each, run as 4
    assert vpp == [([3, 3], [4, 4]), ([3, 3], [4, 4]), ([3], [4]), ([3], [4])]


def dp2_shards(raw):
    """The DP=2 rows of compute_log_prob: mini-batches of 8 rows, contiguous halves (balance off)."""
    return [list(range(s, s + 4)) + list(range(s + 8, s + 12)) for s in (0, 4)]


def test_moe_routed_counts_cover_every_response_token_topk_times(pgs):
    """Load-balance counts: each MoE layer assigns every response token to exactly top-k experts."""
    a = make_actor(pgs, **{"model.arch": "tiny_moe"})
    raw = random_batch(seed=4)
    lp = a.compute_log_prob(raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"])
    counts = lp.routed_counts
    from megatron_dapo.models.arch import get_arch

    arch = get_arch("tiny_moe")
    assert counts.shape == (arch.num_layers, arch.num_moe_experts)
    n_tokens = int(raw["response_length"].sum())
    assert counts.sum(1).tolist() == [n_tokens * arch.moe_router_topk] * arch.num_layers
    dense = make_actor(pgs)
    assert dense.compute_log_prob(raw["prompt_ids"], raw["prompt_length"], raw["responses"],
                                  raw["response_length"]).routed_counts is None


def test_bypass_pg_is_preset_uses_reinforce_with_weights_from_the_current_policy(pgs):
    """bypass_pg_is: old := rollout log-probs, REINFORCE loss, sequence IS weights (threshold 2) of the
    current policy against the rollout policy, computed inside the loss."""
    a = make_actor(pgs, **{"algorithm.rollout_correction.preset": "bypass_pg_is"})
    assert a.loss_fn.__name__ == "compute_policy_loss_reinforce"
    seen = []
    real = a.loss_fn
    a.loss_fn = lambda **kw: seen.append(kw) or real(**kw)
    raw = random_batch(seed=5)
    b = policy_batch(a, raw)
    rollout = b.rollout_log_probs - 0.5 * raw["response_mask"]  # the engine's policy differs
    a.update_policy(type(b)(**{**b.__dict__, "rollout_log_probs": rollout, "old_log_probs": rollout}))
    w = seen[0]["rollout_is_weights"]
    assert w is not None and float(w.max()) <= 2.0 + 1e-6 and float(w.max()) > 1.0


def test_reference_is_a_frozen_copy_of_the_actor_at_build_time(pgs):
    from megatron_dapo.workers.build import build_reference

    a = make_actor(pgs, **{"actor.use_kl_loss": "true"})
    raw = random_batch(seed=6)
    args = (raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"])
    with_ref = lambda b: type(b)(**{**b.__dict__, "ref_log_probs": b.old_log_probs})  # noqa: E731
    with pytest.raises(ValueError, match="ref_log_probs"):
        a.update_policy(policy_batch(a, raw))
    a.update_policy(with_ref(policy_batch(a, raw, perturb_old=0.05)))  # the actor moves away from its init...
    ref = build_reference(a_cfg := load_config("configs/tiny_cpu.yaml", overrides(**{"actor.use_kl_loss": "true"})),
                          pgs, vocab_size=VOCAB, pad_id=PAD, actor=a)
    assert a_cfg.needs_reference
    m = raw["response_mask"]
    torch.testing.assert_close(ref.compute_log_prob(*args).log_probs * m, a.compute_log_prob(*args).log_probs * m)
    assert not any(p.requires_grad for c in ref.chunks for p in c.parameters())
    a.update_policy(with_ref(policy_batch(a, raw, perturb_old=0.05)))  # ...the reference stays where it was copied
    assert not torch.allclose(ref.compute_log_prob(*args).log_probs * m, a.compute_log_prob(*args).log_probs * m)


def test_fused_clipped_loss_kernel_gives_the_same_update_as_the_torch_loss(pgs):
    """actor.use_fused_kernels=true swaps the torch clipped loss for kernels.fused_clipped_token_loss (on CPU
    its chunked torch path): the same loss, metrics and gradients (log-probs come from one path either way)."""
    raw = random_batch(seed=7)
    results = []
    for fused in ("false", "true"):
        a = make_actor(pgs, **{"actor.use_fused_kernels": fused, "actor.entropy_coeff": 0.01})
        assert (a.loss_fn.__name__ == "_fused_vanilla_loss") == (fused == "true")
        grads = capture_grads(a)
        m = a.update_policy(policy_batch(a, raw, perturb_old=0.05))
        results.append((grads, m))
    (g1, m1), (g2, m2) = results
    for x, y in zip(g1, g2):
        assert_same_grads(y, x)
    for k in ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert m1[k] == pytest.approx(m2[k], abs=1e-6), k


def test_mtp_detach_trunk_keeps_the_mtp_loss_out_of_the_decoder_layers(pgs):
    """With the trunk detached, the decoder layers get exactly the gradient they get without any MTP loss,
    while the MTP layer still trains."""
    from megatron_dapo.models.forward import unwrap_model

    raw = random_batch(seed=8)

    def decoder_and_mtp_grads(**extra):
        a = make_actor(pgs, **{"model.mtp_num_layers": 1, "actor.ppo_mini_batch_size": 4, **extra})
        grads = {}
        step = a.optimizer.step

        def spy():
            for name, p in unwrap_model(a.policy.chunks[0]).named_parameters():
                grads[name] = p.main_grad.detach().clone()
            return step()

        a.optimizer.step = spy
        a.update_policy(policy_batch(a, raw, perturb_old=0.05))
        return grads

    detached = decoder_and_mtp_grads(**{"actor.mtp_detach_trunk": "true"})
    no_mtp_loss = decoder_and_mtp_grads(**{"actor.mtp_loss_scaling_factor": 0.0})
    attached = decoder_and_mtp_grads()
    layers = [n for n in detached if n.startswith("decoder.layers.")]
    assert layers
    for n in layers:
        torch.testing.assert_close(detached[n], no_mtp_loss[n], atol=1e-7, rtol=1e-5)
    assert any(not torch.allclose(attached[n], no_mtp_loss[n]) for n in layers)  # attached: MTP reaches the trunk
    assert any(float(detached[n].abs().sum()) > 0 for n in detached if n.startswith("mtp."))


def test_router_replay_trains_with_the_recorded_expert_choices(pgs):
    """actor.router_replay: the training forward routes every token to the experts recorded in the
    old_log_prob pass, even after the router weights changed; without replay the choices change."""
    raw = random_batch(seed=9)

    def routed_sets(replay: bool):
        a = make_actor(pgs, **{"model.arch": "tiny_moe", "actor.router_replay": str(replay).lower(),
                               "actor.ppo_mini_batch_size": 4})
        b = policy_batch(a, raw)  # compute_log_prob: records the routing when replay is on
        routers = a.policy._routers()
        with torch.no_grad():
            for r in routers:
                r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(0)) * 5)
        seen = []
        hooks = [r.register_forward_hook(lambda m, i, o: seen.append(o[1].detach().clone())) for r in routers]
        try:
            a.update_policy(b)
        finally:
            for h in hooks:
                h.remove()
        return a, seen

    from megatron_dapo.workers.routing import seq_first

    a, seen = routed_sets(True)
    record = a.policy._routing["rows"]
    assert sorted(record) == list(range(16))
    assert all(rec.dtype == torch.uint8 and rec.shape[0] == len(a.policy._routers()) for rec in record.values())
    # one micro-batch holds the whole mini-batch here; compare each router's map with the recorded top-k
    (mb,) = a.policy.plan(raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"],
                          [list(range(16))]).microbatches
    for layer, routing_map in enumerate(seen[: len(a.policy._routers())]):
        for k, row in enumerate(mb.rows.tolist()):
            rec = record[row][layer].long()
            chosen = routing_map[seq_first(mb, mb.seq_start[k] + torch.arange(rec.shape[0]))]
            expected = torch.zeros(rec.shape[0], chosen.shape[-1], dtype=torch.bool)
            expected.scatter_(1, rec, True)
            assert torch.equal(chosen, expected), (layer, row)
    _, fresh = routed_sets(False)
    assert any(not torch.equal(x, y) for x, y in zip(seen, fresh))


def test_lr_warmup_counts_training_steps_not_optimizer_steps(pgs):
    """actor.lr_warmup_steps counts training steps (verl's unit): with 4 mini-batches per step and a
    4-step warm-up, step k trains at lr * k / 4 on every mini-batch, then at lr; never at 0."""
    lr = 1e-3
    a = make_actor(pgs, **{"actor.lr_warmup_steps": 4, "actor.ppo_mini_batch_size": 1,
                           "trainer.total_training_steps": 10})
    seen = []
    step = a.optimizer.step

    def spy():
        seen.append(a.optimizer.param_groups[0]["lr"])
        return step()

    a.optimizer.step = spy
    raw = random_batch()
    for _ in range(6):
        metrics = a.update_policy(policy_batch(a, raw))
        assert metrics["actor/lr"] == pytest.approx(seen[-1])
    per_step = [seen[i:i + 4] for i in range(0, len(seen), 4)]
    assert len(per_step) == 6 and all(len(set(s)) == 1 for s in per_step)  # one lr per training step
    assert [s[0] for s in per_step] == pytest.approx([lr / 4, lr / 2, 3 * lr / 4, lr, lr, lr])
