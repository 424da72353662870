"""ServerPool (rollout/sglang/health.py): which servers take work, driven by a scripted probe (no server).
The real-server test of the whole path (a SIGKILLed server, re-issue, restart, re-sync) is
tests/sglang_real/test_server_death.py."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_dapo.rollout.sglang.health import AllServersDown, Probe, ServerPool

A, B = "http://a", "http://b"


class Script:
    """probe(url) answers what `replies[url]` holds; counts calls."""

    def __init__(self):
        self.replies = {A: Probe(True, "0"), B: Probe(True, "0")}
        self.calls: list[str] = []

    def __call__(self, url: str, deep: bool = True) -> Probe:
        self.calls.append(url)
        return self.replies[url]


def _pool(script, *, version=0, restart=None, **kw) -> ServerPool:
    holder = {"v": version}
    pool = ServerPool([A, B], threading.Condition(), probe=script, expected_version=lambda: holder["v"],
                      restart=restart, **{"interval_s": 0.05, "down_timeout_s": 0.3, **kw})
    pool.version = holder  # the test moves the engine's version through it
    return pool


def test_a_refused_connection_takes_a_server_down_at_once_and_a_failed_check_only_after_three():
    script = Script()
    pool = _pool(script)
    script.replies[A] = Probe(False, error="HTTP 503")
    pool.poll_once()
    pool.poll_once()
    assert pool.state[A] == "up"  # two failed checks in a row: still up
    script.replies[B] = Probe(False, error="ConnectionError: refused", refused=True)
    pool.poll_once()
    assert pool.state == {A: "down", B: "down"}
    assert pool.last_error == {A: "HTTP 503", B: "ConnectionError: refused"}
    assert pool.take_counts() == {"failures": 2, "reissued_requests": 0, "restarts": 0, "readmitted": 0, "up": 0}
    assert pool.take_counts()["failures"] == 0  # counts are per call


def test_while_generation_is_paused_failed_checks_do_not_count_but_a_refused_connection_does():
    """A paused server cannot answer /health (SGLang generates a token for it): a push into paused
    generation that outlasts three checks must not take the servers down."""
    script = Script()
    pool = _pool(script)
    pool.paused = True
    script.replies[A] = Probe(False, error="HTTP 503")
    for _ in range(5):
        pool.poll_once()
    assert pool.state[A] == "up"
    script.replies[B] = Probe(False, error="ConnectionError: refused", refused=True)
    pool.poll_once()
    assert pool.state == {A: "up", B: "down"}
    pool.paused = False
    for _ in range(3):
        pool.poll_once()
    assert pool.state[A] == "down"  # the count starts when the pause ends


def test_a_server_back_with_the_current_weights_is_readmitted_one_with_others_waits_for_the_sync():
    script = Script()
    pool = _pool(script, version=3)
    pool.mark_down(A, "gone")
    pool.mark_down(B, "gone")
    script.replies[A] = Probe(True, "3")  # answers again, with the weights the engine's servers hold
    script.replies[B] = Probe(True, "default")  # restarted: the checkpoint it was launched from
    pool.poll_once()
    assert pool.state == {A: "up", B: "stale"}
    assert pool.up() == [A] and pool.sync_targets() == [A, B]
    pool.poll_once()
    assert pool.state[B] == "stale"  # polling does not bring it back: only a sync does
    script.replies[B] = Probe(True, "4")
    pool.version["v"] = 4
    pool.confirm(B, 4)
    pool.confirm(A, 4)  # A missed the sync (still reports 3): out again
    assert pool.state == {A: "down", B: "up"}
    assert "reports weight version '3' after the sync of version 4" in pool.last_error[A]
    kinds = [(e.kind, e.url) for e in pool.events]
    assert kinds == [("down", A), ("down", B), ("readmitted", A), ("answering", B), ("readmitted", B), ("down", A)]


def test_a_launched_server_is_restarted_once_per_failure():
    script, restarted = Script(), []
    done = threading.Event()

    def restart(url):
        restarted.append(url)
        done.set()

    pool = _pool(script, restart=restart)
    pool.mark_down(B, "killed")
    pool.mark_down(B, "killed again")  # already down: nothing more
    assert done.wait(5) and restarted == [B]
    assert pool.take_counts()["restarts"] == 1


def test_a_failed_restart_keeps_the_server_down_with_the_reason():
    def restart(url):
        raise RuntimeError("no GPU")

    pool = _pool(Script(), restart=restart)
    pool.mark_down(A, "killed")
    deadline = time.monotonic() + 5
    while "restart failed" not in pool.last_error[A] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.state[A] == "down" and pool.last_error[A] == "restart failed: RuntimeError: no GPU"


def test_no_server_up_for_the_timeout_raises_all_servers_down_naming_each():
    pool = _pool(Script(), down_timeout_s=0.2)
    pool.mark_down(A, "refused")
    pool.mark_down(B, "refused too")
    t0 = time.monotonic()
    with pytest.raises(AllServersDown, match=r"for 0\.2 s .*http://a \(down: refused\); http://b \(down: refused too\)"):
        while True:
            with pool.cond:
                pool.check_any_up()
            time.sleep(0.01)
    assert 0.15 < time.monotonic() - t0 < 2


def test_a_sync_with_no_server_answering_waits_for_one_then_gives_up():
    script = Script()
    pool = _pool(script, down_timeout_s=0.3)
    pool.start()
    try:
        pool.mark_down(A, "gone")
        pool.mark_down(B, "gone")
        script.replies[A] = script.replies[B] = Probe(False, error="refused", refused=True)
        with pytest.raises(AllServersDown):
            pool.wait_for_targets()
        pool.mark_up(A, "test")
        script.replies[A] = Probe(True, "0")
        assert pool.wait_for_targets() == [A]
    finally:
        pool.stop()


def test_the_poller_takes_a_dead_server_out_and_back_in():
    script = Script()
    pool = _pool(script)
    pool.start()
    try:
        script.replies[B] = Probe(False, error="refused", refused=True)
        deadline = time.monotonic() + 5
        while pool.state[B] != "down" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.state[B] == "down"
        script.replies[B] = Probe(True, "0")
        while pool.state[B] != "up" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.state[B] == "up" and pool.state[A] == "up"
    finally:
        pool.stop()


def test_a_server_back_with_another_model_stays_down():
    script = Script()
    pool = ServerPool([A, B], threading.Condition(), probe=script, expected_version=lambda: 0, interval_s=0.05,
                      model=("qwen2", ("Qwen2ForCausalLM",)))
    pool.mark_down(B, "gone")
    script.replies[B] = Probe(True, "0", model=("llama", ("LlamaForCausalLM",)))
    pool.poll_once()
    pool.poll_once()
    assert pool.state[B] == "down" and pool.last_error[B].startswith("serves model ('llama'")
    assert [e.kind for e in pool.events] == ["down", "refused"]  # said once
    script.replies[B] = Probe(True, "0", model=("qwen2", ("Qwen2ForCausalLM",)))
    pool.poll_once()
    assert pool.state[B] == "up"
