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
    """probe(url, deep) answers what `replies[url]` holds; records (url, deep) per call."""

    def __init__(self):
        self.replies = {A: Probe(True, "0"), B: Probe(True, "0")}
        self.calls: list[str] = []
        self.deep: list[tuple[str, bool]] = []

    def __call__(self, url: str, deep: bool = True) -> Probe:
        self.calls.append(url)
        self.deep.append((url, deep))
        return self.replies[url]


class Control:
    """post(url, path, body): records every control call; `fail[url]` is the error text it answers."""

    def __init__(self):
        self.calls: list[tuple[str, str, object]] = []
        self.fail: dict[str, str] = {}

    def __call__(self, url, path, body):
        self.calls.append((url, path, body))
        return self.fail.get(url)

    def to(self, url):
        return [(path, body) for u, path, body in self.calls if u == url]


def _pool(script, *, version=0, restart=None, post=None, **kw) -> ServerPool:
    holder = {"v": version}
    pool = ServerPool([A, B], threading.Condition(), probe=script, expected_version=lambda: holder["v"],
                      restart=restart, post=post or Control(), **{"interval_s": 0.05, "down_timeout_s": 0.3, **kw})
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

    gate = threading.Event()

    def restart(url):
        restarted.append(url)
        done.set()
        gate.wait(5)  # the relaunch in progress

    pool = _pool(script, restart=restart)
    pool.mark_down(B, "killed")
    pool.mark_down(B, "killed again")  # already down: nothing more
    assert done.wait(5) and restarted == [B] and pool.state[B] == "restarting"
    gate.set()
    deadline = time.monotonic() + 5
    while pool.state[B] != "up" and time.monotonic() < deadline:  # the relaunch answers: back with version 0
        time.sleep(0.01)
    assert pool.state[B] == "up" and script.deep[-1] == (B, False)
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


# ------------------------------------------------------------------------------------ the state machine
# Each rule below is a call SGLang 0.5.23 would crash on (health.py's docstring cites the lines).

def test_paused_and_released_servers_get_no_generating_probe_and_their_failures_still_count():
    script, control = Script(), Control()
    pool = _pool(script, post=control)
    pool.pause("in_place")
    assert pool.state == {A: "paused", B: "paused"} and pool.up() == []
    pool.poll_once()
    assert script.deep == [(A, False), (B, False)]  # /model_info only: a paused scheduler cannot generate
    script.replies[A] = Probe(False, error="/model_info: HTTP 503")
    for _ in range(3):
        pool.poll_once()
    assert pool.state[A] == "down"  # a failure of a probe that runs no forward is a real one
    pool.resume_generation()
    assert control.to(B) == [("/pause_generation", {"mode": "in_place"}), ("/continue_generation", {})]
    assert control.to(A) == [("/pause_generation", {"mode": "in_place"})]  # a down server gets no continue
    fresh_control = Control()
    fresh = _pool(Script(), post=fresh_control)
    fresh.resume_generation()  # a restarted trainer: which servers are paused is unknown, so all get it
    assert [u for u, _, _ in fresh_control.calls] == [A, B]
    assert pool.state[B] == "up"
    pool.release(["weights", "kv_cache"])
    script.deep.clear()
    pool.poll_once()
    assert (B, False) in script.deep and pool.state[B] == "released"
    assert pool.released[B] == frozenset({"weights", "kv_cache"})


def test_a_release_waits_for_a_generating_probe_in_flight_and_later_probes_do_not_generate():
    """SGLang asserts the scheduler is idle in release_memory_occupation: a /health generation still
    running when the release arrives kills the server."""
    entered, go = threading.Event(), threading.Event()
    order: list[str] = []

    def probe(url, deep=True):
        if deep and url == A:
            entered.set()
            go.wait(5)
            order.append("probe returned")
        return Probe(True, "0")

    control = Control()
    pool = ServerPool([A, B], threading.Condition(), probe=probe, expected_version=lambda: 0, post=control)
    prober = threading.Thread(target=pool.check, args=(A,))
    prober.start()
    assert entered.wait(5)
    releaser = threading.Thread(target=lambda: (pool.release(None), order.append("released")))
    releaser.start()
    time.sleep(0.2)
    assert order == [] and control.calls == []  # nothing posted while the probe's generation runs
    assert pool.check(A) == Probe(True, "0")  # a probe started now reads /model_info only, and does not block
    go.set()
    prober.join(5)
    releaser.join(5)
    assert order == ["probe returned", "released"]
    assert [(u, p) for u, p, _ in control.calls] == [(A, "/release_memory_occupation"), (B, "/release_memory_occupation")]


