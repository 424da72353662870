"""Rollout engines: the contract (`base`), the SGLang engine (`sglang_engine`, with server launch in
`sglang_server` and weight sync in `sglang_weights`) and the local Megatron engine.

Import engines from their modules (`from megatron_dapo.rollout.sglang_engine import SGLangEngine`);
this package exports only the contract, so importing it stays light.
"""

from megatron_dapo.rollout.base import (
    FINISH_REASONS,
    SPEC_META_KEYS,
    PromptInput,
    RolloutBatch,
    RolloutEngine,
    RolloutEngineError,
    Sample,
    SamplingParams,
    check_generate_inputs,
    check_generate_output,
    derive_sample_seed,
    samples_to_batch,
)

__all__ = [
    "FINISH_REASONS",
    "SPEC_META_KEYS",
    "PromptInput",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutEngineError",
    "Sample",
    "SamplingParams",
    "check_generate_inputs",
    "check_generate_output",
    "derive_sample_seed",
    "samples_to_batch",
]
