"""Micro-batch layout: token-budget packing, the equal-count split, fillers, the real-token index,
and the thd packing (cu_seqlens, per-sequence positions and labels, unpacking) against bshd."""

import pytest
import torch

from megatron_dapo.rollout.ragged import AbsentRowError, RaggedRows
from megatron_dapo.workers.microbatch import (
    bin_cost,
    build_microbatch,
    filler_microbatch,
    make_microbatches,
    plan_bins,
    plan_microbatches,
    round_for_pipeline,
    split_bins,
)


def test_plan_respects_the_padded_token_budget_and_keeps_order():
    lengths = [5, 3, 8, 2, 2, 7]
    groups = plan_microbatches(lengths, 10)
    assert [i for g in groups for i in g] == list(range(6))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 10
    assert groups == [[0, 1], [2], [3, 4], [5]]  # 2 x 5 = 10 fits exactly


def test_sorted_bins_pack_longest_first_and_pad_less_than_row_order():
    lengths = [2, 8, 2, 8, 2, 2]
    bins = plan_bins(lengths, 16)
    assert bins == [[1, 3], [0, 2, 4, 5]]  # 2 x 8 and 4 x 2: no padding at all
    row_order = plan_microbatches(lengths, 16)
    assert sum(bin_cost([lengths[i] for i in b], packed=False) for b in bins) == 24 < \
        sum(bin_cost([lengths[i] for i in b], packed=False) for b in row_order)
    # thd bins count real tokens: 8 + 8 fills one, the four 2s the next
    assert plan_bins(lengths, 16, packed=True) == [[1, 3], [0, 2, 4, 5]]
    assert plan_bins([5, 4, 3, 3], 8, packed=True) == [[0], [1, 2], [3]]


def test_a_row_longer_than_the_budget_is_a_named_error():
    with pytest.raises(ValueError, match="row 1 has 9 tokens"):
        plan_microbatches([3, 9], 8)
    with pytest.raises(ValueError, match="row 1 has 9 tokens"):
        plan_bins([3, 9], 8, packed=True)


def test_split_bins_reaches_the_count_by_splitting_the_costliest_then_fills():
    lengths = [8, 8, 4, 4, 4, 4, 1]
    bins = plan_bins(lengths, 32)  # [8, 8, 4, 4] = 32, [4, 4, 1] = 12
    assert bins == [[0, 1, 2, 3], [4, 5, 6]]
    three = split_bins(bins, lengths, 3)
    assert three == [[0, 1], [2, 3], [4, 5, 6]]  # 4 x 8 split at the even cost point: 16 | 8
    assert sorted(i for b in three for i in b) == list(range(7))
    assert split_bins([[0], [1]], [5, 3], 4) == [[0], [1], [], []]  # single rows: fillers
    with pytest.raises(ValueError, match="cannot make 2 micro-batches into 1"):
        split_bins([[0], [1]], [5, 3], 1)


@pytest.mark.parametrize("count,pp,interleaved,expected", [(3, 2, True, 4), (1, 2, True, 2), (4, 2, True, 4),
                                                           (5, 4, True, 8), (3, 2, False, 3), (0, 2, False, 1)])
def test_pipeline_rounding_for_the_interleaved_schedule(count, pp, interleaved, expected):
    assert round_for_pipeline(count, pp=pp, interleaved=interleaved) == expected


def _tiny_batch():
    prompt_ids = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 0, 0]])
    prompt_length = torch.tensor([3, 2, 1])
    responses = torch.tensor([[7, 8, 0, 0], [9, 0, 0, 0], [10, 11, 12, 13]])
    response_length = torch.tensor([2, 1, 4])
    return prompt_ids, prompt_length, responses, response_length


