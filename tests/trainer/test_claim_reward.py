"""The queue trainer's reward stage in the producer (trainer/claim_reward.py): a claim is scored before
its write and the scores land in the same transaction as the trajectories; a scoring failure writes
nothing (the prompts stay running for the recovery); the producers' layout (threads x claim size)."""

import pytest

from megatron_dapo.config.schema import QueueConfig
from megatron_dapo.data.tokenizer import CharTokenizer
from megatron_dapo.rewards.manager import RewardManager
from megatron_dapo.rollout.base import Sample, SamplingParams
from megatron_dapo.trainer.claim_reward import ClaimScorer
from megatron_dapo.trainer.producer import Producer
from megatron_dapo.trainer.queue_trainer import TRAIN, producer_layout

TOK = CharTokenizer()
ids = lambda text: tuple(TOK.encode(text))  # noqa: E731


def exact_match(solution, ground_truth):
    return {"score": 1.0 if solution == ground_truth else -1.0, "acc": solution == ground_truth, "pred": solution}


def failing(solution, ground_truth):
    raise ValueError("the reward function is broken")


class ScriptedEngine:
    """generate answers each prompt's j-th sample with `answers[prompt token ids][j]`, finishing "stop"."""

    def __init__(self, answers):
        self.answers, self.policy_version = answers, 0

    def generate(self, prompts, sampling):
        out = []
        for p in prompts:
            for j in range(sampling.n):
                toks = ids(self.answers[p.token_ids][j])
                out.append(Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids,
                                  response_token_ids=toks, rollout_log_probs=(-0.25,) * len(toks),
                                  finish_reason="stop", policy_version=0))
        return out


def _manager(fn=exact_match):
    # max 4 tokens, a 2-token overlong buffer: penalty 0 up to 2 tokens, -0.5 at 3, -1.0 at 4
    return RewardManager(fn, max_response_length=4, overlong_buffer_enable=True, overlong_buffer_len=2,
                         overlong_penalty_factor=1.0, timeout_s=0)


def test_a_claim_is_scored_per_group_with_overlong_shaping():
    with _manager() as rm:
        groups = ClaimScorer(TOK, rm).score({"ground_truth": ["12", "7"], "data_source": ["a", "b"]},
                                            [[ids("12"), ids("123")], [ids("7"), ids("1234"), ids("8")]])
    assert [g["rm_scores"] for g in groups] == [[1.0, -1.0], [1.0, -1.0, -1.0]]
    assert [g["rewards"] for g in groups] == [[1.0, -1.5], [1.0, -2.0, -1.0]]
    assert [g["response_text"] for g in groups] == [["12", "123"], ["7", "1234", "8"]]
    assert [g["acc"] for g in groups] == [[True, False], [True, False, False]]
    assert groups[1]["data_source"] == ["b", "b", "b"]
    assert groups[0]["reward_keys"] == groups[1]["reward_keys"] and "acc" in groups[0]["reward_keys"]


def _put(q, prompts, truths):
    keys = [f"k{i}@1.0" for i in range(len(prompts))]
    q.put(TRAIN, keys, {"prompts": [list(ids(p)) for p in prompts], "seed": [3] * len(keys),
                        "ground_truth": truths, "data_source": ["math"] * len(keys)}, {"global_steps": 1})
    return keys


def test_the_producer_writes_each_group_with_its_scores(queue):
    keys = _put(queue, ["1+1=", "3+4="], ["2", "7"])
    engine = ScriptedEngine({ids("1+1="): ["2", "22"], ids("3+4="): ["7", "7"]})
    with _manager() as rm:
        producer = Producer(queue, engine, sampling=SamplingParams(max_new_tokens=4, n=2), producer_id="t",
                            scorer=ClaimScorer(TOK, rm))
        assert producer.run_once(8) == 2
    tkeys = [f"{k}_{j}" for k in keys for j in range(2)]
    f = queue.get(TRAIN, tkeys, ["rm_scores", "rewards", "response_text", "acc", "responses"])
    assert f["rm_scores"] == [1.0, -1.0, 1.0, 1.0] and f["rewards"] == [1.0, -1.0, 1.0, 1.0]
    assert f["response_text"] == ["2", "22", "7", "7"] and f["acc"] == [True, False, True, True]
    assert [t["status"] for t in queue.get_tags(TRAIN, keys)] == ["done", "done"]
    assert "acc" in queue.get(TRAIN, keys[:1], ["reward_keys"])["reward_keys"][0]


def test_a_claim_whose_scoring_fails_writes_nothing_and_stays_running(queue):
    keys = _put(queue, ["1+1="], ["2"])
    with RewardManager(failing, max_response_length=4, timeout_s=0, on_error="raise") as rm:
        producer = Producer(queue, ScriptedEngine({ids("1+1="): ["2", "2"]}), producer_id="t",
                            sampling=SamplingParams(max_new_tokens=4, n=2), scorer=ClaimScorer(TOK, rm))
        with pytest.raises(Exception, match="broken"):
            producer.run_once(8)
    assert [t["status"] for t in queue.get_tags(TRAIN, keys)] == ["running"]  # reissued by the recovery
    assert queue.count(TRAIN, is_prompt=False) == 0


@pytest.mark.parametrize(("num", "claim", "gen_batch", "servers", "expect"), [
    (0, 64, 1536, True, (24, 64)),  # the recipe: 24 threads keep a generation batch in flight
    (0, 64, 1536, False, (1, 64)),  # local engine: one producer process
    (0, 64, 100, True, (2, 50)),  # never more than a batch's share per producer
    (2, 64, 8, True, (2, 4)),
    (3, 1, 8, False, (3, 1)),
])
def test_producer_layout(num, claim, gen_batch, servers, expect):
    qc = QueueConfig(num_producers=num, claim_prompts=claim)
    assert producer_layout(qc, gen_batch=gen_batch, on_servers=servers) == expect
