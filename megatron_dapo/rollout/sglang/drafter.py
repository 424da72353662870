"""SGLang's MTP drafter in step with the policy: what the weight sync sends, per release, or why it cannot.

With `rollout.speculative.algorithm` set, SGLang's draft worker runs the model's MTP layer as the
NEXTN / EAGLE drafter. It starts from the `mtp.*` tensors of --speculative-draft-model-path (the
launcher passes the model path; a released Qwen checkpoint has none, so the drafter starts from
whatever its parameters held), and only the weight sync keeps it in step: the actor trains its MTP layer
(model.mtp_num_layers=1) and every sync sends it under the drafter's names (models/hf.py). Without that
the drafter drifts from the moving policy and acceptance, hence rollout speed, decays.

What each release allows (sglang.versions, read from the wheels):

- an MTP drafter exists for Qwen3-MoE from 0.5.13 (Qwen3MoeForCausalLMMTP), for no other Qwen model;
- /update_weights_from_tensor (rollout.weight_transport=ipc, colocated servers) reaches the drafter in
  every supported release, the drafter loading the `mtp.*` names and the target the rest;
- /update_weights_from_distributed (weight_transport=distributed) reaches it from 0.5.21, with
  `selector` "all"; before, only the target loads it.

`drafter_sync` turns that into the sync's settings, or a DrafterSyncUnsupported naming the key to change.
A pure function of config facts and the servers' release: every trainer rank computes the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.models.arch import ModelArch
from megatron_dapo.rollout.base import RolloutEngineError
from megatron_dapo.rollout.sglang.versions import CHANGES, ReleaseFeatures

EVER_DRAFTED = tuple(sorted({t for _, change in CHANGES for t in change.get("mtp_drafters", ())}))
"""HF model types some supported release drafts from (qwen3_moe)."""
SELECTOR_ALL = "all"
"""The weight-update selector that loads a bucket into the target and the drafter (0.5.21+)."""


class DrafterSyncUnsupported(RolloutEngineError):
    """Speculative decoding was asked for but the drafter cannot follow the policy (the message says why
    and which key changes it)."""


@dataclass(frozen=True)
class DrafterSync:
    """How the weight sync treats the MTP layers."""

    send_mtp: bool
    """Send the MTP layers (under the drafter's names) with every sync."""
    selector: str | None
    """`selector` of every update body (releases that have the field), else None (the field is absent)."""


def drafter_sync(*, algorithm: str | None, arch: ModelArch, model_type: str, features: ReleaseFeatures | None,
                 transport: str | None) -> DrafterSync | None:
    """The sync's MTP settings for `rollout.speculative.algorithm` against servers of `features`.

    model_type: the served model's HF model type (qwen2, qwen3, qwen3_moe); transport: the resolved
    rollout.weight_transport ("distributed" or "ipc"). features=None (servers not started yet) checks
    only what holds in every release and returns None."""
    if algorithm is None:
        return DrafterSync(send_mtp=False, selector=None)
    key = f"rollout.speculative.algorithm={algorithm}"
    if arch.mtp_num_layers == 0:
        raise DrafterSyncUnsupported(
            f"{key} with model.mtp_num_layers=0: SGLang's drafter would keep the checkpoint's MTP weights (a "
            "released Qwen checkpoint has none) while the policy moves; set model.mtp_num_layers=1 so the actor "
            "trains the drafter and every weight sync sends it")
    if arch.mtp_num_layers > 1:
        raise DrafterSyncUnsupported(
            f"{key} with model.mtp_num_layers={arch.mtp_num_layers}: SGLang's MTP drafter holds one layer (it "
            "repeats it for every draft step); set model.mtp_num_layers=1")
    if model_type not in EVER_DRAFTED:
        raise DrafterSyncUnsupported(
            f"{key}: SGLang has no MTP drafter for {model_type} models in any supported release (only for "
            f"{', '.join(EVER_DRAFTED)}), so the actor's MTP layer cannot draft; set rollout.speculative.algorithm=null")
    pattern = arch.moe_layer_pattern()
    if bool(pattern[-1]) != bool(pattern[0]):
        kind = {True: "MoE", False: "dense"}
        raise DrafterSyncUnsupported(
            f"{key}: the actor's MTP layer is {kind[bool(pattern[-1])]} (like the last decoder layer) but SGLang "
            f"builds its drafter layer as decoder layer 0 of the checkpoint's config ({kind[bool(pattern[0])]}): "
            "the tensors would not fit; use a model whose first and last layers are of one kind")
    if features is None:
        return None
    release = ".".join(map(str, features.version))
    if model_type not in features.mtp_drafters:
        have = ", ".join(features.mtp_drafters) or "none"
        raise DrafterSyncUnsupported(
            f"{key}: SGLang {release} has no MTP drafter for {model_type} models (drafters in this release: {have}; "
            "Qwen3-MoE's arrives in 0.5.13, Qwen2 / Qwen3 dense have none), so the actor's MTP layer cannot "
            "draft; use SGLang >= 0.5.13 or set rollout.speculative.algorithm=null")
    if transport == "distributed" and not features.drafter_via_distributed:
        raise DrafterSyncUnsupported(
            f"{key}: SGLang {release} loads /update_weights_from_distributed into the target model only, so the "
            "drafter would keep its launch weights while the policy moves; use SGLang >= 0.5.21 (its update "
            "selector reaches the drafter) or rollout.weight_transport=ipc with colocated servers (tensor "
            "updates reach the drafter in every release)")
    return DrafterSync(send_mtp=True, selector=SELECTOR_ALL if features.update_selector else None)
