"""The actor at production shapes (issue #13), on one process: the LM head sees only real response
tokens, old / reference / update log-probs come from one path (ratio exactly 1 in bf16), fillers
change nothing, MTP runs only where it trains and only on response targets, CP is refused."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.config import ConfigError, load_config
from tests.workers._actor_cases import PAD, VOCAB, capture_grads, overrides, policy_batch, random_batch
from tests.workers.test_actor import assert_same_grads, make_actor


@pytest.fixture(scope="module")
def pgs():
    from megatron_dapo.parallel import init_parallel

    return init_parallel()


def _args(raw):
    return raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every fused_logprob_stats call: (tokens N, compute_entropy, compute_sum_sq)."""
    import megatron_dapo.kernels as kernels

    calls = []
    real = kernels.fused_logprob_stats

    def spy(hidden, weight, labels, **kw):
        calls.append((hidden.shape[0], kw["compute_entropy"], kw["compute_sum_sq"]))
        return real(hidden, weight, labels, **kw)

    monkeypatch.setattr(kernels, "fused_logprob_stats", spy)
    return calls


def test_the_lm_head_sees_only_real_response_tokens_in_every_pass(pgs, kernel_calls):
    """compute_log_prob and the update evaluate the output layer's weight at exactly the real response
    tokens (sum of response lengths), never at a padded position, and never materialise logits
    (the output layer's forward only ever hands its input through)."""
    from megatron_dapo.models.forward import unwrap_model

    raw = random_batch(seed=11)
    a = make_actor(pgs)
    a.policy.max_tokens = 24  # several micro-batches
    out_layer = unwrap_model(a.policy.chunks[0]).output_layer
    widths = []
    hook = out_layer.register_forward_hook(lambda m, i, o: widths.append(o[0].shape[-1]))
    real_tokens = int(raw["response_length"].sum())
    try:
        a.compute_log_prob(*_args(raw))
        assert sum(n for n, _, _ in kernel_calls) == real_tokens
        assert all(not ent and not sq for _, ent, sq in kernel_calls)  # nothing asked, nothing computed
        kernel_calls.clear()
        a.update_policy(policy_batch(a, raw))  # its compute_log_prob, then 2 mini-batches
        lp_calls = [c for c in kernel_calls if not c[1]]
        upd_calls = [c for c in kernel_calls if c[1]]
        assert sum(n for n, _, _ in lp_calls) == real_tokens and sum(n for n, _, _ in upd_calls) == real_tokens
    finally:
        hook.remove()
    hidden = unwrap_model(a.policy.chunks[0]).config.hidden_size
    assert widths and set(widths) == {hidden} != {VOCAB}


def test_old_log_prob_and_update_share_numerics_ratio_exactly_one_in_bf16(pgs):
    """bf16 weights, several micro-batches, the whole batch one mini-batch: the update's log-probs are
    bitwise those of compute_log_prob (same kernel, same micro-batches), so ppo_kl and the clip
    fractions are exactly 0; update_policy_on_policy returns bitwise the compute_log_prob values.
    (Before: the update used the fused kernel and compute_log_prob bf16 logits.)"""
    extra = {"model.params_dtype": "bf16", "actor.use_fused_kernels": "true", "actor.ppo_mini_batch_size": 4}
    raw = random_batch(seed=12)
    a = make_actor(pgs, **extra)
    a.policy.max_tokens = 24
    m = a.update_policy(policy_batch(a, raw))
    assert m["actor/ppo_kl"] == 0.0 and m["actor/pg_clipfrac"] == 0.0 and m["actor/pg_clipfrac_lower"] == 0.0
    b = make_actor(pgs, **extra)
    b.policy.max_tokens = 24
    before = b.compute_log_prob(*_args(raw), with_sum_sq=True)
    _, lp = b.update_policy_on_policy(dataclasses.replace(policy_batch(b, raw), old_log_probs=None), with_sum_sq=True)
    mask = raw["response_mask"]
    assert torch.equal(lp.log_probs, before.log_probs * mask)
    assert torch.equal(lp.sum_sq_probs * mask, before.sum_sq_probs * mask)