def test_bshd_microbatch_right_pads_and_indexes_only_real_response_tokens():
    batch = _tiny_batch()
    mb = build_microbatch([0, 1, 2], *batch, pad_id=0, seq_multiple=2)
    assert mb.input_ids.tolist() == [[1, 2, 3, 7, 8, 0], [4, 5, 9, 0, 0, 0], [6, 10, 11, 12, 13, 0]]
    assert mb.labels.tolist() == [[2, 3, 7, 8, 0, 0], [5, 9, 0, 0, 0, 0], [10, 11, 12, 13, 0, 0]]
    # N = 2 + 1 + 4 real response tokens, at flat positions k * S + pl - 1 + t
    assert mb.token_index.tolist() == [2, 3, 7, 12, 13, 14, 15]
    assert mb.token_labels().tolist() == [7, 8, 9, 10, 11, 12, 13]
    assert (mb.token_row.tolist(), mb.token_pos.tolist()) == ([0, 0, 1, 2, 2, 2, 2], [0, 1, 0, 0, 1, 2, 3])
    assert mb.width == 4 and mb.num_padded_tokens == 18 and mb.num_tokens == 13
    rows = mb.to_rows(torch.arange(1.0, 8.0))
    assert rows.tolist() == [[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 7]]
    assert mb.response_input_mask()[2].tolist() == [0, 1, 1, 1, 1, 0]


def test_thd_packing_concatenates_restarts_positions_and_keeps_labels_in_sequence():
    batch = _tiny_batch()
    mb = build_microbatch([0, 1, 2], *batch, pad_id=0, seq_multiple=4, packed=True)
    # lengths 5 + 3 + 5 = 13 real tokens, rounded to 16: a padding segment of 3
    assert mb.input_ids.tolist() == [[1, 2, 3, 7, 8, 4, 5, 9, 6, 10, 11, 12, 13, 0, 0, 0]]
    assert mb.cu_seqlens.tolist() == [0, 5, 8, 13, 16] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 5
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2]]
    # the last token of each sequence has no next token inside it: pad, never the next sequence's first
    assert mb.labels.tolist() == [[2, 3, 7, 8, 0, 5, 9, 0, 10, 11, 12, 13, 0, 0, 0, 0]]
    assert mb.token_labels().tolist() == [7, 8, 9, 10, 11, 12, 13]
    assert mb.num_padded_tokens == 16 and mb.seq_start.tolist() == [0, 5, 8]
    params = mb.packed_seq_params("cpu")
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 5, 8, 13, 16]


@pytest.mark.parametrize("packed", [False, True])
def test_gathered_layout_matches_row_by_row_concatenation_on_random_rows(packed):
    g = torch.Generator().manual_seed(3)
    B, P, T = 12, 7, 5
    prompt_ids, responses = torch.randint(1, 50, (B, P), generator=g), torch.randint(1, 50, (B, T), generator=g)
    pl, rl = torch.randint(1, P + 1, (B,), generator=g), torch.randint(0, T + 1, (B,), generator=g)
    rl[4] = 0  # a row with an empty response
    rows = [9, 4, 0, 11, 2, 7]
    mb = build_microbatch(rows, prompt_ids, pl, responses, rl, pad_id=0, seq_multiple=4, packed=packed)
    ids, labels = mb.input_ids.reshape(-1), mb.labels.reshape(-1)
    covered = torch.zeros(ids.numel(), dtype=torch.bool)
    for k, r in enumerate(rows):
        seq = torch.cat([prompt_ids[r, :pl[r]], responses[r, :rl[r]]])
        at = int(mb.seq_start[k]) + torch.arange(seq.numel())
        assert ids[at].tolist() == seq.tolist()
        assert labels[at].tolist() == seq[1:].tolist() + [0]
        covered[at] = True
    assert (ids[~covered] == 0).all() and (labels[~covered] == 0).all()
    assert mb.token_labels().tolist() == [t for r in rows for t in responses[r, :rl[r]].tolist()]


