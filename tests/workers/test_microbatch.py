"""Token-budget packing and the response-aligned mapping of micro-batches."""

import pytest
import torch

from megatron_dapo.workers.logprob import logprob_entropy_from_logits
from megatron_dapo.workers.microbatch import make_microbatches, plan_microbatches, to_response_aligned


def test_plan_respects_the_padded_token_budget_and_keeps_order():
    lengths = [5, 3, 8, 2, 2, 7]
    groups = plan_microbatches(lengths, 10)
    assert [i for g in groups for i in g] == list(range(6))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 10
    assert groups == [[0, 1], [2], [3, 4], [5]]  # 2 x 5 = 10 fits exactly


def test_plan_sorted_by_length_reduces_microbatches():
    lengths = [2, 8, 2, 8, 2, 2]
    assert len(plan_microbatches(lengths, 16, sort_by_length=True)) < len(plan_microbatches(lengths, 16))


def test_a_row_longer_than_the_budget_is_a_named_error():
    with pytest.raises(ValueError, match="row 1 has 9 tokens"):
        plan_microbatches([3, 9], 8)


def test_microbatch_concatenates_prompt_and_response_and_shifts_labels():
    prompt_ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    prompt_length = torch.tensor([3, 2])
    responses = torch.tensor([[7, 8, 0, 0], [9, 0, 0, 0]])
    response_length = torch.tensor([2, 1])
    (mb,) = make_microbatches(prompt_ids, prompt_length, responses, response_length, max_tokens=100, pad_id=0)
    assert mb.input_ids.tolist() == [[1, 2, 3, 7, 8], [4, 5, 9, 0, 0]]
    assert mb.labels.tolist() == [[2, 3, 7, 8, 0], [5, 9, 0, 0, 0]]
    assert mb.resp_start.tolist() == [2, 1]
    # the label at resp_start + j is response token j
    aligned = to_response_aligned(mb.labels, mb, 4)
    assert aligned[0, :2].tolist() == [7, 8] and aligned[1, :1].tolist() == [9]


def test_logprob_entropy_from_logits_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64).float()
    labels = torch.tensor([0, 3, 10, 5, 5, 1])
    for temp in (1.0, 0.7):
        logp, ent, sq = logprob_entropy_from_logits(logits, labels, temperature=temp, compute_entropy=True,
                                                    compute_sum_sq=True)
        ref = torch.log_softmax(logits / temp, -1)
        torch.testing.assert_close(logp, ref.gather(1, labels[:, None]).squeeze(1), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(sq, (ref.exp() ** 2).sum(-1), atol=1e-6, rtol=1e-6)


def test_logprob_gradient_is_onehot_minus_softmax():
    logits = torch.randn(3, 7, requires_grad=True)
    labels = torch.tensor([1, 6, 0])
    logp, _, _ = logprob_entropy_from_logits(logits, labels)
    logp.sum().backward()
    expected = torch.nn.functional.one_hot(labels, 7).float() - torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(logits.grad, expected, atol=1e-6, rtol=1e-5)
