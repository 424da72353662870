"""forward: log-probs / entropy of labels, gathered logits, MTP handling, forward-only schedule."""

import pytest
import torch

from megatron_dapo.models.arch import get_arch
from megatron_dapo.models.builder import build_gpt_model
from megatron_dapo.models.forward import (
    Microbatch,
    forward_only_logprobs,
    logits_forward,
    main_logits,
    token_logprobs,
    token_logprobs_and_entropy,
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
)

from .conftest import sample_tokens


def _reference(logits, labels, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_log_softmax_of_scaled_logits(pgs, temperature):
    model = build_gpt_model(get_arch("tiny"), pgs=pgs, seed=4).eval()
    ids, pos = sample_tokens(2, 16, vocab=512)
    labels = ids.roll(-1, 1)
    with torch.no_grad():
        logits = logits_forward(model, ids, pos)
        lp = token_logprobs(model, ids, pos, labels, temperature=temperature, pgs=pgs)
        lp2, ent = token_logprobs_and_entropy(model, ids, pos, labels, temperature=temperature, pgs=pgs)
    ref_lp, ref_ent = _reference(logits, labels, temperature)
    assert lp.dtype == torch.float32 and lp.shape == (2, 16)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(lp2, lp, rtol=0, atol=0)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_vocab_parallel_log_probs_value_and_gradient_match_autograd(pgs, dtype, atol):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, 11, (3, 5), generator=g)
    weights = torch.randn(3, 5, generator=g)
    lp = vocab_parallel_log_probs(logits, labels, tp_group=pgs.tp)
    (lp * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (ref * weights).sum().backward()
    assert lp.dtype == torch.float32 and ours.dtype == dtype
    torch.testing.assert_close(lp, ref, rtol=0, atol=atol)
    torch.testing.assert_close(ours.float(), logits.grad.float(), rtol=0, atol=atol)


def test_vocab_parallel_entropy_value_and_gradient_match_autograd(pgs):
    g = torch.Generator().manual_seed(1)
    logits = (2 * torch.randn(4, 9, generator=g)).requires_grad_()
    ent = vocab_parallel_entropy(logits, tp_group=pgs.tp)
    ent.sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    p = torch.softmax(logits, -1)
    ref = -(p * torch.log_softmax(logits, -1)).sum(-1)
    ref.sum().backward()
    torch.testing.assert_close(ent, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, logits.grad, rtol=0, atol=1e-6)


def test_mtp_model_main_head_equals_same_trunk_without_mtp_and_mtp_gets_grads(pgs):
    mtp_model = build_gpt_model(get_arch("tiny_moe", mtp_num_layers=1), pgs=pgs, seed=9)
    plain = build_gpt_model(get_arch("tiny_moe"), pgs=pgs, seed=10)
    shared = {k: v for k, v in mtp_model.state_dict().items() if not k.startswith("mtp.")}
    plain.load_state_dict(shared)
    ids, pos = sample_tokens(2, 12, vocab=512)
    labels = ids.roll(-1, 1)
    lp_mtp = token_logprobs(mtp_model, ids, pos, labels, temperature=0.7, pgs=pgs)
    lp_plain = token_logprobs(plain, ids, pos, labels, temperature=0.7, pgs=pgs)
    torch.testing.assert_close(lp_mtp, lp_plain, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits_forward(mtp_model, ids, pos), logits_forward(plain, ids, pos),
                               rtol=0, atol=1e-6)
    lp_mtp.sum().backward()                       # the MTP loss rides on the main head's graph
    mtp_grads = [p.grad for n, p in mtp_model.named_parameters() if n.startswith("mtp.")]
    assert mtp_grads and all(g is not None and g.abs().sum() > 0 for g in mtp_grads[:3])


def test_forward_only_logprobs_pp1_equals_direct_call(pgs):
    model = build_gpt_model(get_arch("tiny"), pgs=pgs, seed=4).eval()
    mbs = []
    for seed in (1, 2, 3):
        ids, pos = sample_tokens(2, 10, seed=seed, vocab=512)
        mbs.append(Microbatch(ids, pos, ids.roll(-1, 1)))
    out = forward_only_logprobs([model], mbs, pgs=pgs, temperature=0.9)
    with torch.no_grad():
        direct = [token_logprobs(model, *mb[:3], temperature=0.9, pgs=pgs) for mb in mbs]
    assert len(out) == 3
    for a, b in zip(out, direct, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_inputs_raise_with_the_offending_argument(pgs):
    model = build_gpt_model(get_arch("tiny"), pgs=pgs, seed=4)
    ids, pos = sample_tokens(2, 8, vocab=512)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(model, ids, pos, ids, temperature=0.0, pgs=pgs)
    with pytest.raises(ValueError, match=r"labels shape \(2, 7\) must equal input_ids shape \(2, 8\)"):
        token_logprobs(model, ids, pos, ids[:, :7], pgs=pgs)
    with pytest.raises(ValueError, match="input_ids must be"):
        token_logprobs(model, ids[0], pos, ids[0], pgs=pgs)
    mtp_model = build_gpt_model(get_arch("tiny", mtp_num_layers=1), pgs=pgs, seed=4)
    with pytest.raises(ValueError, match="an MTP model needs labels"):
        main_logits(mtp_model, ids, pos, None, None, gather=False)
    with pytest.raises(ValueError, match="microbatch 1 has shape"):
        forward_only_logprobs(model, [Microbatch(ids, pos, ids), Microbatch(ids[:1], pos[:1], ids[:1])], pgs=pgs)
