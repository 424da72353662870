"""What rank 0 of the queue trainer sends the other ranks as an object (`_outline`): every per-row scalar,
score and id, no token entries and no texts (those go as flat tensors, `_share_batch`), no routing (R3:
each row's goes to the ranks that train it, trainer/replay.py)."""

import pickle

import torch

from megatron_dapo.rollout.base import PromptInput, ragged_batch
from megatron_dapo.trainer.batch import ScoredBatch
from megatron_dapo.trainer.queue_trainer import _outline


def test_the_outline_carries_the_rows_scalars_but_no_tokens_no_texts_and_no_routing():
    n, L = 2, 4000
    prompts = [PromptInput(f"p{g}", (1, 2, 3 + g)) for g in range(4)]
    B = len(prompts) * n
    rollout = ragged_batch(prompts, n, [torch.full((L - b,), 5, dtype=torch.int64) for b in range(B)],
                           [torch.full((L - b,), -0.5) for b in range(B)], finish_reason=["stop"] * B,
                           policy_version=[3] * B, meta=[{}] * B, pad_id=0,
                           routed_experts=[torch.ones(2, 3 + L - b - 1, 2, dtype=torch.uint8) for b in range(B)],
                           max_response_length=L)
    batch = ScoredBatch(rollout=rollout, raw_prompt=["q"] * B, response_text=["7" * L] * B, ground_truth=["7"] * B,
                        scores=torch.arange(B, dtype=torch.float32), rewards=torch.ones(B),
                        extra={"uid": [f"u{b // n}" for b in range(B)]})
    out = _outline(batch)
    # the tokens alone are ~32 KB of int64 per row, the routing 16 KB; a pickled view would carry the whole storage
    assert len(pickle.dumps(out)) < 16_000
    assert torch.equal(out.rollout.response_length, rollout.response_length)
    assert torch.equal(out.rollout.prompt_length, rollout.prompt_length) and torch.equal(out.scores, batch.scores)
    assert out.extra["uid"] == batch.extra["uid"] and out.rollout.index == rollout.index
    assert not out.rollout.responses.present.any() and out.response_text == [""] * B
    assert out.rollout.routed_experts is None and len(batch.rollout.routed_experts) == B
    assert batch.rollout.responses.complete and batch.response_text[0] == "7" * L  # rank 0's own batch untouched