def test_filler_microbatches_add_no_loss_no_token_and_no_gradient(pgs, monkeypatch):
    """Three fillers more than this rank needs (as if another DP rank had more micro-batches): the same
    log-probs, metrics and gradients; the fillers did run (the schedule saw them)."""
    from megatron_dapo.workers.policy import PolicyModel

    raw = random_batch(seed=13)
    results, counts = [], []
    real_run = PolicyModel.run

    def counting_run(self, microbatches, *args, **kwargs):
        counts.append((len(microbatches), sum(mb.is_filler for mb in microbatches)))
        return real_run(self, microbatches, *args, **kwargs)

    monkeypatch.setattr(PolicyModel, "run", counting_run)
    real_agreed = PolicyModel._agreed_counts
    for extra in (0, 3):
        monkeypatch.setattr(PolicyModel, "_agreed_counts",
                            lambda self, local, e=extra: [c + e for c in real_agreed(self, local)])
        a = make_actor(pgs, **{"actor.entropy_coeff": 0.01})
        a.policy.max_tokens = 16  # mostly one row per micro-batch: the extra count is mostly fillers
        grads = capture_grads(a)
        lp = a.compute_log_prob(*_args(raw), with_entropy=True)
        m = a.update_policy(policy_batch(a, raw, perturb_old=0.05))
        results.append((lp, grads, m))
    half = len(counts) // 2  # per run: policy_batch's and the explicit compute_log_prob, 2 mini-batches
    assert all(f == 0 for _, f in counts[:half]) and all(f > 0 for _, f in counts[half:])
    # compute_log_prob runs the update's two mini-batches in one schedule: 3 more for each
    assert [n + e for (n, _), e in zip(counts[:half], (6, 6, 3, 3))] == [n for n, _ in counts[half:]]
    (lp0, g0, m0), (lp3, g3, m3) = results
    # some two-row bins were split instead (other matmul shapes): fp32 round-off, 2.4e-7 seen
    torch.testing.assert_close(lp3.log_probs, lp0.log_probs, atol=2e-6, rtol=0)
    torch.testing.assert_close(lp3.entropy, lp0.entropy, atol=2e-6, rtol=0)
    for x, y in zip(g0, g3, strict=True):
        assert_same_grads(y, x)  # x num_mbs / num_mbs with another count: fp32 round-off only
    for k in ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"):
        # the second mini-batch follows an Adam step taken from round-off-different gradients: 1.1e-7 seen
        assert m3[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), k


def _mtp_actor(pgs, **extra):
    return make_actor(pgs, **{"model.mtp_num_layers": 1, "actor.ppo_mini_batch_size": 4, **extra})


def test_mtp_runs_only_in_the_training_forward_and_config_is_restored(pgs):
    from megatron_dapo.models.forward import unwrap_model

    a = _mtp_actor(pgs)
    inner = unwrap_model(a.policy.chunks[0])
    calls = []
    hook = inner.mtp.register_forward_hook(lambda *args: calls.append(1))
    raw = random_batch(seed=14)
    try:
        a.compute_log_prob(*_args(raw), with_entropy=True, with_sum_sq=True)
        assert calls == []
        assert inner.mtp_process is True and inner.config.mtp_num_layers == 1  # restored
        a.update_policy(policy_batch(a, raw))
        assert len(calls) >= 1  # the training forward trains the drafter
    finally:
        hook.remove()


def test_mtp_log_probs_equal_the_logits_path_in_both_passes(pgs):
    """The fused path (forward-only: MTP skipped; training: the main head's input captured) gives the
    log-probs of Megatron's logits path (models.forward.token_logprobs, which runs the MTP heads)."""
    from megatron_dapo.models.forward import token_logprobs, unwrap_model

    a = _mtp_actor(pgs)
    raw = random_batch(seed=15)
    lp = a.compute_log_prob(*_args(raw)).log_probs
    model = unwrap_model(a.policy.chunks[0])
    model.eval()
    for r in range(len(raw["response_length"])):
        p, n = int(raw["prompt_length"][r]), int(raw["response_length"][r])
        ids = torch.cat([raw["prompt_ids"][r, :p], raw["responses"][r, :n]])[None]
        with torch.no_grad():
            ref = token_logprobs(model, ids, torch.arange(ids.shape[1])[None], ids.roll(-1, 1), pgs=pgs)
        torch.testing.assert_close(lp[r, :n], ref[0, p - 1:p - 1 + n], atol=2e-5, rtol=0)  # fp32 round-off
    _, on_policy = a.update_policy_on_policy(dataclasses.replace(policy_batch(a, raw), old_log_probs=None))
    torch.testing.assert_close(on_policy.log_probs, lp * raw["response_mask"], atol=0, rtol=0)


