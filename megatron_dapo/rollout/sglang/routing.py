"""Routed experts ("R3", rollout routing replay): the MoE routing an SGLang server chose for each token
of a request, read from its reply so that the trainer can replay it layer by layer.

What SGLang sends (every supported release; the evidence is in versions.py, release 0.5.8): with
`return_routed_experts: true` in the request and the server launched with
--enable-return-routed-experts, `meta_info["routed_experts"]` is base64 of the raw little-endian bytes of
an int32 tensor [S, L, K], token-major. The S rows are the positions 0 .. P + R - 2 of the request:

- every prompt token (P rows, prefix-cache hits included),
- every response token but the last (R - 1 rows): the last token is sampled, never fed forward, so it
  has no routing. A response of R tokens thus covers prompt + response[:-1].

`decode_routed_experts` turns that into the layer-first tensor the trainer replays, [L, S, K]: uint8
expert ids (int16 above 256 experts), checked against the model (size, ids < num_experts).

Cost: a reply carries L x K x 4 x 4/3 bytes of base64 per token (2,048 at 48 layers x top-8), 147 M routed
tokens per generation batch at the recipe's volume. pybase64 (SIMD, and it releases the GIL) decodes it at
0.16 us a token against the standard library's 7.5 (48 x 8 x 128, 6,000 tokens, one core of the 2-core
CI machine, `time.process_time`); the narrowing to uint8 happens before the [S, L, K] -> [L, S, K]
transpose, so the copy moves a quarter of the bytes. The whole decode is about 0.8 us a token.

The JSON parse is the larger cost: orjson reading 2 KB of base64 a token into a str holds the GIL (3.5 of
the 5.8 us a token of a whole reply's parse, 16 rows of 700 tokens, measured as above). So the client cuts
the strings out of the reply's bytes before the parse (`cut_routed_experts`: two memchr-speed finds a
value, the rest of the body copied once), the JSON keeps an index in their place, and each value is
decoded from its slice of the body with the GIL released (pybase64, then numpy's copies).

Shape legend: L num_hidden_layers, S routed tokens = P + R - 1, K num_experts_per_tok (top-k).
"""

from __future__ import annotations

import binascii
import mmap
from dataclasses import dataclass

import numpy as np
import orjson
import pybase64
import torch

from megatron_dapo.models.arch import expert_id_dtype

REQUEST_FIELD = "return_routed_experts"
"""The /generate request field that asks for the routing."""
META_KEY = "routed_experts"
"""The meta_info key of the reply that carries it."""


def routed_tokens(prompt_len: int, response_len: int) -> int:
    """S, the rows SGLang returns for a prompt of `prompt_len` and a response of `response_len` tokens."""
    return max(prompt_len + response_len - 1, 0)


@dataclass(frozen=True)
class RoutingLayout:
    """The model's router layout that a routing reply must match (HF config names in comments)."""

    num_layers: int
    """num_hidden_layers: SGLang sends a row per layer, zeros for a layer without a router."""
    top_k: int
    """num_experts_per_tok."""
    num_experts: int
    """num_experts (routed experts only, no shared ones)."""

    def __post_init__(self):
        for name in ("num_layers", "top_k", "num_experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RoutingLayout.{name} must be an int >= 1, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"RoutingLayout.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})"
            )
        if self.num_experts > 1 << 15:
            raise ValueError(f"RoutingLayout.num_experts ({self.num_experts}) must be <= 32768 (int16 ids)")


CUT_KEY = b'"' + META_KEY.encode() + b'":"'
"""The bytes that open a routed-experts string in a reply as SGLang writes it (orjson, compact)."""


