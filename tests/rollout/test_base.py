"""The rollout contract: parameter validation, Sample checks, seeds, ordering, batch padding."""

import dataclasses

import pytest
import torch

from megatron_dapo.rollout.base import (
    BatchRow,
    PromptInput,
    RolloutEngine,
    RolloutEngineError,
    Sample,
    SamplingParams,
    check_generate_inputs,
    check_generate_output,
    derive_sample_seed,
    placed_row,
    rows_to_ragged,
    samples_to_batch,
    samples_to_ragged,
)
from megatron_dapo.rollout.ragged import RaggedRows, RowArena, to_dense


def _sample(
    pid="p0", j=0, prompt=(1, 2), resp=(5, 6), logps=(-0.5, -1.0), finish="stop", version=3, meta=None
):
    return Sample(
        prompt_id=pid,
        sample_index=j,
        prompt_token_ids=prompt,
        response_token_ids=resp,
        rollout_log_probs=logps,
        finish_reason=finish,
        policy_version=version,
        meta=meta or {},
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "n": 0}, "n"),
        ({"max_new_tokens": 4, "temperature": -0.1}, "temperature"),
        ({"max_new_tokens": 4, "temperature": float("inf")}, "temperature"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 4, "top_k": 0}, "top_k"),
        ({"max_new_tokens": 4, "top_k": -2}, "top_k"),
        ({"max_new_tokens": 4, "stop_token_ids": (1, -3)}, "stop_token_ids"),
        ({"max_new_tokens": 4, "stop_token_ids": "12"}, "stop_token_ids"),
        ({"max_new_tokens": 4, "seed": 1.5}, "seed"),
        ({"max_new_tokens": True}, "max_new_tokens"),
    ],
)
def test_sampling_params_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_stop_ids_become_a_tuple():
    sp = SamplingParams(max_new_tokens=8, stop_token_ids=[2, 7])
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (1, 1.0, 1.0, -1, None)
    assert sp.stop_token_ids == (2, 7)
    assert SamplingParams(max_new_tokens=1, temperature=0.0, top_k=1).temperature == 0.0  # greedy is valid
    with pytest.raises(TypeError):
        SamplingParams(8)  # keyword-only: no silent positional mix-ups


def test_prompt_input_requires_id_and_nonempty_int_tokens():
    assert PromptInput("a", [3, 4]).token_ids == (3, 4)
    with pytest.raises(ValueError, match="prompt_id"):
        PromptInput("", (1,))
    with pytest.raises(ValueError, match=r"token_ids is empty"):
        PromptInput("a", ())
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        PromptInput("a", (1, 2.0))


def test_sample_rejects_length_mismatch_bad_logprob_and_finish_reason():
    with pytest.raises(ValueError, match="rollout_log_probs has 1 entries, response_token_ids has 2"):
        _sample(logps=(-0.5,))
    with pytest.raises(ValueError, match=r"rollout_log_probs\[1\].*nan"):
        _sample(logps=(-0.5, float("nan")))
    with pytest.raises(ValueError, match=r"rollout_log_probs\[0\].*0.5"):
        _sample(logps=(0.5, -1.0))
    with pytest.raises(ValueError, match=r"rollout_log_probs\[1\].*None"):
        _sample(logps=(-0.5, None))
    with pytest.raises(ValueError, match="finish_reason"):
        _sample(finish="eos")
    with pytest.raises(ValueError, match=r"response_token_ids\[0\]"):
        _sample(resp=(-1, 2))
    with pytest.raises(ValueError, match="sample_index"):
        _sample(j=-1)
    s = _sample(resp=[5, 6], logps=[-0.5, -1])
    assert s.response_token_ids == (5, 6) and s.rollout_log_probs == (-0.5, -1.0)


def test_min_policy_version_is_the_first_tokens_version_when_the_weights_changed_mid_sample():
    """first_policy_version (the weights of the first token, set only when they differ) is what
    min_policy_version reports; without it every token came from policy_version."""
    whole = _sample(version=3)
    assert (whole.first_policy_version, whole.min_policy_version) == (None, 3)
    spanning = dataclasses.replace(whole, first_policy_version=1)
    assert (spanning.policy_version, spanning.min_policy_version) == (3, 1)
    assert dataclasses.replace(whole, first_policy_version=0).min_policy_version == 0  # 0 is a version, not "unset"


