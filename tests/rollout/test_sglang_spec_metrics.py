"""Issue #15: accept rate and accept length per step under spec_decode/, from the counters of the release
the servers run (0.5.8: spec_draft_token_num / spec_accept_token_num; 0.5.23: spec_num_proposed_drafts /
spec_num_correct_drafts), against the stand-in speaking each release.

One step's rollout, as the trainer gathers it (two generation batches): four 5-token responses (1 token
from the prefill, then 2 verify steps, one accepted draft each: accepted 2, proposed 2 x (4 - 1) = 6) and
two 1-token responses (no verify step: from 0.5.8 SGLang sends no counters for them). Per request:
accept_rate = 2 / 6, accept_length = 1 + 2 / 2 = 2; the two short ones are counted apart."""

import pytest

from megatron_dapo.metrics import compute_spec_decode_metrics
from megatron_dapo.rollout.base import PromptInput, SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.versions import features_for
from tests.standin import StandinServer

PROMPTS = [PromptInput("a", (3, 1, 4)), PromptInput("b", (1, 5, 9))]
ARGS = ["--speculative-algorithm", "EAGLE", "--speculative-num-draft-tokens", "4"]


@pytest.mark.parametrize("version, proposed_key", [("0.5.8", "spec_draft_token_num"),
                                                   ("0.5.23", "spec_num_proposed_drafts")])
def test_a_steps_accept_rate_and_length_come_from_the_releases_counters(tmp_path, version, proposed_key):
    assert features_for(version).spec_proposed_key == proposed_key
    with StandinServer(toy=True, emulate_version=version, args=ARGS, log_dir=tmp_path) as s, \
            SGLangEngine([s.url]) as eng:
        long = eng.generate_batch(PROMPTS, SamplingParams(max_new_tokens=5, n=2), pad_id=0, max_response_length=5)
        short = eng.generate_batch(PROMPTS[:1], SamplingParams(max_new_tokens=1, n=2), pad_id=0, max_response_length=5)
    assert long.response_length.tolist() == [5, 5, 5, 5] and short.response_length.tolist() == [1, 1]
    m = compute_spec_decode_metrics(long.meta + short.meta)
    assert m == pytest.approx({"spec_decode/accept_rate": 2 / 6, "spec_decode/accept_length": 2.0,
                               "spec_decode/num_requests": 4.0, "spec_decode/num_unverified": 2.0})
    assert short.meta == [{}, {}]  # no counters for a request without a verify step (0.5.8+)
