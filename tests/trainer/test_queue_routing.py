"""R3 in the queue trainer: the producer writes each row's routing (as the engine decoded it from the server's
reply) with its claim, a file per row beside the queue (queue/spool.py); dynamic sampling drops a filtered
group's, rank 0 reads back the routing of the rows a step trains, exactly, with the rest of its batch
(queue_collect.py), and the step's commit drops it; files no row references are swept. The run end to end
on a real server: tests/sglang_real/test_moe_server.py."""

import os
import time
import zlib
from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.queue import QueueKeyError, spool
from megatron_dapo.rollout.base import Sample, SamplingParams
from megatron_dapo.trainer.claim_reward import ClaimScorer
from megatron_dapo.trainer.producer import Producer, WeightStore
from megatron_dapo.trainer.queue_collect import QueueCollection
from megatron_dapo.trainer.queue_trainer import TRAIN, QueueTrainer
from tests.trainer.test_claim_reward import TOK, _manager, ids

LAYERS, TOP_K = 3, 2


def routing_of(prompt_id: str, j: int, tokens: int) -> torch.Tensor:
    """A row's routing as the engine hands it over: [layers, tokens, top-k] uint8, distinct per row."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{prompt_id}/{j}".encode()))
    return torch.randint(0, 128, (LAYERS, tokens, TOP_K), generator=g, dtype=torch.uint8)


class RoutingEngine:
    """Answers each prompt's j-th sample with `answers[prompt][j]` and its routing (None for "abort" rows,
    as an aborted request without routing)."""

    def __init__(self, answers):
        self.answers, self.policy_version, self.given = answers, 0, {}

    def generate(self, prompts, sampling):
        out = []
        for p in prompts:
            for j in range(sampling.n):
                toks = ids(self.answers[p.token_ids][j])
                routing = routing_of(p.prompt_id, j, len(p.token_ids) + len(toks) - 1)
                self.given[(p.prompt_id, j)] = routing
                out.append(Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids,
                                  response_token_ids=toks, rollout_log_probs=(-0.25,) * len(toks),
                                  finish_reason="stop", policy_version=0, routed_experts=routing))
        return out


class Rank0(QueueCollection):
    """What QueueCollection reads of its trainer, for a queue whose groups are written already."""

    def __init__(self, queue, n):
        self.queue, self.n, self.r3, self.sync_mode, self.policy_version = queue, n, True, True, 0
        fg = SimpleNamespace(enable=True, metric="acc", max_num_gen_batches=0, on_exhausted="raise")
        self.cfg = SimpleNamespace(algorithm=SimpleNamespace(filter_groups=fg),
                                   data=SimpleNamespace(max_response_length=4))
        self.p = SimpleNamespace(tokenizer=TOK)
        self._pool, self._filtered, self._seen = [], [], set()


def test_the_routing_written_with_a_claim_is_read_back_for_the_trained_rows_and_leaves_with_the_groups(queue):
    prompts, truths = ["1+1=", "3+4=", "2+2="], ["2", "7", "4"]
    keys = [f"k{i}@1.0" for i in range(len(prompts))]
    queue.put(TRAIN, keys, {"prompts": [list(ids(p)) for p in prompts], "seed": [3] * len(keys),
                            "ground_truth": truths, "data_source": ["math"] * len(keys),
                            "raw_prompt": prompts, "uid": [f"u{i}" for i in range(len(keys))]}, {"global_steps": 1})
    # k0 and k2 mixed (kept by dynamic sampling), k1 all correct (constant: filtered)
    engine = RoutingEngine({ids("1+1="): ["2", "22"], ids("3+4="): ["7", "7"], ids("2+2="): ["5", "4"]})
    with _manager() as rm:
        producer = Producer(queue, engine, sampling=SamplingParams(max_new_tokens=4, n=2), producer_id="t",
                            scorer=ClaimScorer(TOK, rm), routing=True)
        assert producer.run_once(8) == 3
    directory = spool.spool_dir(queue.path)
    refs = queue.get(TRAIN, [f"{k}_{j}" for k in keys for j in range(2)], ["routed_experts"])["routed_experts"]
    assert all(torch.equal(spool.read_tensor(directory, ref), engine.given[(k, j)]) for ref, (k, j) in
               zip(refs, [(k, j) for k in keys for j in range(2)], strict=True))
    assert sorted(os.listdir(directory)) == sorted(ref["spool"] for ref in refs)

    rank0 = Rank0(queue, n=2)
    rank0._classify(keys)
    assert [k for k, _ in rank0._pool] == ["k0@1.0", "k2@1.0"] and rank0._filtered == ["k1@1.0"]
    assert queue.get(TRAIN, ["k1@1.0_0", "k1@1.0_1"], ["routed_experts"])["routed_experts"] == [None, None]
    assert sorted(os.listdir(directory)) == sorted(ref["spool"] for ref in refs[:2] + refs[4:])

    batch, _ = rank0._load_batch(["k2@1.0", "k0@1.0"])
    rb = batch.rollout
    assert rb.index == ["k2@1.0", "k2@1.0", "k0@1.0", "k0@1.0"]
    for row, (k, j) in enumerate([("k2@1.0", 0), ("k2@1.0", 1), ("k0@1.0", 0), ("k0@1.0", 1)]):
        got = rb.routed_experts[row]
        assert got.dtype == torch.uint8 and torch.equal(got, engine.given[(k, j)]), (k, j)
        assert got.shape[1] == int(rb.prompt_length[row] + rb.response_length[row]) - 1

    QueueTrainer._commit(rank0, 1, ["k2@1.0", "k0@1.0"], last=False)  # the step trained them: consumed, routing gone
    tkeys = [f"{k}_{j}" for k in keys for j in range(2)]
    f = queue.get(TRAIN, tkeys, ["routed_experts", "responses"])
    assert f["routed_experts"] == [None] * 6 and [len(r) for r in f["responses"]] == [1, 2, 1, 1, 1, 1]
    assert os.listdir(directory) == []
    assert queue.get(TRAIN, keys, ["fate"])["fate"] == ["trained", "filtered", "trained"]
    # a crash after the commit, before the next checkpoint: the recovery retrains these groups, without routing
    assert rank0._load_batch(["k2@1.0", "k0@1.0"])[0].rollout.routed_experts is None


def test_a_producer_writes_no_routing_field_unless_asked(queue):
    queue.put(TRAIN, ["k@1.0"], {"prompts": [list(ids("1+1="))], "seed": [3]}, {"global_steps": 1})
    engine = RoutingEngine({ids("1+1="): ["2", "3"]})
    assert Producer(queue, engine, sampling=SamplingParams(max_new_tokens=4, n=2), producer_id="t").run_once(8) == 1
    with pytest.raises(QueueKeyError):
        queue.get(TRAIN, ["k@1.0_0"], ["routed_experts"])


def test_routing_with_abort_and_continue_partial_rollouts_is_refused(tmp_path, queue):
    """A continued sample is a new request: its routing would cover its last segment only."""
    with pytest.raises(ValueError, match="cannot join aborted and continued samples' routing"):
        Producer(queue, RoutingEngine({}), sampling=SamplingParams(max_new_tokens=4, n=2), producer_id="t",
                 weights=WeightStore(str(tmp_path / "w")), partial_rollout=True, routing=True)


def test_routing_files_no_row_references_are_swept_and_a_missing_one_is_named(queue):
    """A claim's files are written before its transaction: a sweep while producers run leaves young files
    alone; with none running (a recovery) every file no row names goes. A reference to a file that is gone
    is an error naming it."""
    queue.put(TRAIN, ["k@1.0"], {"prompts": [list(ids("1+1="))], "seed": [3]}, {"global_steps": 1})
    engine = RoutingEngine({ids("1+1="): ["2", "3"]})
    producer = Producer(queue, engine, sampling=SamplingParams(max_new_tokens=4, n=2), producer_id="t", routing=True)
    assert producer.run_once(8) == 1
    directory = spool.spool_dir(queue.path)
    orphan = spool.write_tensor(directory, "orphan.routing", torch.ones(2, 3, 2, dtype=torch.uint8))
    rank0 = Rank0(queue, n=2)
    rank0._sweep_routing(producers_running=True)
    assert len(os.listdir(directory)) == 3  # young: perhaps a claim between its files and its transaction
    old = time.time() - 3600
    os.utime(os.path.join(directory, orphan["spool"]), (old, old))
    rank0._sweep_routing(producers_running=True)
    assert len(os.listdir(directory)) == 2 and "orphan.routing" not in os.listdir(directory)
    spool.write_tensor(directory, "orphan2.routing", torch.ones(1, 1, 1, dtype=torch.uint8))
    rank0._sweep_routing(producers_running=False)
    refs = queue.get(TRAIN, ["k@1.0_0", "k@1.0_1"], ["routed_experts"])["routed_experts"]
    assert sorted(os.listdir(directory)) == sorted(ref["spool"] for ref in refs)

    os.remove(os.path.join(directory, refs[0]["spool"]))
    with pytest.raises(FileNotFoundError, match=f"the queue references {directory}/{refs[0]['spool']}, which is gone"):
        rank0._read_routing(["k@1.0_0"])
    read = [spool.read_tensor(directory, refs[1], mapped=m) for m in (True, False)]  # a map, or read at once
    assert torch.equal(read[0], engine.given[("k@1.0", 1)]) and torch.equal(read[1], engine.given[("k@1.0", 1)])