def test_first_policy_version_newer_than_policy_version_or_negative_is_refused_naming_the_sample():
    with pytest.raises(ValueError, match=r"Sample\(prompt_id='p0', sample_index=0\): first_policy_version 4 is "
                                         r"newer than policy_version 3"):
        dataclasses.replace(_sample(version=3), first_policy_version=4)
    with pytest.raises(ValueError, match="first_policy_version"):
        dataclasses.replace(_sample(version=3), first_policy_version=-1)
    with pytest.raises(ValueError, match="first_policy_version"):
        dataclasses.replace(_sample(version=3), first_policy_version="2")


def test_derive_sample_seed_is_stable_distinct_and_31_bit():
    a = derive_sample_seed(7, "p0", 0)
    assert a == derive_sample_seed(7, "p0", 0)
    seeds = {derive_sample_seed(7, f"p{i}", j) for i in range(20) for j in range(8)}
    assert len(seeds) == 160
    assert all(0 <= s < 2**31 for s in seeds)
    assert derive_sample_seed(8, "p0", 0) != a


def test_check_generate_inputs_rejects_duplicate_prompt_ids():
    sp = SamplingParams(max_new_tokens=2)
    check_generate_inputs([PromptInput("a", (1,)), PromptInput("b", (1,))], sp)
    with pytest.raises(ValueError, match=r"prompts\[1\]\.prompt_id 'a' is repeated"):
        check_generate_inputs([PromptInput("a", (1,)), PromptInput("a", (2,))], sp)
    with pytest.raises(TypeError, match=r"prompts\[0\]"):
        check_generate_inputs([(1, 2)], sp)


def test_check_generate_output_enforces_prompt_major_order():
    prompts = [PromptInput("a", (1,)), PromptInput("b", (2,))]
    sp = SamplingParams(max_new_tokens=2, n=2)
    good = [_sample("a", 0), _sample("a", 1), _sample("b", 0), _sample("b", 1)]
    check_generate_output(prompts, sp, good)
    with pytest.raises(RolloutEngineError, match=r"row 1: .*\('a', 1\)"):
        check_generate_output(prompts, sp, [good[0], good[2], good[1], good[3]])
    with pytest.raises(RolloutEngineError, match="3 samples, expected 2 x 2"):
        check_generate_output(prompts, sp, good[:3])


def test_samples_to_batch_pads_right_and_masks_exactly():
    samples = [
        _sample(
            "a", 0, prompt=(1, 2, 3), resp=(10, 11, 12), logps=(-0.1, -0.2, -0.3), finish="length", version=4
        ),
        _sample("a", 1, prompt=(1, 2, 3), resp=(13,), logps=(-0.4,), finish="stop", version=4),
        _sample(
            "b", 0, prompt=(7,), resp=(), logps=(), finish="abort", version=5, meta={"spec_verify_ct": 2}
        ),
    ]
    b = samples_to_batch(samples, pad_id=0, max_response_length=4)
    assert len(b) == 3
    assert b.prompt_ids.tolist() == [[1, 2, 3], [1, 2, 3], [7, 0, 0]]
    assert b.prompt_length.tolist() == [3, 3, 1]
    assert b.responses.tolist() == [[10, 11, 12, 0], [13, 0, 0, 0], [0, 0, 0, 0]]
    assert b.response_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert b.response_mask.dtype == torch.float32 and b.responses.dtype == torch.int64
    assert b.rollout_log_probs.dtype == torch.float32
    torch.testing.assert_close(
        b.rollout_log_probs,
        torch.tensor([[-0.1, -0.2, -0.3, 0.0], [-0.4, 0.0, 0.0, 0.0], [0.0] * 4]),
        rtol=0,
        atol=0,
    )
    assert b.response_length.tolist() == [3, 1, 0]
    assert b.sample_index.tolist() == [0, 1, 0]
    assert b.policy_version.tolist() == [4, 4, 5]
    assert b.aborted.tolist() == [False, False, True]
    assert b.finish_reason == ["length", "stop", "abort"]
    assert b.index == ["a", "a", "b"]
    assert b.meta == [{}, {}, {"spec_verify_ct": 2}]