def cut_routed_experts(body: bytes | mmap.mmap) -> tuple[bytes | mmap.mmap, list[memoryview]]:
    """(the reply without its routed-experts strings, the strings' bytes in body order) of a /generate
    reply body. Each cut string is replaced by its index in the list (a JSON int), which
    `decode_routed_experts` resolves given the list.

    A JSON string's own quotes are escaped (backslash-quote), so CUT_KEY matches only a key's opening,
    never text inside a value, and the next quote closes the value unless a backslash precedes it: such a
    value (escaped, not base64 as SGLang sends it) and any written with other spacing stay in the body for
    the JSON parser. Nothing is cut from a body without the key (returned as it is). Cost: two memchr-speed
    finds per value and one copy of the rest of the body (the values are views of `body`, a bytes object
    or the memory map sglang.client.post_read reads a large reply into)."""
    find = body.find
    at = find(CUT_KEY)
    if at < 0:
        return body, []
    view = memoryview(body)
    pieces, values, start = [], [], 0
    while at >= 0:
        a = at + len(CUT_KEY)
        z = find(b'"', a)
        if z < 0:
            break  # not JSON: the parser names it
        if body[z - 1] != 0x5C:  # a backslash before it: an escaped value, left for the parser
            pieces += (view[start:a - 1], b"%d" % len(values))
            values.append(view[a:z])
            start = z + 1
        at = find(CUT_KEY, z + 1)
    pieces.append(view[start:])
    return b"".join(pieces), values


def decode_routed_experts(
    value, *, num_layers: int, top_k: int, num_experts: int, num_tokens: int, where: str,
    cut: list | None = None,
) -> torch.Tensor:
    """[num_layers, num_tokens, top_k] expert ids (uint8, int16 above 256 experts) from SGLang's
    `meta_info.routed_experts` (a base64 str of int32 [num_tokens, num_layers, top_k]), or, with `cut`
    (`cut_routed_experts`'s list), the index of its bytes there (each index taken once).

    num_tokens: the rows expected, prompt + response - 1 (`routed_tokens`). where: the request, named in
    every error. A ValueError names `where` and the field when the value is not base64, its size is not
    num_tokens x num_layers x top_k int32, or an id is outside 0 .. num_experts - 1."""
    field = f"{where}: meta_info.{META_KEY}"
    if cut is not None and isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(cut) \
            and cut[value] is not None:
        index = value
        value, cut[index] = cut[index], None
    elif not isinstance(value, str):
        raise ValueError(f"{field} must be a base64 str, got {type(value).__name__}")
    try:  # pybase64 releases the GIL, for a str as for the body's bytes
        raw = pybase64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        if isinstance(value, str) or b"\\" not in bytes(value):
            raise ValueError(f"{field} is not base64 ({e})") from e
        try:  # cut with a JSON escape inside (valid JSON, not as SGLang writes it): decode the str it means
            text = orjson.loads(b'"' + bytes(value) + b'"')
        except ValueError as bad:
            raise ValueError(f"{field} is not a JSON string ({bad})") from bad
        return decode_routed_experts(text, num_layers=num_layers, top_k=top_k, num_experts=num_experts,
                                     num_tokens=num_tokens, where=where)
    per_token = num_layers * top_k
    if len(raw) % 4:
        raise ValueError(f"{field} holds {len(raw)} bytes, not a whole number of int32 ids")
    ids = np.frombuffer(raw, dtype="<i4")
    if ids.size != num_tokens * per_token:
        got = f"{ids.size // per_token} tokens" if ids.size % per_token == 0 else f"{ids.size} ids"
        raise ValueError(
            f"{field} holds {got}, expected {num_tokens} tokens x {num_layers} layers x top-{top_k} "
            f"= {num_tokens * per_token} int32 ids (prompt + response - 1 tokens); a model with other "
            "num_hidden_layers / num_experts_per_tok than the trainer's?"
        )
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        bad = int(ids[(ids < 0) | (ids >= num_experts)][0])
        raise ValueError(
            f"{field} holds expert id {bad}, outside 0 .. {num_experts - 1} (num_experts={num_experts})"
        )
    # narrow first (ids are in range), then [S, L, K] -> [L, S, K]: the trainer replays one layer at a time.
    narrow = ids.reshape(num_tokens, num_layers, top_k).astype(_NUMPY_DTYPE[expert_id_dtype(num_experts)])
    return torch.from_numpy(np.ascontiguousarray(narrow.transpose(1, 0, 2)))


_NUMPY_DTYPE = {torch.uint8: np.uint8, torch.int16: np.int16}
