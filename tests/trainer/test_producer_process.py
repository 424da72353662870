"""The queue trainer's SGLang producers in their own process (trainer/server_producers.ProducerProcess),
against two SGLang stand-ins (their own processes, SGLang 0.5.23's protocol) and a real TransferQueue:

- every claim is generated, written and equal to what rank 0's engine generates for the same prompts and
  seeds, while rank 0's engine sends no generation request (the client work is off the training process);
- a drain returns with every claim written and starts none until resume;
- a SIGKILLed process is restarted by check(), its running claims reissued first, each prompt written once;
- a server lost under one of the process's requests is taken down in rank 0's pool (which owns restarts),
  with the requests re-sent to the survivor;
- a failed producer thread reaches check() by name, and close() stops the process;
- a process prestarted before the engine existed runs once given its spec; one never given it stops at close.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_dapo.rollout.base import PromptInput, SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.trainer.queue_trainer import TRAIN
from megatron_dapo.trainer.server_producers import ProducerError, ProducerProcess, prestart
from tests.standin import StandinServer
from tests.trainer.test_server_producers import _put_prompts, _status
from tests.trainer.test_server_producers import _wait_until as wait_until

SAMPLING = SamplingParams(max_new_tokens=6, n=2, temperature=1.0)
ARGS = ["--enable-deterministic-inference"]
WAIT_S = 60.0  # the process starts in a few seconds; a bound, never slept


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("standin")
    with StandinServer(toy=True, args=ARGS, log_dir=log_dir) as a, \
            StandinServer(toy=True, args=ARGS, log_dir=log_dir) as b:
        yield a, b


@pytest.fixture
def servers(pair):
    for s in pair:
        if s.is_running():
            s.reset()
    return pair


def _put(queue, keys, *, step=1):
    _put_prompts(queue, keys, seed=11, step=step)


def _wait_until(pred, timeout_s=WAIT_S):  # the process takes seconds to start: a longer bound
    return wait_until(pred, timeout_s)


def _process(queue, engine, *, num=2, claim_size=2, step=1, prestarted=None):
    return ProducerProcess(queue, engine, sampling=SAMPLING, num=num, claim_size=claim_size,
                           global_steps=lambda: step, poll_s=0.01, prestarted=prestarted)


@pytest.mark.parametrize("early", [False, True], ids=["spawned-at-start", "prestarted"])
def test_the_process_writes_every_claim_as_rank_0s_engine_would_generate_it_and_rank_0_sends_none(
        servers, queue, early):
    """prestarted: the process spawned before the engine existed (as build_trainer does, beside the model's
    build) is the one that runs once given its spec."""
    a, b = servers
    keys = [f"k{i}@1.0" for i in range(6)]
    _put(queue, keys)
    pre = prestart(None) if early else None
    with SGLangEngine([a.url, b.url]) as engine:
        producers = _process(queue, engine, prestarted=pre)
        producers.start()
        try:
            assert _wait_until(lambda: _status(queue, keys) == ["done"] * 6)
            producers.check()
            # rank 0's engine started no request thread: every /generate came from the producer process
            assert engine._pool._threads == set() and producers.process.pid != os.getpid()
            assert pre is None or producers.process is pre.process
        finally:
            producers.close()
        assert producers.process is None
        served = len(a.requests("/generate")) + len(b.requests("/generate"))
        assert served == 3 and a.requests("/generate") and b.requests("/generate")  # claims of 2 over both
        rows = queue.get(TRAIN, [f"{k}_{j}" for k in keys for j in range(2)], ["responses", "rollout_log_probs"])
        want = engine.generate([PromptInput(k, (1, 2, 3 + i)) for i, k in enumerate(keys)],
                               SamplingParams(**{**SAMPLING.__dict__, "seed": 11}))
    assert [r.tolist() for r in rows["responses"]] == [list(s.response_token_ids) for s in want]
    assert [v for r in rows["rollout_log_probs"] for v in r.tolist()] == pytest.approx(
        [v for s in want for v in s.rollout_log_probs], abs=1e-6)  # stored as float32


def test_a_drain_returns_with_every_claim_written_and_none_starts_until_resume(servers, queue):
    a, b = servers
    for s in servers:
        s.knobs(token_delay_s=0.05)  # a claim generates for ~0.3 s: the drain has one to wait for
    first = [f"a{i}@1.0" for i in range(4)]
    _put(queue, first)
    with SGLangEngine([a.url, b.url]) as engine:
        producers = _process(queue, engine)
        producers.start()
        try:
            assert _wait_until(lambda: "running" in _status(queue, first))
            producers.drain()
            assert "running" not in _status(queue, queue.list_keys(TRAIN, is_prompt=True))
            done = queue.list_keys(TRAIN, is_prompt=True, status="done")
            assert set(done) <= set(first) and done
            later = [f"b{i}@1.0" for i in range(2)]
            _put(queue, later)
            time.sleep(0.3)  # 30 poll intervals of an idle producer: nothing claimed while drained
            assert set(_status(queue, later)) == {"pending"}
            producers.resume()
            assert _wait_until(lambda: _status(queue, first + later) == ["done"] * 6)
            producers.check()
        finally:
            producers.close()
            for s in servers:
                s.knobs(token_delay_s=0.0)


def test_a_killed_process_is_restarted_by_check_after_its_running_claims_are_reissued(servers, queue):
    a, b = servers
    for s in servers:
        s.knobs(token_delay_s=0.05)
    keys = [f"c{i}@1.0" for i in range(6)]
    _put(queue, keys)
    with SGLangEngine([a.url, b.url]) as engine:
        producers = _process(queue, engine, step=4)
        producers.start()
        try:
            assert _wait_until(lambda: "running" in _status(queue, keys))
            victim = producers.process.pid
            os.kill(victim, signal.SIGKILL)
            producers.process.join(WAIT_S)
            running = queue.list_keys(TRAIN, is_prompt=True, status="running")
            assert running  # claimed by the dead process, never written
            producers.check()  # reissues them (pending, tagged with the trainer's step) and restarts it
            assert producers.restarts == 1 and producers.process.pid != victim
            tags = dict(zip(running, queue.get_tags(TRAIN, running), strict=True))
            assert all(t["status"] in ("pending", "running", "done") and t["global_steps"] == 4 for t in tags.values())
            for s in servers:
                s.knobs(token_delay_s=0.0)
            assert _wait_until(lambda: _status(queue, keys) == ["done"] * 6)
            assert queue.count(TRAIN, is_prompt=False) == 12  # each prompt's group written once
            producers.check()
        finally:
            producers.close()
            for s in servers:
                s.knobs(token_delay_s=0.0)


def test_a_server_lost_under_a_producers_request_goes_down_in_rank_0s_pool(servers, queue, tmp_path):
    a, _ = servers
    doomed = StandinServer(toy=True, args=ARGS, log_dir=tmp_path).start()
    keys = [f"d{i}@1.0" for i in range(8)]
    try:
        # rank 0's own poller never runs in this test: only the producer's report can take the server down
        with SGLangEngine([a.url, doomed.url], health_check_interval_s=3600.0) as engine:
            doomed.knobs(token_delay_s=0.2)
            producers = _process(queue, engine, claim_size=1)
            _put(queue, keys)
            producers.start()
            try:
                assert _wait_until(lambda: doomed.stats()["generate_inflight"] > 0)
                doomed.kill()
                assert _wait_until(lambda: engine.pool.state[doomed.url] == "down")
                assert "a producer's request" in engine.pool.last_error[doomed.url]
                assert _wait_until(lambda: _status(queue, keys) == ["done"] * 8)  # re-sent to the survivor
                # rank 0's pool holds the process's story of the server: down, its requests re-sent
                kinds = [(e.kind, e.url) for e in engine.pool.events]
                assert kinds[0] == ("down", doomed.url) and ("reissue", doomed.url) in kinds, kinds
                assert engine.pool.take_counts()["reissued_requests"] >= 1
                producers.check()
            finally:
                producers.close()
    finally:
        doomed.stop()


def test_a_failed_producer_thread_reaches_check_by_name(servers, queue):
    a, b = servers
    _put(queue, ["e@1.0"])
    queue.put_fields(TRAIN, ["e@1.0"], {"prompts": [[1, 2, 500]]})  # outside the toy model's 97-token vocabulary
    with SGLangEngine([a.url, b.url]) as engine:
        producers = _process(queue, engine, num=1)
        producers.start()
        try:
            def failed():
                try:
                    producers.check()
                except ProducerError:
                    return True
                return False

            assert _wait_until(failed)
            with pytest.raises(ProducerError, match=r"^rollout producer thread 0 failed: EngineRequestError: .*HTTP 4"):
                producers.check()
            assert _status(queue, ["e@1.0"]) == ["running"]  # never written: reissued by the next start
        finally:
            producers.close()


def test_a_prestarted_process_never_given_its_spec_stops_at_close_and_one_that_died_is_replaced(servers, queue):
    """The run failed or ended before the producers started: close() stops the waiting process. A prestarted
    process that died before its start (e.g. its reward stage failed to build) is not reused: the start
    spawns a fresh one, which runs."""
    pre = prestart(None)
    pre.close()
    assert pre.process.exitcode == 0
    dead = prestart(None)
    dead.process.kill()
    dead.process.join()
    keys = [f"d{i}@1.0" for i in range(2)]
    _put(queue, keys)
    with SGLangEngine([s.url for s in servers]) as engine:
        producers = _process(queue, engine, prestarted=dead)
        producers.start()
        try:
            assert producers.process is not dead.process
            assert _wait_until(lambda: _status(queue, keys) == ["done"] * 2)
            producers.check()
        finally:
            producers.close()