def test_a_release_waits_for_generation_in_flight_and_admits_no_new_requests():
    busy = {A: True, B: False}
    control = Control()
    cond = threading.Condition()
    pool = ServerPool([A, B], cond, probe=Script(), expected_version=lambda: 0, post=control,
                      busy=lambda u: busy[u])
    t = threading.Thread(target=pool.release, args=(["kv_cache"],))
    t.start()
    time.sleep(0.2)
    assert control.calls == [] and pool.up() == []  # released from the decision on: nothing new is admitted
    with cond:
        busy[A] = False
        cond.notify_all()
    t.join(5)
    assert {u for u, _, _ in control.calls} == {A, B}


def test_a_resume_sends_each_server_only_the_tags_it_released():
    """SGLang removes each resumed tag from offload_tags: a tag not released is a KeyError that kills it."""
    control = Control()
    pool = _pool(Script(), post=control)
    pool.release(["weights", "kv_cache"])
    pool.resume(["weights"])
    pool.resume(["weights"])  # a second resume of the same tag: nothing to send
    pool.resume(["kv_cache", "cuda_graph"])  # cuda_graph was never released: not sent
    for url in (A, B):
        assert control.to(url) == [("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
                                   ("/resume_memory_occupation", {"tags": ["weights"]}),
                                   ("/resume_memory_occupation", {"tags": ["kv_cache"]})]
    assert pool.state == {A: "up", B: "up"}


def test_a_control_call_failing_on_one_server_marks_it_down_and_goes_on_failing_on_all_raises():
    control = Control()
    pool = _pool(Script(), post=control)
    control.fail[A] = "ConnectionError: refused"
    pool.release(None)
    assert pool.state == {A: "down", B: "released"}
    assert pool.last_error[A] == "/release_memory_occupation: ConnectionError: refused"
    pool.resume(None)  # the down server is not resumed
    assert [p for p, _ in control.to(A)] == ["/release_memory_occupation"]
    assert pool.state[B] == "up"
    control.fail[B] = "HTTP 400: bad"
    with pytest.raises(AllServersDown, match=r"pause_generation failed on every server: http://b/pause_generation: "
                                             r"HTTP 400: bad"):
        pool.pause("abort")


def test_a_colocated_server_dying_in_training_is_relaunched_at_the_next_resume_and_rejoins_through_a_release():
    """Relaunched at once, a colocated server would start on GPUs the actor holds at its training peak, then
    be resumed for tags it never released (KeyError). Here: relaunched when the rollout phase begins, and
    a relaunch answering while the others are released is released first."""
    script, control, restarted, gate = Script(), Control(), threading.Event(), threading.Event()
    pool = _pool(script, post=control, restart=lambda url: (restarted.set(), gate.wait(5)))
    pool.release(["weights", "kv_cache"])
    script.replies[B] = Probe(False, error="refused", refused=True)
    pool.poll_once()
    assert pool.state[B] == "down" and not restarted.wait(0.2)  # deferred: the actor trains
    assert [e.kind for e in pool.events] == ["down", "restart_deferred"]
    pool.resume(["weights"])  # the rollout phase begins: the relaunch starts, B gets no resume
    assert restarted.wait(5) and pool.state[B] == "restarting" and pool.released[B] == frozenset()
    assert [p for p, _ in control.to(B)] == ["/release_memory_occupation"]
    # A relaunch answering before the next resume while the others are released again is released at once.
    pool.resume(["kv_cache"])
    pool.release(["weights", "kv_cache"])
    script.replies[B] = Probe(True, "default")
    gate.set()  # the launcher's wait returns
    deadline = time.monotonic() + 5
    while pool.state[B] != "released" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.state[B] == "released" and pool.sync_targets() == [A, B]
    assert control.to(B)[-1] == ("/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    pool.resume(["weights"])
    pool.resume(["kv_cache"])
    assert control.to(B)[-2:] == [("/resume_memory_occupation", {"tags": ["weights"]}),
                                  ("/resume_memory_occupation", {"tags": ["kv_cache"]})]
    assert pool.state[B] == "stale"  # back up only after it reports the sync's version
    pool.version["v"] = 1
    script.replies[B] = Probe(True, "1")
    pool.confirm(B, 1)
    assert pool.state == {A: "up", B: "up"}


def test_a_disaggregated_server_is_relaunched_at_once():
    restarted, gate = threading.Event(), threading.Event()
    pool = _pool(Script(), restart=lambda url: (restarted.set(), gate.wait(5)))
    pool.mark_down(A, "killed")
    assert restarted.wait(5) and pool.state[A] == "restarting"
    gate.set()


def test_a_relaunch_still_loading_at_the_release_is_stopped_and_started_again_at_the_next_resume():
    """A relaunch that loads while the actor trains would take memory the actor holds at its peak."""
    calls, gate, stopped = [], threading.Event(), []

    def restart(url):
        calls.append(url)
        if len(calls) == 1:
            gate.wait(5)
            raise RuntimeError("exited before becoming healthy")  # what stop() makes of the launcher's wait

    control = Control()
    pool = _pool(Script(), post=control, restart=restart, stop=lambda url: (stopped.append(url), gate.set()))
    pool.mark_down(B, "killed")  # rollout phase: relaunched at once
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    pool.release(["weights", "kv_cache"])
    assert stopped == [B] and pool.state[B] == "down" and pool.last_error[B] == "relaunch stopped: the actor trains"
    assert [e.kind for e in pool.events][-1] == "restart_stopped"
    pool.resume(["weights"])
    while pool.state[B] != "up" and time.monotonic() < deadline:  # relaunched, answers with version 0
        time.sleep(0.01)
    assert calls == [B, B] and pool.state[B] == "up"
    assert [p for p, _ in control.to(B)] == []  # the relaunch was neither released nor resumed


def test_a_probe_from_before_a_server_came_back_does_not_take_it_down_again():
    """A poll round probes every server and applies the results together: B's refusal, taken while B was down,
    must not be applied after B was readmitted during the round (a slow generating probe of A held it open),
    or the healthy relaunch is marked down and stopped."""
    script = Script()
    pool = _pool(script, version=3)
    pool.mark_down(B, "killed")
    release_a = threading.Event()

    def probe(url, deep=True):
        if url == B:
            return Probe(False, error="ConnectionError: refused", refused=True)
        release_a.wait(5)  # A's generating probe is slow; meanwhile B comes back
        return Probe(True, "3")

    pool.probe = probe
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        round_ = threading.Thread(target=pool.poll_once, args=(ex,))
        round_.start()
        time.sleep(0.1)
        pool.mark_up(B, "answers again with weight version 3")  # the relaunch thread's own probe, or the sync
        release_a.set()
        round_.join(5)
    assert pool.state == {A: "up", B: "up"}
    assert [e.kind for e in pool.events if e.url == B].count("down") == 1
    pool.poll_once()  # a real refusal in a later round still takes it down
    assert pool.state[B] == "down"


def test_a_follower_takes_the_leaders_states_and_keeps_a_server_it_lost_down_until_the_leader_saw_it():
    """A follower pool (another process's engine, sglang/follower.py) is never polled: it takes the leader's
    states (a pause, a down server, a stale one) as they come; a server one of its own requests lost goes
    down at once, is reported (with the requests re-sent), and stays down through states from before the leader's failure."""
    leader, reported = _pool(Script()), []
    follower = _pool(Script(), report=lambda *report: reported.append(report))
    follower.follow(leader.leader_states())
    assert follower.state == {A: "up", B: "up"}
    leader.pause("in_place")
    follower.follow(leader.leader_states())
    assert follower.state == {A: "paused", B: "paused"} and not follower.up()
    leader.resume_generation()
    follower.follow(leader.leader_states())
    assert follower.up() == [A, B]
    follower.mark_down(B, "/generate: ConnectionError: refused")
    assert reported == [("down", B, "/generate: ConnectionError: refused")] and follower.up() == [A]
    follower.note_reissue(B, A, 2)
    assert reported[1] == ("reissue", B, A, 2)
    follower.follow(leader.leader_states())  # the leader has not seen it yet: B stays down here
    assert follower.state[B] == "down"
    leader.mark_down(B, "a producer's request: refused")  # what the follower's report does
    follower.follow(leader.leader_states())
    assert follower.state[B] == "down"
    leader.observe(B, Probe(True, "0"))  # back with the current weights
    follower.follow(leader.leader_states())
    assert follower.up() == [A, B]
    assert leader.take_counts()["failures"] == 1


def test_a_follower_with_no_server_up_in_the_leaders_states_raises_all_servers_down_after_the_timeout():
    leader, follower = _pool(Script()), _pool(Script())
    leader.mark_down(A, "gone")
    leader.mark_down(B, "gone")
    follower.follow(leader.leader_states())
    with follower.cond:
        follower.check_any_up()  # the clock starts
    time.sleep(0.35)
    with pytest.raises(AllServersDown, match="http://a"), follower.cond:
        follower.check_any_up()
