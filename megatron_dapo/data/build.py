"""The datasets a config names (data.*): the trainer's training and validation sets, and the validation set
alone, which evaluating a run's checkpoint scores (eval.py)."""

from __future__ import annotations

import logging

from megatron_dapo.config import Config

log = logging.getLogger("megatron_dapo")


def build_datasets(cfg: Config, tokenizer):
    """(train, validation or None) as the run reads them: data.task's synthetic splits, or data.train_files /
    data.val_files with data.* row handling; a train set smaller than one generation batch is a DatasetError."""
    from megatron_dapo.data.dataset import DatasetError

    d = cfg.data
    train, val = _split(cfg, tokenizer, "train"), build_val_dataset(cfg, tokenizer)
    if d.task == "arithmetic":
        return train, val
    for path, data in ((d.train_files, train), (d.val_files, val)):
        if data is not None and data.stats["rows_filtered_too_long"]:
            log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens", path,
                        data.stats["rows_filtered_too_long"], data.stats["rows_read"], d.max_prompt_length)
    if len(train) < d.effective_gen_batch_size:
        s = train.stats
        raise DatasetError(f"{d.train_files}: {len(train)} usable prompts, fewer than one generation batch "
                           f"({d.effective_gen_batch_size}): of {s['rows_read']} rows, {s['rows_filtered_too_long']} "
                           f"are longer than data.max_prompt_length={d.max_prompt_length} tokens and "
                           f"{s['rows_skipped_malformed']} are malformed")
    return train, val


def build_val_dataset(cfg: Config, tokenizer):
    """The run's validation set (None when data.val_files is empty for a file task)."""
    if cfg.data.task != "arithmetic" and not cfg.data.val_files:
        return None
    return _split(cfg, tokenizer, "val")


def _split(cfg: Config, tokenizer, split: str):
    from megatron_dapo.data.arithmetic import make_arithmetic_dataset
    from megatron_dapo.data.dataset import load_prompt_dataset

    d = cfg.data
    if d.task == "arithmetic":
        a = d.arithmetic
        return make_arithmetic_dataset(split, num_samples=a.num_train if split == "train" else a.num_val, seed=a.seed,
                                       min_digits=a.min_digits, max_digits=a.max_digits, operators=a.operators,
                                       tokenizer=tokenizer)
    return load_prompt_dataset(d.train_files if split == "train" else d.val_files, tokenizer,
                               uid_prefix=None if split == "train" else "val", max_prompt_length=d.max_prompt_length,
                               prompt_overflow=d.prompt_overflow, on_bad_row=d.on_bad_row,
                               apply_chat_template=d.apply_chat_template)