def test_mtp_loss_covers_response_targets_only(pgs):
    """Megatron gets loss_mask = 1 where the label is a response token; so the MTP layer's gradient does
    not depend on what fills the padding (with Megatron's default all-ones mask it did)."""
    from megatron_dapo.models.forward import unwrap_model

    raw = random_batch(seed=16)
    grads, masks = [], []
    for pad in (PAD, 7):
        a = _mtp_actor(pgs)
        a.policy.pad_id = pad
        inner = unwrap_model(a.policy.chunks[0])
        hook = inner.register_forward_pre_hook(lambda m, args, kw: masks.append(kw.get("loss_mask")), with_kwargs=True)
        b = policy_batch(a, raw, perturb_old=0.05)
        step = a.optimizer.step
        snap = {}

        def spy(inner=inner, snap=snap, step=step):
            snap.update({n: p.main_grad.detach().clone() for n, p in inner.named_parameters()})
            return step()

        a.optimizer.step = spy
        a.update_policy(b)
        hook.remove()
        grads.append(snap)
    train_masks = [m for m in masks if m is not None]
    assert train_masks and all(set(m.unique().tolist()) <= {0, 1} for m in train_masks)
    assert int(train_masks[0].sum()) == int(raw["response_length"].sum())  # one mini-batch, one micro-batch
    mtp = [n for n in grads[0] if n.startswith("mtp.")]
    assert mtp and any(float(grads[0][n].abs().sum()) > 0 for n in mtp)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-7, rtol=1e-5)


def test_context_parallelism_is_refused_with_a_named_error():
    with pytest.raises(ConfigError, match="parallel.context_parallel_size: expected 1 .*not implemented"):
        load_config("configs/tiny_cpu.yaml", overrides(**{"parallel.context_parallel_size": 2,
                                                         "trainer.n_gpus_per_node": 2}))
    from megatron_dapo.workers.policy import PolicyModel

    with pytest.raises(ValueError, match="context_parallel_size > 1 is not implemented"):
        PolicyModel([], pgs=SimpleNamespace(cp_size=2), pad_id=PAD, temperature=1.0, max_tokens=8, vocab_size=VOCAB)


def test_mtp_fillers_keep_gradients_finite_and_scale_only_megatrons_per_microbatch_mtp_loss(pgs, monkeypatch):
    """Fillers have no MTP target (Megatron would divide 0 by 0): they run the MTP layers at loss scale 0.
    16 rows of 8-14 tokens at a 14-token budget are 16 single-row micro-batches, so 2 more are fillers.
    With the trunk detached the decoder layers' gradient is unchanged by them, and the MTP layers' is
    scaled by exactly 16 / 18 (Megatron weighs its MTP loss 1 / micro-batch count, fillers included)."""
    from megatron_dapo.models.forward import unwrap_model
    from megatron_dapo.workers.policy import PolicyModel

    raw = random_batch(seed=17)
    raw["prompt_length"] = torch.full((16,), 6)
    raw["response_length"] = raw["response_length"].clamp(min=2)
    raw["response_mask"] = (torch.arange(8)[None] < raw["response_length"][:, None]).float()
    real_agreed = PolicyModel._agreed_counts
    grads, counts = [], []
    for extra in (0, 2):
        monkeypatch.setattr(PolicyModel, "_agreed_counts",
                            lambda self, local, e=extra: counts.append(real_agreed(self, local)[0] + e) or [counts[-1]])
        a = _mtp_actor(pgs, **{"actor.mtp_detach_trunk": "true"})
        a.policy.max_tokens = 14
        inner = unwrap_model(a.policy.chunks[0])
        step, snap = a.optimizer.step, {}

        def spy(inner=inner, snap=snap, step=step):
            snap.update({n: p.main_grad.detach().clone() for n, p in inner.named_parameters()})
            return step()

        a.optimizer.step = spy
        a.update_policy(policy_batch(a, raw, perturb_old=0.05))  # one mini-batch
        grads.append(snap)
    assert counts == [16, 16, 18, 18]  # policy_batch's compute_log_prob, then the update
    base, filled = grads
    assert all(bool(torch.isfinite(g).all()) for g in filled.values())
    mtp = [n for n in base if n.startswith("mtp.")]
    assert mtp and any(float(base[n].abs().sum()) > 0 for n in mtp)
    layers = [n for n in base if n.startswith("decoder.")]  # the embedding / output weight feed both losses
    assert layers
    for n in layers + mtp:
        expected = base[n] * 16 / 18 if n.startswith("mtp.") else base[n]
        # x 18 / 18 instead of x 16 / 16 on the main loss: fp32 round-off (5e-8 seen on values of 0.1)
        torch.testing.assert_close(filled[n], expected, atol=2e-7, rtol=1e-5, msg=n)
