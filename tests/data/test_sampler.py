"""ResumableSampler: epoch permutations, drop_last, and exact resume from a state dict."""

import itertools

import pytest

from megatron_dapo.data.sampler import ResumableSampler


def take(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def test_resumed_sampler_continues_the_uninterrupted_order_across_epochs():
    # 10 items in batches of 3 with drop_last: 3 batches per epoch; stop mid-epoch 1.
    reference = take(ResumableSampler(10, 3, seed=7), 10)
    first = ResumableSampler(10, 3, seed=7)
    head = take(first, 4)
    state = first.state_dict()
    assert (state["epoch"], state["index_in_epoch"]) == (1, 3)
    resumed = ResumableSampler(10, 3, seed=7)
    resumed.load_state_dict(state)
    assert head + take(resumed, 6) == reference


def test_resume_at_an_epoch_boundary():
    reference = take(ResumableSampler(9, 3, seed=1, drop_last=False), 7)
    first = ResumableSampler(9, 3, seed=1, drop_last=False)
    head = take(first, 3)
    assert (first.epoch, first.position) == (1, 0)
    resumed = ResumableSampler(9, 3, seed=1, drop_last=False)
    resumed.load_state_dict(first.state_dict())
    assert head + take(resumed, 4) == reference


def test_each_epoch_is_a_permutation_without_drop_last():
    sampler = ResumableSampler(10, 4, seed=3, drop_last=False)
    assert sampler.batches_per_epoch == 3
    for _ in range(3):
        batches = take(sampler, 3)
        assert [len(b) for b in batches] == [4, 4, 2]
        assert sorted(itertools.chain(*batches)) == list(range(10))


def test_drop_last_leaves_out_the_remainder_and_items_are_distinct():
    sampler = ResumableSampler(10, 3, seed=3)
    batches = take(sampler, 3)
    items = list(itertools.chain(*batches))
    assert sampler.batches_per_epoch == 3 and len(items) == len(set(items)) == 9


def test_order_depends_on_seed_and_epoch_only():
    a, b = take(ResumableSampler(50, 50, seed=0), 2)
    assert a != b  # epochs are reshuffled
    assert take(ResumableSampler(50, 50, seed=0), 2) == [a, b]
    assert take(ResumableSampler(50, 50, seed=1), 1) != [a]


def test_no_shuffle_is_sequential():
    sampler = ResumableSampler(5, 2, seed=0, shuffle=False, drop_last=False)
    assert take(sampler, 4) == [[0, 1], [2, 3], [4], [0, 1]]


def test_iterator_protocol_matches_next_batch():
    twin = ResumableSampler(8, 3, seed=2)
    assert list(itertools.islice(ResumableSampler(8, 3, seed=2), 5)) == take(twin, 5)


@pytest.mark.parametrize(
    "field,kwargs",
    [("seed", {"seed": 8}), ("num_items", {"num_items": 11}), ("batch_size", {"batch_size": 2}),
     ("shuffle", {"shuffle": False}), ("drop_last", {"drop_last": False})],
)  # fmt: skip
def test_state_from_a_different_sampler_is_rejected_by_field(field, kwargs):
    saved = ResumableSampler(10, 3, seed=7).state_dict()
    other = ResumableSampler(**{"num_items": 10, "batch_size": 3, "seed": 7, **kwargs})
    with pytest.raises(ValueError, match=f"sampler state has {field}="):
        other.load_state_dict(saved)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"epoch": -1}, "epoch=-1"),
        ({"index_in_epoch": 9}, "index_in_epoch=9"),
        ({"index_in_epoch": -1}, "index_in_epoch=-1"),
        ({"front": [10]}, "front item 10"),
    ],
)
def test_inconsistent_position_is_rejected(change, match):
    sampler = ResumableSampler(10, 3, seed=7)
    with pytest.raises(ValueError, match=match):
        sampler.load_state_dict({**sampler.state_dict(), **change})
    state = sampler.state_dict()
    del state["epoch"]
    with pytest.raises(ValueError, match=r"missing \['epoch'\]"):
        sampler.load_state_dict(state)


def test_batch_larger_than_dataset():
    with pytest.raises(ValueError, match="batch_size=5 > num_items=4 with drop_last=True"):
        ResumableSampler(4, 5, seed=0)
    sampler = ResumableSampler(4, 5, seed=0, drop_last=False)
    assert sorted(sampler.next_batch()) == [0, 1, 2, 3] and sampler.epoch == 1


@pytest.mark.parametrize("kwargs,argument", [({"num_items": 0}, "num_items"), ({"batch_size": 0}, "batch_size"),
                                             ({"seed": -3}, "seed")])  # fmt: skip
def test_bad_arguments_are_named(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        ResumableSampler(**{"num_items": 4, "batch_size": 2, "seed": 0, **kwargs})


def test_pushed_back_items_come_first_and_survive_a_resume_without_loss_or_repeat():
    """Streaming dynamic sampling gives cut prompts back: every item of an epoch is still yielded exactly once
    (minus the drop_last remainder), the given-back ones first, and a state dict carries them."""
    sampler = ResumableSampler(10, 3, seed=7)
    first = sampler.next_batch()
    sampler.push_front(first[1:])  # only first[0] was used
    state = sampler.state_dict()
    assert state["front"] == first[1:]
    resumed = ResumableSampler(10, 3, seed=7)
    resumed.load_state_dict(state)
    for s in (sampler, resumed):
        batches = take(s, 3)
        assert batches[0][:2] == first[1:] and all(len(b) == 3 for b in batches)
        used = [first[0]] + list(itertools.chain(*batches))
        epoch0 = ResumableSampler(10, 3, seed=7)._epoch_order(0)[:9]
        # The 9 items of epoch 0, each once, then the first item of epoch 1 fills the last batch.
        assert used[:9] == [first[0]] + first[1:] + epoch0[3:9] and sorted(used[:9]) == sorted(epoch0)
        assert used[9] == ResumableSampler(10, 3, seed=7)._epoch_order(1)[0]
    assert take(sampler, 2) == take(resumed, 2)


def test_push_front_rejects_items_outside_the_dataset():
    with pytest.raises(ValueError, match="push_front: item 10"):
        ResumableSampler(10, 3, seed=7).push_front([10])