@pytest.mark.parametrize("packed", [False, True])
def test_ragged_ids_give_the_micro_batch_of_their_dense_form(packed):
    """The training batch's ids held as ragged rows (int32, real tokens only) are read in place and give
    exactly the micro-batch of the dense [B, P] / [B, T] int64 tensors, pad_id where nothing is."""
    g = torch.Generator().manual_seed(5)
    B, P, T, pad = 10, 6, 7, 3
    prompt_ids, responses = torch.randint(4, 90, (B, P), generator=g), torch.randint(4, 90, (B, T), generator=g)
    pl, rl = torch.randint(1, P + 1, (B,), generator=g), torch.randint(0, T + 1, (B,), generator=g)
    rl[2], rl[7] = 0, T  # an empty response, and one at the width
    prompt_ids[torch.arange(P) >= pl.unsqueeze(1)] = pad
    responses[torch.arange(T) >= rl.unsqueeze(1)] = pad
    ragged_p, ragged_r = RaggedRows.from_dense(prompt_ids, pl, pad), RaggedRows.from_dense(responses, rl, pad)
    assert ragged_r.values.dtype == torch.int32
    rows = [7, 2, 0, 9, 5]
    want = build_microbatch(rows, prompt_ids, pl, responses, rl, pad_id=pad, seq_multiple=4, packed=packed)
    got = build_microbatch(rows, ragged_p, pl, ragged_r, rl, pad_id=pad, seq_multiple=4, packed=packed)
    for name in ("input_ids", "labels", "position_ids", "token_index", "seq_start"):
        assert getattr(got, name).dtype == getattr(want, name).dtype
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    only_empty = RaggedRows.from_dense(responses[2:3], rl[2:3], pad)  # no response token at all
    mb = build_microbatch([0], ragged_p.index_select(torch.tensor([2])), pl[2:3], only_empty, rl[2:3], pad_id=pad,
                          packed=packed)
    assert mb.input_ids.reshape(-1)[:int(pl[2])].tolist() == prompt_ids[2, :pl[2]].tolist()
    assert mb.token_index.numel() == 0


def test_ragged_take_reads_each_rows_entry_and_refuses_an_absent_row():
    rows = RaggedRows(torch.tensor([5, 6, 7, 8], dtype=torch.int32), torch.tensor([3, 0, 1]),
                      torch.ones(3, dtype=torch.bool), 4, -1)
    got = rows.take(torch.tensor([0, 0, 0, 0, 1, 2, 2]), torch.tensor([0, 2, 3, 9, 0, 0, 5]))
    assert got.tolist() == [5, 7, 7, 7, -1, 8, 8]  # past a row's end: its last entry; an empty row: fill
    absent = RaggedRows(torch.tensor([5, 6, 7], dtype=torch.int32), torch.tensor([3, 1]),
                        torch.tensor([True, False]), 4, -1)
    with pytest.raises(AbsentRowError):
        absent.take(torch.tensor([1]), torch.tensor([0]))


def _causal_prefix_features(ids: torch.Tensor, segments: list[tuple[int, int, int]]) -> torch.Tensor:
    """A stand-in for a causal model: at each position, (running sum, position in the sequence) of the
    tokens of its own sequence so far. segments: (row, start, length) of each sequence in ids [R, C]."""
    out = torch.zeros(*ids.shape, 2)
    for r, s0, n in segments:
        seg = ids[r, s0:s0 + n].double()
        out[r, s0:s0 + n, 0] = seg.cumsum(0).float()
        out[r, s0:s0 + n, 1] = torch.arange(n).float()
    return out