def test_samples_to_batch_uses_pad_id_and_rejects_overlong_and_empty():
    b = samples_to_batch([_sample(resp=(5,), logps=(-1.0,))], pad_id=99, max_response_length=3)
    assert b.responses.tolist() == [[5, 99, 99]]
    with pytest.raises(
        ValueError,
        match=r"row 0 \(prompt_id='p0', sample_index=0\) has 2 response tokens > max_response_length=1",
    ):
        samples_to_batch([_sample()], pad_id=0, max_response_length=1)
    with pytest.raises(ValueError, match="samples is empty"):
        samples_to_batch([], pad_id=0, max_response_length=4)


def test_samples_to_ragged_holds_the_real_tokens_only_and_densifies_to_samples_to_batch():
    samples = [
        _sample("a", 0, prompt=(1, 2, 3), resp=(10, 11, 12), logps=(-0.1, -0.2, -0.3), finish="length", version=4),
        _sample("a", 1, prompt=(1, 2, 3), resp=(13,), logps=(-0.4,), finish="stop", version=4),
        _sample("b", 0, prompt=(7,), resp=(), logps=(), finish="abort", version=5, meta={"spec_verify_ct": 2}),
        _sample("b", 1, prompt=(7,), resp=(8, 9), logps=(-0.5, -0.6), finish="stop", version=5),
    ]
    r = samples_to_ragged(samples, n=2, pad_id=0, max_response_length=4)
    assert isinstance(r.responses, RaggedRows) and r.response_mask is None
    assert r.responses.values.tolist() == [10, 11, 12, 13, 8, 9]  # no padding anywhere
    assert r.prompt_ids.values.tolist() == [1, 2, 3, 1, 2, 3, 7, 7] and r.prompt_ids.width == 3
    assert r.responses.width == 4 and r.rollout_log_probs.values.dtype == torch.float32
    assert r.responses.values.dtype == r.prompt_ids.values.dtype == torch.int32  # ids held in 4 bytes
    dense, ref = to_dense(r), samples_to_batch(samples, pad_id=0, max_response_length=4)
    for f in dataclasses.fields(ref):
        a, b = getattr(dense, f.name), getattr(ref, f.name)
        assert (torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b), f.name


def test_samples_to_ragged_refuses_rows_out_of_prompt_major_order_and_overlong_rows():
    a0, a1 = _sample("a", 0), _sample("a", 1)
    with pytest.raises(ValueError, match=r"row 0 is \('a', 1\), not prompt-major with n=2"):
        samples_to_ragged([a1, a0], n=2, pad_id=0, max_response_length=4)
    with pytest.raises(ValueError, match=r"row 1 \(prompt_id='a', sample_index=1\) has 2 response tokens > "
                                         r"max_response_length=1"):
        samples_to_ragged([_sample("a", 0, resp=(5,), logps=(-1.0,)), a1], n=2, pad_id=0, max_response_length=1)


def test_ragged_dense_is_one_copy_per_row_and_equals_a_masked_scatter():
    lengths = torch.tensor([3, 0, 5, 1])
    values = torch.arange(9)
    rows = RaggedRows(values, lengths, torch.ones(4, dtype=torch.bool), 6, -1)
    expected = torch.full((4, 6), -1)
    expected[torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)] = values
    assert torch.equal(rows.dense(), expected)
    assert rows.row(2).tolist() == [3, 4, 5, 6, 7] and rows.index_select(torch.tensor([3, 0])).values.tolist() == [8, 0, 1, 2]
    # Token ids held as int32 densify to int64; a dense int64 tensor goes ragged as int32 and back unchanged.
    held32 = RaggedRows(values.to(torch.int32), lengths, torch.ones(4, dtype=torch.bool), 6, -1)
    assert held32.dense().dtype == torch.int64 and torch.equal(held32.dense(), expected)
    back = RaggedRows.from_dense(expected, lengths, -1)
    assert back.values.dtype == torch.int32 and torch.equal(back.dense(), expected)
    log_probs = RaggedRows.from_dense(expected.double(), lengths, 0.0)
    assert log_probs.values.dtype == log_probs.dense().dtype == torch.float64  # floats keep their dtype


