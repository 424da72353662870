"""The synthetic arithmetic dataset: determinism, disjoint splits, correct answers, SFT pairs."""

import pytest

from megatron_dapo.data.arithmetic import arithmetic_sft_examples, make_arithmetic_dataset
from megatron_dapo.data.tokenizer import CharTokenizer
from megatron_dapo.rewards.arithmetic import compute_score

TOK = CharTokenizer()


def make(split="train", **kwargs):
    kwargs = {"num_samples": 200, "seed": 0, "tokenizer": TOK, **kwargs}
    return make_arithmetic_dataset(split, **kwargs)


def test_same_arguments_give_the_same_dataset():
    assert list(make()) == list(make())
    assert [r.raw_prompt for r in make(seed=1)] != [r.raw_prompt for r in make(seed=0)]


def test_train_and_val_problems_are_disjoint():
    train = {record.raw_prompt for record in make("train", num_samples=3000)}
    val = {record.raw_prompt for record in make("val", num_samples=500)}
    assert len(train) == 3000 and len(val) == 500  # no repeats within a split
    assert not train & val


def test_a_larger_val_split_extends_the_smaller_one_and_stays_disjoint():
    # The split is a property of each problem, so sizes never move a problem between splits.
    small, large = make("val", num_samples=50), make("val", num_samples=1000)
    train = {record.raw_prompt for record in make("train", num_samples=5000)}
    assert not train & {record.raw_prompt for record in large}
    assert [r.raw_prompt for r in small] == [r.raw_prompt for r in large][:50]


def test_whole_small_space_splits_into_train_and_val():
    # One-digit additions: 100 problems. Asking for more than a split holds names num_samples.
    with pytest.raises(ValueError, match="num_samples=100 exceeds the") as info:
        make("val", num_samples=100, max_digits=1, operators="+")
    val_size = int(str(info.value).split("exceeds the ")[1].split()[0])
    val = {r.raw_prompt for r in make("val", num_samples=val_size, max_digits=1, operators="+")}
    train = {r.raw_prompt for r in make("train", num_samples=100 - val_size, max_digits=1, operators="+")}
    assert 0 < val_size < 30
    assert val | train == {f"{a}+{b}=" for a in range(10) for b in range(10)}


@pytest.mark.parametrize("operators", ["+", "-", "*", "+-*"])
def test_records_state_correct_problems(operators):
    for i, record in enumerate(make(operators=operators, min_digits=1, max_digits=3)):
        a, b, op = record.extra_info["a"], record.extra_info["b"], record.extra_info["op"]
        assert op in operators and 0 <= a <= 999 and 0 <= b <= 999
        assert record.raw_prompt == f"{a}{op}{b}="
        assert int(record.ground_truth) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert record.prompt_ids == [TOK.bos_id] + TOK.encode(record.raw_prompt)
        assert record.uid == f"arith-train-{i}" and record.data_source == "arithmetic"


def test_operand_digits_respect_the_range():
    for record in make(min_digits=2, max_digits=3):
        for operand in (record.extra_info["a"], record.extra_info["b"]):
            assert 10 <= operand <= 999


def test_sft_examples_answer_correctly_and_end_with_eos():
    dataset = make(num_samples=20, operators="+-*")
    examples = arithmetic_sft_examples(dataset, TOK)
    assert len(examples) == 20
    for record, (prompt_ids, response_ids) in zip(dataset, examples, strict=True):
        assert prompt_ids == record.prompt_ids
        assert response_ids[-1] == TOK.eos_id
        assert compute_score(TOK.decode(response_ids), record.ground_truth)["score"] == 1.0


@pytest.mark.parametrize(
    "split,kwargs,argument",
    [
        ("test", {}, "split"),
        ("train", {"num_samples": 0}, "num_samples"),
        ("train", {"seed": -1}, "seed"),
        ("train", {"min_digits": 0}, "min_digits"),
        ("train", {"min_digits": 3, "max_digits": 2}, "max_digits"),
        ("train", {"max_digits": 10}, "max_digits"),
        ("train", {"operators": "+/"}, "operators"),
        ("train", {"operators": "++"}, "operators"),
        ("train", {"operators": ""}, "operators"),
    ],
)
def test_bad_arguments_are_named(split, kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        make(split, **kwargs)
