"""Tokenizers: the interface the trainer uses, a built-in character tokenizer, and an HF wrapper.

- ``CharTokenizer``: the synthetic arithmetic task's vocabulary (digits, ``+ - * =``, space) and
  three specials; no files needed.
- ``HFTokenizer``: a Hugging Face tokenizer directory on local disk (never the hub).
- ``load_tokenizer(spec)``: ``""`` or ``"builtin:char"`` -> CharTokenizer, else a directory.

``encode`` never adds special tokens: a chat template already writes the ones it needs as text,
and adding a BOS on top would double it. Callers that want a BOS prepend ``bos_id`` themselves.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

BUILTIN_CHAR = "builtin:char"


@runtime_checkable
class Tokenizer(Protocol):
    """What the data, rollout and reward code need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> str: ...


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{role, content}} dicts, got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{i}][{key!r}] must be a str, got {message.get(key)!r}")


def _as_id_list(ids) -> list[int]:
    """Accept a list/tuple of ints or a 1-D integer tensor/array (``tolist`` covers both)."""
    return list(ids.tolist() if hasattr(ids, "tolist") else ids)


class CharTokenizer:
    """One token per character over ``0-9 + - * =`` and space, plus ``<pad> <bos> <eos>``.

    Ids are fixed: <pad>=0, <bos>=1, <eos>=2, then the characters in the order of ``CHARS``
    (so "0" is 3). ``vocab_size`` is 18.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789+-*= "

    def __init__(self):
        self._char_to_id = {ch: len(self.SPECIALS) + i for i, ch in enumerate(self.CHARS)}
        self._id_to_text = list(self.SPECIALS) + list(self.CHARS)

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_text)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    def encode(self, text: str) -> list[int]:
        ids = []
        for position, ch in enumerate(text):
            token = self._char_to_id.get(ch)
            if token is None:
                raise ValueError(
                    f"CharTokenizer cannot encode character {ch!r} at position {position} of {text!r}; "
                    f"it knows only {self.CHARS!r}"
                )
            ids.append(token)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; specials are dropped, or written as ``<eos>`` etc. when not skipped."""
        pieces = []
        for position, token in enumerate(_as_id_list(ids)):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"CharTokenizer cannot decode id {token!r} at position {position}; ids are in "
                    f"[0, {self.vocab_size})"
                )
            if token < len(self.SPECIALS) and skip_special_tokens:
                continue
            pieces.append(self._id_to_text[token])
        return "".join(pieces)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The message contents concatenated: the synthetic task has no chat format, and role
        names are not in this vocabulary."""
        _check_messages(messages)
        return "".join(message["content"] for message in messages)


    def save_pretrained(self, out_dir: str) -> None:
        """This vocabulary as an HF tokenizer directory with the same ids, so an exported model of the
        synthetic task is served (SGLang) and loaded (transformers, load_tokenizer) with its own tokenizer.
        Written as a Qwen2 byte-level BPE without merges (one token per character; the space is byte-level
        "\u0120"): transformers 5 loads the model type's tokenizer class beside an exported Qwen2
        config.json whatever the files name, so the files are that class's own."""
        from transformers import Qwen2Tokenizer

        vocab = {("\u0120" if text == " " else text): i for i, text in enumerate(self._id_to_text)}
        Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<pad>", pad_token="<pad>", bos_token="<bos>",
                       eos_token="<eos>").save_pretrained(out_dir)


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (``local_files_only=True``).

    ``pad_id`` falls back to ``eos_id`` when the tokenizer has no pad token (usual for base
    models; padded positions are masked anyway). ``vocab_size`` is ``len(tokenizer)``, added
    tokens included; the model's embedding may be padded larger.
    """

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
        from transformers import AutoTokenizer  # heavy import, only when an HF tokenizer is used

        self.path = path
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer at {path!r} has no eos_token; generation could never stop")

    @property
    def hf_tokenizer(self):
        """The wrapped transformers tokenizer (for the rollout engine's own needs)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def pad_id(self) -> int:
        pad = self._tok.pad_token_id
        return self._tok.eos_token_id if pad is None else pad

    @property
    def eos_id(self) -> int:
        return self._tok.eos_token_id

    @property
    def bos_id(self) -> int | None:
        return self._tok.bos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        # A tensor or array goes as it is: transformers lists it with one .tolist(), where a Python list gets
        # an isinstance check per element (0.4-0.7 us a token, two thirds of a long response's decode).
        return self._tok.decode(ids if hasattr(ids, "tolist") else list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The tokenizer's chat template with the generation prompt when it has one; otherwise
        one ``role: content`` line per message followed by ``assistant: ``."""
        _check_messages(messages)
        if getattr(self._tok, "chat_template", None):
            return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        lines = [f"{message['role']}: {message['content']}" for message in messages]
        return "\n".join(lines) + "\nassistant: "


def load_tokenizer(spec: str) -> Tokenizer:
    """``""`` or ``"builtin:char"`` -> CharTokenizer; anything else is a local HF tokenizer directory."""
    if not isinstance(spec, str):
        raise TypeError(f"tokenizer spec must be a str, got {type(spec).__name__}")
    if spec in ("", BUILTIN_CHAR):
        return CharTokenizer()
    if spec.startswith("builtin:"):
        raise ValueError(f"unknown built-in tokenizer {spec!r}; known: [{BUILTIN_CHAR!r}]")
    if not os.path.exists(spec):
        raise FileNotFoundError(
            f"tokenizer path {spec!r} does not exist (expected an HF tokenizer directory)"
        )
    if not os.path.isdir(spec):
        raise NotADirectoryError(f"tokenizer path {spec!r} is a file; expected an HF tokenizer directory")
    return HFTokenizer(spec)