def test_rows_written_into_an_arena_in_arrival_order_make_the_batch_without_a_copy(monkeypatch):
    """Rows placed as their replies arrive (here b, then a's second row, then a's first) make the ragged
    batch in place: the arena's values with each row's start; read, selected, densified, concatenated and
    compacted, they equal the batch made by concatenation."""
    prompts, n, width = [PromptInput("a", (1, 2)), PromptInput("b", (3,))], 2, 5
    tokens = [torch.tensor(t, dtype=torch.int32) for t in ([10, 11, 12], [13], [], [14, 15, 16, 17, 18])]
    logps = [-0.1 * (1 + torch.arange(len(t), dtype=torch.float32)) for t in tokens]
    rows = [BatchRow(t, lp, "stop", 3, {}, None) for t, lp in zip(tokens, logps, strict=True)]
    arena = RowArena(len(rows), width)
    placed = [None] * 4
    for b in (2, 3, 1, 0):  # arrival order
        placed[b] = placed_row(rows[b], arena)
    got = rows_to_ragged(prompts, n, placed, pad_id=0, max_response_length=width, arena=arena)
    want = rows_to_ragged(prompts, n, rows, pad_id=0, max_response_length=width)
    assert got.responses.values.data_ptr() == arena.ids.data_ptr()  # the arena's memory, no copy
    assert got.responses.starts.tolist() == [6, 5, 0, 0] and got.responses.values.tolist() == [14, 15, 16, 17, 18, 13,
                                                                                             10, 11, 12]
    assert want.responses.starts is None
    for name in ("responses", "rollout_log_probs"):
        g, w = getattr(got, name), getattr(want, name)
        assert torch.equal(g.dense(), w.dense()), name
        assert [g.row(b).tolist() for b in range(4)] == [w.row(b).tolist() for b in range(4)], name
        sel = torch.tensor([3, 0])
        assert g.index_select(sel).starts is None and torch.equal(g.index_select(sel).values, w.index_select(sel).values)
        assert g.compact().starts is None and torch.equal(g.compact().values, w.values), name
        assert torch.equal(RaggedRows.cat([g, w]).values, torch.cat([w.values, w.values])), name
    assert torch.equal(got.responses.take(torch.tensor([0, 3, 1]), torch.tensor([2, 4, 0])), torch.tensor([12, 18, 13]))
    # A row that no longer fits (a retried request's rows placed twice) stays where it was: the batch is then
    # concatenated as without an arena.
    full = RowArena(1, 3)
    first, second = placed_row(rows[0], full), placed_row(rows[1], full)
    assert first.tokens.data_ptr() == full.ids.data_ptr() and second.tokens is rows[1].tokens
    assert full.rows([first.tokens, second.tokens], [first.log_probs, second.log_probs], torch.tensor([3, 1]),
                     width=3, fill=0) is None
    # A host that refuses the reservation (strict overcommit) gets no arena, and the same batch.
    real_empty = torch.empty

    def refusing(size, *a, **k):
        if isinstance(size, int) and size > 100:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real_empty(size, *a, **k)

    monkeypatch.setattr(torch, "empty", refusing)
    refused = RowArena(100, 5)
    assert refused.capacity == 0 and placed_row(rows[0], refused).tokens is rows[0].tokens
    monkeypatch.undo()
    with pytest.raises(ValueError, match="row starts outside the 3 values"):
        RaggedRows(torch.zeros(3), torch.tensor([2, 2]), torch.ones(2, dtype=torch.bool), 4, 0.0, torch.tensor([0, 2]))


def test_rollout_engine_is_abstract_and_a_context_manager():
    with pytest.raises(TypeError):
        RolloutEngine()

    class Minimal(RolloutEngine):
        closed = False

        def generate(self, prompts, sampling):
            return []

        def update_weights(self, named_tensors=None, *, policy_version, **kw):
            pass

        def abort(self):
            pass

        def release_memory(self):
            pass

        def resume_memory(self):
            pass

        def health(self):
            return {"healthy": True, "policy_version": 0}

        @property
        def policy_version(self):
            return 0

        def close(self):
            self.closed = True

    with Minimal() as m:
        assert m.health()["healthy"]
    assert m.closed
