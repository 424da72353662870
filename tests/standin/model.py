"""The stand-in's Hugging Face model (Qwen2 dense, Qwen3-MoE) run with transformers on CPU; the
weight-update endpoints replace its weights by HF checkpoint name.

Sampling follows SGLang's defaults (after toy.ItemSampling's normalisation): top-k then top-p filter softmax(logits / temperature) and one token is
drawn. The returned log-prob is log_softmax(logits / temperature) of the drawn token BEFORE the
top-k / top-p filter (SGLang's default; SGLANG_RETURN_ORIGINAL_LOGPROB is not emulated).
Randomness: one torch.Generator per request, seeded with the request's sampling seed when the
server honours seeds (--enable-deterministic-inference, default seed 42 as SGLang), else with a
fresh random seed.

Shape legend: logits_V [vocab], input_ids list[int].
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch

from tests.standin.toy import ItemSampling


def sample_token(logits_V: torch.Tensor, s: ItemSampling, gen: torch.Generator) -> tuple[int, float]:
    """(token, log-prob before filtering) of one draw from logits / temperature, top-k, top-p."""
    scaled = logits_V.float() / s.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = logprobs.exp()
    if s.top_k < probs.numel():
        kth = torch.topk(probs, s.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if s.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=0)
        drop = (cum - sorted_p) > s.top_p * cum[-1]  # keep the smallest prefix reaching top_p
        sorted_p = torch.where(drop, torch.zeros_like(sorted_p), sorted_p)
        probs = torch.zeros_like(probs).scatter(0, idx, sorted_p)
    token = int(torch.multinomial(probs / probs.sum(), 1, generator=gen).item())
    return token, float(logprobs[token])


# ----------------------------------------------------------------------------- Hugging Face

def checkpoint_targets(named_params, *, prefix: str = "", skip=()) -> dict[str, tuple[torch.Tensor, object]]:
    """{checkpoint name: (parameter, index)} of transformers parameters: fused experts (gate_up_proj
    [E, 2I, H], down_proj [E, H, I]) answer to the per-expert checkpoint names; `prefix` is prepended."""
    out: dict[str, tuple[torch.Tensor, object]] = {}
    for name, p in named_params:
        if name in skip:
            continue
        name = prefix + name
        if name.endswith("mlp.experts.gate_up_proj"):
            num_e, two_i = p.shape[0], p.shape[1]
            for e in range(num_e):
                base = name.removesuffix("gate_up_proj") + f"{e}."
                out[base + "gate_proj.weight"] = (p, (e, slice(0, two_i // 2)))
                out[base + "up_proj.weight"] = (p, (e, slice(two_i // 2, two_i)))
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(p.shape[0]):
                out[name.removesuffix("down_proj") + f"{e}.down_proj.weight"] = (p, (e,))
        else:
            out[name] = (p, ())
    return out


def check_named(targets: dict, named: dict[str, torch.Tensor], *, owner: str) -> str | None:
    """The first problem (unknown name, wrong shape) of a bucket against `targets`, or None."""
    for name, t in named.items():
        if name not in targets:
            return f"unknown parameter {name!r} (not a tensor of this {owner})"
        p, index = targets[name]
        want = tuple(p[index].shape) if index else tuple(p.shape)
        if tuple(t.shape) != want:
            return f"parameter {name!r}: shape {list(t.shape)} != the model's {list(want)}"
    return None


def load_named(targets: dict, named: dict[str, torch.Tensor]) -> None:
    """Copy checked tensors into their parameters (cast to the parameter's dtype)."""
    with torch.no_grad():
        for name, t in named.items():
            p, index = targets[name]
            (p[index] if index else p).copy_(t)


class HFModel:
    """A transformers causal LM on CPU; decoding with its KV cache; weights replaced by checkpoint name.

    transformers 5 stores a Qwen3-MoE layer's experts fused (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]); HF checkpoints (and the trainer's export) name them per expert
    (`...mlp.experts.{e}.gate_proj.weight` [I, H]); `targets` maps each checkpoint name to its slice.
    """

    def __init__(self, path: str, *, dtype: str = "auto", context_length: int | None = None):
        import transformers

        torch_dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
                       "float16": torch.float16, "half": torch.float16, "float": torch.float32}.get(dtype)
        if torch_dtype is None:
            raise ValueError(f"--dtype {dtype!r} is not one the stand-in runs on CPU")
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        self.context_length = context_length or cfg.max_position_embeddings
        eos = cfg.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.skips_mtp = cfg.model_type == "qwen3_moe"  # Qwen3MoeForCausalLM.load_weights: `elif "mtp" in name`
        self.lock = threading.Lock()  # one forward or one weight load at a time
        self.targets = self._targets()
        self.routers = self._hook_routers()
        """{layer index: router} of the MoE layers (empty for a dense model)."""
        self._captured: dict[int, torch.Tensor] | None = None

    def _hook_routers(self) -> dict[int, torch.nn.Module]:
        """Forward hooks that keep each MoE router's top-k ids (its third output, [tokens, K]) while a
        decoder asks for routes; a layer without a router is left out, as SGLang leaves its row zero."""
        routers = {}
        for i, layer in enumerate(self.model.model.layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                routers[i] = gate
                gate.register_forward_hook(functools.partial(self._keep_route, i))
        return routers

    def _keep_route(self, layer: int, _module, _inputs, output) -> None:
        if self._captured is not None:
            self._captured[layer] = output[2].detach().to(torch.int32)

    @property
    def moe_layout(self) -> tuple[int, int] | None:
        """(num_hidden_layers, num_experts_per_tok) of an MoE model (the rows SGLang sends per token); None if dense."""
        k = getattr(self.model.config, "num_experts_per_tok", None)
        return (self.model.config.num_hidden_layers, k) if self.routers and k else None

    def _targets(self) -> dict[str, tuple[torch.Tensor, object]]:
        skip = {"lm_head.weight"} if self.tied else set()  # SGLang skips lm_head of a tied model
        return checkpoint_targets(self.model.state_dict(keep_vars=True).items(), skip=skip)

    def expected_names(self) -> set[str]:
        return set(self.targets)

    def accepts(self, name: str) -> bool:
        """Whether the model's load_weights takes `name`: SGLang's Qwen3MoeForCausalLM skips every
        name containing "mtp" (its drafter's), and a tied model skips lm_head."""
        return not (name == "lm_head.weight" and self.tied) and not (self.skips_mtp and "mtp" in name)

    def check(self, named: dict[str, torch.Tensor]) -> str | None:
        """The first problem (unknown name, wrong shape) of a bucket, or None."""
        return check_named(self.targets, {n: t for n, t in named.items() if self.accepts(n)},
                           owner=type(self.model).__name__)

    def load(self, named: dict[str, torch.Tensor]) -> None:
        """Copy checked tensors into the model (cast to its dtype)."""
        with self.lock:
            load_named(self.targets, {n: t for n, t in named.items() if self.accepts(n)})

    @torch.no_grad()
    def logits(self, input_ids: Sequence[int]) -> torch.Tensor:
        """[len, vocab] logits of a plain forward (for checks)."""
        with self.lock:
            return self.model(torch.tensor([list(input_ids)])).logits[0].float()

    def decoder(self, input_ids: Sequence[int], s: ItemSampling, routes: list | None = None):
        """Yield (token, log-prob) step by step with the KV cache; the caller stops it. `routes` (an MoE
        model) receives the routing of every forward, [tokens fed, L, K] int32: the prompt, then each
        token once it is fed (the last one sampled never is)."""
        gen = torch.Generator().manual_seed(s.seed & 0xFFFFFFFFFFFF)
        cache, feed = None, list(input_ids)
        for _ in range(s.max_new_tokens):
            with self.lock, torch.no_grad():
                self._captured = {} if routes is not None else None
                try:
                    out = self.model(input_ids=torch.tensor([feed]), past_key_values=cache, use_cache=True)
                    if routes is not None:
                        layers, k = self.moe_layout
                        step = torch.zeros(len(feed), layers, k, dtype=torch.int32)
                        for i, ids in self._captured.items():
                            step[:, i] = ids
                        routes.append(step)
                finally:
                    self._captured = None
            cache = out.past_key_values
            tok, lp = sample_token(out.logits[0, -1], s, gen)
            feed = [tok]
            yield tok, lp
