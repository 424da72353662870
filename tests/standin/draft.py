"""The stand-in's speculative drafter: SGLang's MTP draft model for Qwen3-MoE, as
sglang/srt/models/qwen3_moe_mtp.py builds it (Qwen3MoeForCausalLMMTP, 0.5.13+), with transformers
layers on CPU.

What SGLang does (read in the wheels): with --speculative-algorithm NEXTN|EAGLE the draft worker loads
--speculative-draft-model-path (not defaulted for Qwen3MoeForCausalLM: the flag is required) with
`architectures[0]` rewritten to Qwen3MoeForCausalLMMTP and num_hidden_layers = 1
(configs/model_config.py, _config_draft_model). The drafter is

    fc(cat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t))) -> one Qwen3-MoE decoder
    layer -> norm -> the target's LM head

with the target's embedding and LM head shared (set_embed_and_head). Its load_weights keeps only names
containing "mtp": `mtp.fc.weight`, `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`
lose the `mtp.` prefix, every other `mtp.` becomes `model.` (mtp.layers.0.*, mtp.norm.weight); every
other name is skipped. The stand-in is stricter on `mtp` names it does not know (a 400 naming them;
SGLang skips them silently) and checks shapes.

`drafter_for(config, version)` is None where SGLang has no MTP drafter for the model (other
architectures, releases before 0.5.13); server.py then refuses --speculative-algorithm for that model.

Shape legend: S positions, H hidden size, V vocabulary.
"""

from __future__ import annotations

import copy

import torch

from tests.standin.model import check_named, checkpoint_targets, load_named
from tests.standin.protocol import version_key

MTP_DRAFTERS = {"qwen3_moe": "0.5.13"}
"""HF model type -> the first release whose draft worker loads its MTP layer (qwen3_moe_mtp.py)."""
OWN = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


class DraftModel:
    """Qwen3MoeForCausalLMMTP on CPU: its own tensors under their checkpoint names (`mtp.*`)."""

    def __init__(self, config):
        from transformers.models.qwen3_moe import modeling_qwen3_moe as q

        cfg = copy.deepcopy(config)
        cfg.num_hidden_layers = 1
        h = cfg.hidden_size
        self.body = q.Qwen3MoeModel(cfg).eval()  # its embed_tokens is unused: the target's is shared
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = q.Qwen3MoeRMSNorm(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = q.Qwen3MoeRMSNorm(h, eps=cfg.rms_norm_eps)
        own = [(f"mtp.{n}", getattr(self, n.removesuffix(".weight")).weight) for n in OWN]
        body = [(n, p) for n, p in self.body.state_dict(keep_vars=True).items() if not n.startswith("embed_tokens.")]
        self.targets = {n: (p, ()) for n, p in own} | checkpoint_targets(body, prefix="mtp.")

    @staticmethod
    def accepts(name: str) -> bool:
        return "mtp" in name

    def expected_names(self) -> set[str]:
        return set(self.targets)

    def check(self, named: dict[str, torch.Tensor]) -> str | None:
        return check_named(self.targets, {n: t for n, t in named.items() if self.accepts(n)},
                           owner="Qwen3MoeForCausalLMMTP drafter")

    def load(self, named: dict[str, torch.Tensor]) -> None:
        load_named(self.targets, {n: t for n, t in named.items() if self.accepts(n)})

    @torch.no_grad()
    def hidden(self, next_embeds_SH: torch.Tensor, hidden_SH: torch.Tensor) -> torch.Tensor:
        """[S, H] drafter output (after its norm) for draft position t = 0..S-1, from the embedding of
        token t + 1 and the target's final (normed) hidden state at t, at positions 0..S-1."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(next_embeds_SH), self.pre_fc_norm_hidden(hidden_SH)),
                              dim=-1))
        positions = torch.arange(x.shape[0]).unsqueeze(0)
        return self.body(inputs_embeds=x.unsqueeze(0), position_ids=positions).last_hidden_state[0]


def drafter_for(config, version: str) -> DraftModel | None:
    """The MTP drafter SGLang `version` builds for an HF model of `config`, or None when it has none."""
    first = MTP_DRAFTERS.get(config.model_type)
    if first is None or version_key(version) < version_key(first):
        return None
    return DraftModel(config)
