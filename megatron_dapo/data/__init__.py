"""Data: tokenizers, prompt datasets (parquet / jsonl), the synthetic arithmetic task, the sampler."""

from megatron_dapo.data.arithmetic import arithmetic_sft_examples, make_arithmetic_dataset
from megatron_dapo.data.dataset import DatasetError, PromptDataset, PromptRecord, load_prompt_dataset
from megatron_dapo.data.sampler import ResumableSampler
from megatron_dapo.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "CharTokenizer",
    "DatasetError",
    "HFTokenizer",
    "PromptDataset",
    "PromptRecord",
    "ResumableSampler",
    "Tokenizer",
    "arithmetic_sft_examples",
    "load_prompt_dataset",
    "load_tokenizer",
    "make_arithmetic_dataset",
]