def test_unpacking_thd_gives_the_bshd_values_at_every_real_response_token():
    """The same rows in both layouts, a causal per-sequence function of the input, the real response
    tokens picked out of the [R, C, .] output: equal values in the same (row, t) order."""
    g = torch.Generator().manual_seed(0)
    B, P, T = 6, 5, 7
    prompt_ids = torch.randint(1, 50, (B, P), generator=g)
    prompt_length = torch.randint(1, P + 1, (B,), generator=g)
    responses = torch.randint(1, 50, (B, T), generator=g)
    response_length = torch.randint(0, T + 1, (B,), generator=g)
    rows = [4, 0, 2, 5, 1]
    picked = []
    for packed in (False, True):
        mb = build_microbatch(rows, prompt_ids, prompt_length, responses, response_length, pad_id=0,
                              seq_multiple=4, packed=packed)
        R, C = mb.input_ids.shape
        segments = [(int(s) // C, int(s) % C, int(n)) for s, n in zip(mb.seq_start, mb.seq_len)]
        feats = _causal_prefix_features(mb.input_ids, segments).reshape(R * C, 2)[mb.token_index]
        picked.append((feats, mb.token_labels(), mb.token_row, mb.token_pos))
        # each picked position holds the token before the label, within the same sequence
        flat_ids = mb.input_ids.reshape(-1)
        for n, (k, t) in enumerate(zip(mb.token_row.tolist(), mb.token_pos.tolist())):
            r = rows[k]
            before = prompt_ids[r, prompt_length[r] - 1] if t == 0 else responses[r, t - 1]
            assert int(flat_ids[mb.token_index[n]]) == int(before)
            assert int(mb.token_labels()[n]) == int(responses[r, t])
    (fa, la, ra, ta), (fb, lb, rb, tb) = picked
    assert fa.shape[0] == int(response_length[rows].sum())
    assert torch.equal(fa, fb) and torch.equal(la, lb) and torch.equal(ra, rb) and torch.equal(ta, tb)


def test_fillers_hold_padding_only_and_count_nothing():
    for packed in (False, True):
        f = filler_microbatch(pad_id=3, seq_multiple=4, packed=packed)
        assert f.is_filler and f.rows.numel() == 0 and f.token_index.numel() == 0 and f.width == 0
        assert f.input_ids.tolist() == [[3, 3, 3, 3]] and f.num_tokens == 0
        assert (f.cu_seqlens.tolist() == [0, 4]) if packed else f.cu_seqlens is None
    assert filler_microbatch(pad_id=0).input_ids.shape == (1, 2)  # two: MTP's shifted mask keeps a token


def test_make_microbatches_splits_to_the_agreed_count_with_fillers():
    batch = _tiny_batch()
    mbs = make_microbatches(*batch, max_tokens=100, pad_id=0, count=5)
    # lengths 5, 3, 5: one bin [0, 2, 1] split at the smaller larger half, then single rows, then fillers
    assert [mb.rows.tolist() for mb in mbs] == [[0], [2], [1], [], []]
    assert [mb.is_filler for mb in mbs] == [False, False, False, True, True]


def test_an_empty_prompt_is_a_named_error():
    prompt_ids, prompt_length, responses, response_length = _tiny_batch()
    with pytest.raises(ValueError, match="row 1 has an empty prompt"):
        build_microbatch([0, 1], prompt_ids, torch.tensor([3, 0, 1]), responses, response_length, pad_id=0)


def test_padding_to_a_common_shape_keeps_every_real_token():
    """Interleaved pipelines run one shape per pass: a padded micro-batch picks the same tokens with the
    same labels and the same per-sequence features (bshd: more rows and columns; thd: a longer pad segment)."""
    from megatron_dapo.workers.microbatch import pad_microbatch

    batch = _tiny_batch()
    for packed, shape in ((False, (5, 9)), (True, (1, 20))):
        mb = build_microbatch([0, 2], *batch, pad_id=0, packed=packed)
        big = pad_microbatch(mb, *shape, pad_id=0)
        assert tuple(big.input_ids.shape) == shape
        assert torch.equal(big.token_labels(), mb.token_labels())
        feats = []
        for m in (mb, big):
            R, C = m.input_ids.shape
            segs = [(int(s) // C, int(s) % C, int(n)) for s, n in zip(m.seq_start, m.seq_len)]
            feats.append(_causal_prefix_features(m.input_ids, segs).reshape(R * C, 2)[m.token_index])
        assert torch.equal(feats[0], feats[1])
        if packed:
            assert big.cu_seqlens.tolist() == [0, 5, 10, 20] and big.position_ids[0, 10:].tolist() == list(range(10))
    f = pad_microbatch(filler_microbatch(pad_id=0, packed=True), 1, 6, pad_id=0)
    assert f.cu_seqlens.tolist() == [0, 6] and f.is_filler
    with pytest.raises(ValueError, match="cannot pad a \\[2, 5\\] micro-batch to \\[1, 6\\]"):
        pad_microbatch(build_microbatch([0, 2], *batch, pad_id=0), 1, 6, pad_id=0)
