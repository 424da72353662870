"""Megatron-Core models for megatron_dapo.

- arch.py        ModelArch presets (tiny, tiny_moe, qwen2.5-32b, qwen3-30b-a3b), parameter counts
- builder.py     TransformerConfig, layer specs (local / Transformer Engine), GPTModel builder
- forward.py     token log-probs / entropy (vocab-parallel), gathered logits, forward-only PP
- weights.py     sharding to / gathering from the canonical world-1 state; mcore safetensors format
- hf.py          Hugging Face Qwen2 / Qwen3 / Qwen3-MoE <-> Megatron weights
- cpu_compat.py  the CPU compatibility layer for megatron-core (the only patches in the project)

Submodules are imported explicitly (importing megatron.core takes seconds); arch.py, hf.py and
weights.py do not import megatron.
"""
