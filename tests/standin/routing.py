"""The stand-in's routed experts (R3): what SGLang does with `return_routed_experts` and
--enable-return-routed-experts, read from the 0.5.8 to 0.5.23 wheels (megatron_dapo/rollout/sglang/versions.py
has the file:line evidence). Written here from that reading; it imports nothing of SGLang or of the client.

- Launch: with the switch, SGLang's capturer reads num_hidden_layers and num_experts_per_tok of the model's
  config at start-up; a model without them (dense, or the toy) fails there, so the stand-in exits at load.
- Reply: `meta_info["routed_experts"]` = base64 of the little-endian int32 bytes of [S, L, K], token-major,
  S = prompt + response - 1 (the last sampled token is never fed forward); rows of a layer without a
  router stay zero. The ids are the HF router's top-k of the stand-in's own forward (in torch.topk's order).
- A request aborted before its first forward carries none (SGLang: aborted while queued).
- Without the switch nothing is captured and nothing refused: 0.5.8 and 0.5.9 send `"routed_experts": null`,
  0.5.10+ leave the key out.
"""

from __future__ import annotations

import base64

FLAG_DEST = "enable_return_routed_experts"


def check_launch(args, model) -> None:
    """ValueError (a dead server at load) when the switch is on and the model has no MoE router."""
    if getattr(args, FLAG_DEST, False) and getattr(model, "moe_layout", None) is None:
        kind = "the toy model" if args.toy else f"{args.model_path} (a dense model)"
        raise ValueError(
            f"--enable-return-routed-experts: {kind} has no num_experts_per_tok; SGLang's routed-experts "
            "capturer reads it from the model config at start-up and the scheduler dies there"
        )


def encode(steps) -> str:
    """SGLang's encoding of the [S, L, K] routing made of the decoder's per-forward [n, L, K] steps."""
    import numpy as np  # here: a toy server imports neither numpy nor torch

    rows = np.concatenate([np.asarray(s, dtype="<i4") for s in steps], axis=0)
    return base64.b64encode(np.ascontiguousarray(rows).tobytes()).decode("ascii")


def add_to_meta(meta: dict, st, *, asked: bool, steps: list | None) -> None:
    """Put the release's routed_experts entry (or none) into one reply's meta_info."""
    if not asked:
        return
    if not getattr(st.args, FLAG_DEST, False):
        if not st.proto.at_least("0.5.10"):
            meta["routed_experts"] = None
        return
    if steps:
        meta["routed_experts"] = encode(steps)
