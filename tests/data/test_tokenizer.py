"""Tokenizers: fixed ids of the built-in one, round trips, the HF wrapper on a tokenizer built here."""

import pytest
import torch

from megatron_dapo.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def build_hf_tokenizer_dir(directory, *, chat_template=CHAT_TEMPLATE, pad=True):
    """Train a word-level tokenizer on a few strings and save it as an HF tokenizer directory."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = ["<pad>", "<unk>", "<s>", "</s>"] if pad else ["<unk>", "<s>", "</s>"]
    raw.train_from_iterator(
        ["what is 1 + 2 ?", "user : assistant : system :", "the answer is 3"],
        trainers.WordLevelTrainer(special_tokens=specials),
    )
    kwargs = {"pad_token": "<pad>"} if pad else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>", **kwargs
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return str(directory)


def test_char_tokenizer_ids_are_fixed():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 18)
    # "0" is 3, so digit d is d + 3; "+" 13, "-" 14, "*" 15, "=" 16, " " 17.
    assert tok.encode("12+7=") == [4, 5, 13, 10, 16]
    assert tok.encode("9-0*3 ") == [12, 14, 3, 15, 6, 17]


def test_char_tokenizer_round_trips_every_character():
    tok = CharTokenizer()
    text = CharTokenizer.CHARS * 2
    assert tok.decode(tok.encode(text)) == text


def test_char_tokenizer_specials_are_skipped_or_spelled_out():
    tok = CharTokenizer()
    ids = [tok.bos_id] + tok.encode("19") + [tok.eos_id, tok.pad_id]
    assert tok.decode(ids) == "19"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>19<eos><pad>"
    assert tok.decode(torch.tensor(ids)) == "19"  # tensors are accepted


def test_char_tokenizer_names_unknown_character_and_position():
    with pytest.raises(ValueError, match=r"character 'x' at position 2 of '12x'"):
        CharTokenizer().encode("12x")
    with pytest.raises(ValueError, match="cannot decode id 18 at position 1"):
        CharTokenizer().decode([3, 18])


def test_char_tokenizer_chat_template_concatenates_contents():
    messages = [{"role": "system", "content": "1+"}, {"role": "user", "content": "2="}]
    assert CharTokenizer().apply_chat_template(messages) == "1+2="
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\] must be a str"):
        CharTokenizer().apply_chat_template([{"role": "user"}])


def test_hf_tokenizer_round_trip_and_chat_template(tmp_path):
    tok = load_tokenizer(build_hf_tokenizer_dir(tmp_path / "tok"))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    assert tok.vocab_size == len(tok.hf_tokenizer)
    ids = tok.encode("what is 1 + 2 ?")
    assert tok.bos_id not in ids  # encode adds no specials
    assert tok.decode(ids) == "what is 1 + 2 ?"
    assert tok.decode(ids + [tok.eos_id]) == "what is 1 + 2 ?"
    assert tok.decode(ids + [tok.eos_id], skip_special_tokens=False) == "what is 1 + 2 ? </s>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "what is 1 + 2 ?"}])
    assert prompt == "user : what is 1 + 2 ? assistant : "


def test_hf_tokenizer_without_chat_template_joins_role_lines(tmp_path):
    tok = HFTokenizer(build_hf_tokenizer_dir(tmp_path / "tok", chat_template=None))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 + 2 ?"}]
    assert tok.apply_chat_template(messages) == "system: be brief\nuser: 1 + 2 ?\nassistant: "


def test_hf_tokenizer_pad_falls_back_to_eos(tmp_path):
    tok = HFTokenizer(build_hf_tokenizer_dir(tmp_path / "tok", pad=False))
    assert tok.pad_id == tok.eos_id


def test_load_tokenizer_specs(tmp_path):
    assert isinstance(load_tokenizer(""), CharTokenizer)
    assert isinstance(load_tokenizer("builtin:char"), CharTokenizer)
    with pytest.raises(
        ValueError, match=r"unknown built-in tokenizer 'builtin:bpe'; known: \['builtin:char'\]"
    ):
        load_tokenizer("builtin:bpe")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "file.json").write_text("{}")
    with pytest.raises(NotADirectoryError, match="is a file"):
        load_tokenizer(str(tmp_path / "file.json"))
