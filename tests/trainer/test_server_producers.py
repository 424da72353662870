"""The queue trainer's producer threads on SGLang (trainer/server_producers.py), on a real TransferQueue
and an in-process engine whose generate call the test releases: a drain waits for the running claim's
write and starts no claim until resume; a failed thread's error reaches check() and drain() by name;
close() aborts a blocked generation, writes nothing for it (its prompts stay running for the next
start's recovery) and ends the threads."""

import threading
import time

import pytest

from megatron_dapo.queue import TransferQueue
from megatron_dapo.rollout.base import Sample, SamplingParams, check_generate_inputs
from megatron_dapo.trainer.queue_trainer import TRAIN
from megatron_dapo.trainer.server_producers import ProducerError, ServerProducers

SAMPLING = SamplingParams(max_new_tokens=4, n=2, temperature=1.0)
WAIT_S = 10.0  # upper bound on any wait for a thread; the tests never sleep this long when they pass


class GatedEngine:
    """generate blocks until `gate` is set or abort() is called, then returns `n` samples per prompt:
    4 tokens finishing "length", or 1 token finishing "abort" after abort(). `error`: raised by generate
    once the gate opens. Records the prompt ids of each call and the threads that called."""

    def __init__(self, *, error: BaseException | None = None):
        self.gate, self.entered, self.aborted = threading.Event(), threading.Event(), threading.Event()
        self.error, self.calls, self.threads, self.aborts = error, [], [], 0

    def generate(self, prompts, sampling):
        check_generate_inputs(prompts, sampling)
        self.calls.append([p.prompt_id for p in prompts])
        self.threads.append(threading.current_thread())
        self.entered.set()
        while not (self.gate.wait(0.005) or self.aborted.is_set()):
            pass
        if self.error is not None and not self.aborted.is_set():
            raise self.error
        cut = self.aborted.is_set()
        length = 1 if cut else sampling.max_new_tokens
        return [Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids,
                       response_token_ids=(10 + j,) * length, rollout_log_probs=(-0.5,) * length,
                       finish_reason="abort" if cut else "length", policy_version=0)
                for p in prompts for j in range(sampling.n)]

    def abort(self):
        self.aborts += 1
        self.aborted.set()


def _put_prompts(q, keys, *, seed=7, step=1):
    q.put(TRAIN, keys, {"prompts": [[1, 2, i + 3] for i in range(len(keys))], "seed": [seed] * len(keys)},
          {"global_steps": step})


def _status(q, keys):
    return [t["status"] for t in q.get_tags(TRAIN, keys)]


def _wait_until(pred, timeout_s=WAIT_S):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return False


@pytest.fixture
def queue(tmp_path):
    q = TransferQueue(tmp_path / "q.sqlite")
    yield q
    q.close()


def _producers(queue, engine, *, num=1, claim_size=1):
    return ServerProducers(queue.path, engine, sampling=SAMPLING, num=num, claim_size=claim_size, poll_s=0.01)


def test_drain_returns_after_the_running_claim_is_written_and_no_claim_starts_until_resume(queue):
    engine = GatedEngine()
    _put_prompts(queue, ["a@1.0"])
    producers = _producers(queue, engine)
    producers.start()
    try:
        assert engine.entered.wait(WAIT_S)
        assert _status(queue, ["a@1.0"]) == ["running"]
        drained = threading.Event()
        drainer = threading.Thread(target=lambda: (producers.drain(), drained.set()))
        drainer.start()
        assert not drained.wait(0.2)  # the claim of a@1.0 is still generating: the drain waits for it
        _put_prompts(queue, ["b@1.0", "c@1.0"])  # arrive while draining: none may start
        engine.gate.set()
        drainer.join(WAIT_S)
        assert drained.is_set()
        # drained means written: the group of a@1.0 is complete and done when drain() returns
        assert _status(queue, ["a@1.0"]) == ["done"]
        assert queue.list_keys(TRAIN, is_prompt=False) == ["a@1.0_0", "a@1.0_1"]
        time.sleep(0.2)  # 20 poll intervals of an idle producer: still nothing claimed
        assert queue.list_keys(TRAIN, is_prompt=True, status="pending") == ["b@1.0", "c@1.0"]
        assert engine.calls == [["a@1.0"]]
        producers.resume()
        assert _wait_until(lambda: _status(queue, ["b@1.0", "c@1.0"]) == ["done", "done"])
        assert engine.calls == [["a@1.0"], ["b@1.0"], ["c@1.0"]]  # claim_size 1, oldest first
        producers.check()  # no thread failed
    finally:
        producers.close()


def test_a_failed_generate_reaches_check_and_drain_as_a_producer_error_naming_the_thread(queue):
    boom = RuntimeError("all SGLang servers down")
    engine = GatedEngine(error=boom)
    _put_prompts(queue, ["a@1.0"])
    producers = _producers(queue, engine)
    producers.start()
    try:
        engine.gate.set()

        def failed():
            try:
                producers.check()
            except ProducerError:
                return True
            return False

        assert _wait_until(failed)
        for call in (producers.check, producers.drain):
            with pytest.raises(ProducerError, match=r"^rollout producer thread 0 failed: RuntimeError: all SGLang "
                                                    r"servers down$") as err:
                call()
            assert err.value.__cause__ is boom
        assert engine.threads[0].name == "producer0"
        assert _wait_until(lambda: not engine.threads[0].is_alive())  # the failed thread stopped
        # its claim was never written: the prompt stays running for the next start's recovery
        assert _status(queue, ["a@1.0"]) == ["running"] and queue.count(TRAIN, is_prompt=False) == 0
    finally:
        producers.close()


def test_close_aborts_a_blocked_generation_writes_nothing_for_it_and_ends_the_threads(queue):
    engine = GatedEngine()  # the gate never opens: only the abort ends the call
    _put_prompts(queue, ["a@1.0", "b@1.0"])
    producers = _producers(queue, engine, num=2)
    producers.start()
    assert _wait_until(lambda: len(engine.calls) == 2)  # both threads inside generate, one prompt each
    producers.close(timeout_s=WAIT_S)
    assert engine.aborts == 1
    assert sorted(t.name for t in engine.threads) == ["producer0", "producer1"]
    assert not any(t.is_alive() for t in engine.threads)
    # the aborted samples came back after stop: no trajectory written, both claims still running
    assert _status(queue, ["a@1.0", "b@1.0"]) == ["running", "running"]
    assert queue.count(TRAIN, is_prompt=False) == 0
    producers.check()  # an abort at close is no failure


def test_a_drain_waiting_on_a_claim_that_fails_raises_its_error(queue):
    """The push after a drain must not start when the claim it waited for failed: the error is on record
    before the drain can see that claim end (40 repeats: the order is a race if it is not)."""
    for attempt in range(40):
        engine = GatedEngine(error=RuntimeError(f"bad reply {attempt}"))
        key = f"p{attempt}@1.0"
        _put_prompts(queue, [key])
        producers = _producers(queue, engine)
        producers.start()
        try:
            assert engine.entered.wait(WAIT_S)
            threading.Timer(0.01, engine.gate.set).start()
            with pytest.raises(ProducerError, match=rf"RuntimeError: bad reply {attempt}$"):
                producers.drain()
        finally:
            producers.close()
