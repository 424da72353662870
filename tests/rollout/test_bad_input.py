"""Bad rollout input is refused with an error that names it, before any generation starts.

The issue's list: empty prompts, prompts longer than the context, n = 0, top_p outside (0, 1],
negative temperature. The sampling parameters and prompts fail when they are built; a prompt that
does not fit the model's context fails in LocalEngine.generate before its first forward (a
forward hook counts forwards). The same checks through the EnginePool are in test_ray_pool.py.
"""

import math

import pytest

from megatron_dapo.rollout.base import PromptInput, SamplingParams, check_generate_inputs
from megatron_dapo.rollout.local_engine import LocalEngine

VOCAB, PAD, EOS, CONTEXT = 16, 0, 1, 32


@pytest.mark.parametrize("field,value,message", [
    ("n", 0, r"SamplingParams\.n must be an int >= 1, got 0"),
    ("n", -2, r"SamplingParams\.n must be an int >= 1, got -2"),
    ("top_p", 0.0, r"SamplingParams\.top_p must be in \(0, 1\], got 0\.0"),
    ("top_p", 1.5, r"SamplingParams\.top_p must be in \(0, 1\], got 1\.5"),
    ("top_p", -0.1, r"SamplingParams\.top_p must be in \(0, 1\]"),
    ("top_p", math.nan, r"SamplingParams\.top_p must be in \(0, 1\], got nan"),
    ("temperature", -1.0, r"SamplingParams\.temperature must be a finite number >= 0, got -1\.0"),
    ("temperature", math.inf, r"SamplingParams\.temperature must be a finite number >= 0, got inf"),
    ("temperature", math.nan, r"SamplingParams\.temperature must be a finite number >= 0, got nan"),
    ("max_new_tokens", 0, r"SamplingParams\.max_new_tokens must be an int >= 1, got 0"),
])
def test_bad_sampling_params_name_the_field(field, value, message):
    kwargs = {"max_new_tokens": 4, field: value}
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_boundaries_are_accepted():
    """The edges of the valid ranges: greedy, top_p exactly 1 and just above 0, n = 1."""
    for kwargs in ({"temperature": 0.0}, {"top_p": 1.0}, {"top_p": 1e-9}, {"n": 1}):
        SamplingParams(max_new_tokens=1, **kwargs)


def test_empty_prompts_name_the_prompt():
    with pytest.raises(ValueError, match=r"PromptInput\(prompt_id='q7'\)\.token_ids is empty"):
        PromptInput("q7", ())
    with pytest.raises(ValueError, match=r"PromptInput\.prompt_id must be a non-empty str, got ''"):
        PromptInput("", (3, 4))
    with pytest.raises(ValueError, match=r"token_ids\[1\] must be an int >= 0, got -4"):
        PromptInput("q8", (3, -4))
    with pytest.raises(ValueError, match=r"prompts\[1\]\.prompt_id 'a' is repeated"):
        check_generate_inputs([PromptInput("a", (1,)), PromptInput("a", (2,))], SamplingParams(max_new_tokens=1))


@pytest.fixture(scope="module")
def engine_and_forwards():
    """A LocalEngine on a tiny model with a 32-token context, and a counter of its model forwards."""
    from megatron_dapo.models.arch import get_arch
    from megatron_dapo.models.builder import build_gpt_model
    from megatron_dapo.parallel import init_parallel

    pgs = init_parallel()
    model = build_gpt_model(get_arch("tiny", vocab_size=VOCAB, max_position_embeddings=CONTEXT), pgs=pgs, seed=0)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    return LocalEngine(model, pgs=pgs, eos_token_id=EOS, pad_token_id=PAD), forwards


@pytest.mark.parametrize("prompt_len,max_new,ok", [(28, 4, True), (29, 4, False), (33, 1, False), (3, 30, False)])
def test_prompt_longer_than_the_context_fails_before_any_forward(engine_and_forwards, prompt_len, max_new, ok):
    """prompt + max_new_tokens must fit the 32-token context; a misfit anywhere in the call fails
    the whole call before the first forward, and names the prompt and the numbers."""
    engine, forwards = engine_and_forwards
    forwards.clear()
    prompts = [PromptInput("fits", (3,)), PromptInput("long", (5,) * prompt_len)]
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    if ok:
        samples = engine.generate(prompts, sampling)
        assert len(samples) == 2 and forwards
        return
    total = prompt_len + max_new
    with pytest.raises(ValueError, match=rf"prompt 'long': {prompt_len} prompt tokens \+ max_new_tokens={max_new} "
                                         rf"= {total} > the model's max_sequence_length={CONTEXT}"):
        engine.generate(prompts, sampling)
    assert forwards == []


def test_token_outside_the_vocabulary_fails_before_any_forward(engine_and_forwards):
    engine, forwards = engine_and_forwards
    forwards.clear()
    with pytest.raises(ValueError, match=rf"prompt 'v': token id {VOCAB} is outside the model's vocabulary"):
        engine.generate([PromptInput("ok", (2, 3)), PromptInput("v", (2, VOCAB))], SamplingParams(max_new_tokens=2))
    assert forwards == []


def test_sglang_engine_refuses_a_prompt_longer_than_the_server_context_before_sending(tmp_path):
    """Issue #15 item 1: the server reports its --context-length in /server_info; the engine refuses a
    prompt + max_new_tokens beyond it before any request (SGLang would only cut max_new_tokens)."""
    from megatron_dapo.rollout.sglang.engine import SGLangEngine
    from tests.standin import StandinServer

    with StandinServer(toy=True, args=["--context-length", "16"], log_dir=tmp_path) as server:
        with SGLangEngine([server.url]) as engine:
            assert engine.max_sequence_length == 14  # SGLang generates in full up to its context - 2
            with pytest.raises(ValueError, match=r"prompt 'p': 8 prompt tokens \+ max_new_tokens=7 = 15 > 14"):
                engine.generate([PromptInput("p", tuple(range(1, 9)))], SamplingParams(max_new_tokens=7))
            assert server.requests("/generate") == []
            fits = engine.generate([PromptInput("q", tuple(range(1, 9)))], SamplingParams(max_new_tokens=6))
            assert len(fits[0].response_token_ids) == 6
