"""The queue trainer's reward stage, run by the rollout producer that generated a claim.

A producer scores its claim's trajectories right after generating them and writes the scores in the same
transaction as the trajectories (producer.Producer._write). Reward therefore runs beside generation (in
the producer processes, or the producer threads on rank 0 while the actor trains), never as serial work
between the last reply and a local update, and a group is never visible as done without its scores.

Stage I/O (queue_trainer.py): reads each prompt's ground_truth, data_source (and extra_info for a reward
function that takes row info) and each trajectory's response tokens; writes per trajectory rm_scores,
rewards, response_text and the reward manager's extra keys (acc, pred, ...), and per prompt
`reward_keys`, the names of those extra keys (the trainer reads them back by name).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch

PROMPT_FIELDS = ("ground_truth", "data_source")


class ClaimScorer:
    """Decode + the reward manager (overlong shaping included) over one claim's groups.

    One instance may serve several producer threads: a call holds a lock (the reward manager's worker
    processes serve one batch at a time)."""

    def __init__(self, tokenizer, reward_manager):
        self.tokenizer, self.reward_manager = tokenizer, reward_manager
        self.row_info = bool(getattr(reward_manager.score_fn, "takes_row_info", False))
        self._lock = threading.Lock()

    @property
    def prompt_fields(self) -> tuple[str, ...]:
        """The prompt fields `score` needs, read by the producer with the claim."""
        return (*PROMPT_FIELDS, "extra_info") if self.row_info else PROMPT_FIELDS

    def score(self, prompts: Mapping[str, Sequence], responses: Sequence[Sequence[Sequence[int]]]
              ) -> list[dict[str, list]]:
        """prompts: `prompt_fields` per prompt; responses[g][j]: the tokens of prompt g's j-th trajectory.
        Returns per prompt the fields of its trajectories ({name: [value per trajectory]})."""
        counts = [len(group) for group in responses]
        rows = [tokens for group in responses for tokens in group]
        per_row = lambda name: [prompts[name][g] for g, c in enumerate(counts) for _ in range(c)]  # noqa: E731
        with self._lock:
            texts = [self.tokenizer.decode(tokens) for tokens in rows]
            lengths = torch.tensor([len(tokens) for tokens in rows], dtype=torch.int64)
            out = self.reward_manager.score(texts, per_row("ground_truth"), lengths,
                                            data_sources=per_row("data_source"),
                                            extra_infos=per_row("extra_info") if self.row_info else None)
        fields = {"rm_scores": out.score.float().tolist(), "rewards": out.reward.float().tolist(),
                  "response_text": texts, **{name: list(values) for name, values in out.extra.items()}}
        keys = list(out.extra)
        groups, start = [], 0
        for c in counts:
            group = {name: values[start:start + c] for name, values in fields.items()}
            group["reward_keys"] = keys
            groups.append(group)
            start += c
        return groups
