"""Rollout engines: the contract (`base`), the SGLang engine (the `sglang` package: HTTP client, server
launch, weight sync) and the local Megatron engine.

Import engines from their modules (`from megatron_dapo.rollout.sglang.engine import SGLangEngine`);
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
