"""The stand-in's toy model (a deterministic hash: client tests know each exact output) and the
normalised sampling of one request item (no torch here: a toy server starts without importing it).

SGLang's normalisation: temperature < 1e-6 is greedy (top_k = 1 at temperature 1), top_k -1 means
the whole vocabulary, max_new_tokens defaults to 128.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS
TOP_K_ALL = 1 << 30


@dataclass(frozen=True)
class ItemSampling:
    """The sampling of one request item, after SGLang's normalisation."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    seed: int

    @classmethod
    def from_params(cls, p: dict, *, seed: int) -> ItemSampling:
        t = 1.0 if p.get("temperature") is None else float(p["temperature"])
        top_k = -1 if p.get("top_k") is None else int(p["top_k"])
        if 0 <= t < GREEDY_EPS:
            t, top_k = 1.0, 1
        return cls(max_new_tokens=128 if p.get("max_new_tokens") is None else int(p["max_new_tokens"]),
                   temperature=t, top_p=1.0 if p.get("top_p") is None else float(p["top_p"]),
                   top_k=TOP_K_ALL if top_k == -1 else top_k,
                   stop_token_ids=frozenset(p.get("stop_token_ids") or ()), ignore_eos=bool(p.get("ignore_eos")),
                   seed=seed)


def toy_next_token(context: Sequence[int], seed: int, vocab: int) -> int:
    h = seed & 0x7FFFFFFF
    for t in context[-4:]:
        h = (h * 1000003 + t + 1) % (1 << 31)
    return (h + 7919 * len(context)) % vocab


def toy_logprob(token: int, step: int) -> float:
    return -0.01 * (1 + (token + step) % 50)


def toy_continuation(input_ids: Sequence[int], *, seed: int, max_new_tokens: int,
                     stop_token_ids: Sequence[int] = (), vocab: int = 97) -> tuple[list[int], list[float], dict]:
    """(tokens, log-probs, finish_reason) the toy model produces for a seed; the stop token is included."""
    ctx, tokens, logps = list(input_ids), [], []
    for step in range(max_new_tokens):
        tok = toy_next_token(ctx, seed, vocab)
        tokens.append(tok)
        logps.append(toy_logprob(tok, step))
        ctx.append(tok)
        if tok in stop_token_ids:
            return tokens, logps, {"type": "stop", "matched": tok}
    return tokens, logps, {"type": "length", "length": max_new_tokens}


class ToyModel:
    """A hash of the last tokens and the seed picks each token (no weights, no temperature)."""

    def __init__(self, vocab_size: int = 97, context_length: int = 1 << 20):
        self.vocab_size, self.context_length, self.eos_token_id = vocab_size, context_length, None
        self.lock = threading.Lock()

    def decoder(self, input_ids: Sequence[int], s: ItemSampling):
        ctx = list(input_ids)
        for step in range(s.max_new_tokens):
            tok = toy_next_token(ctx, s.seed, self.vocab_size)
            ctx.append(tok)
            yield tok, toy_logprob(tok, step)

    def expected_names(self) -> set[str]:
        return set()

    def load(self, named: dict) -> None:
        """The toy has no parameters: any name is kept by the ranks (for checksums) and accepted."""


