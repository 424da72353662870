"""An SGLang engine that follows another process's: the queue trainer's producer process
(trainer/server_producers.py) sends its generation requests through one, off the training process.

The leader (rank 0's engine, rollout/sglang/build.py) owns the servers' lifecycle: its pool probes them,
restarts those the trainer launched, pauses, releases, and pushes weights. A follower is built from what
the leader read at connect (`follower_spec`: no server is read again); it sends generation requests and
the abort of its own, and takes the leader's server states and weight version whenever they change
(`SGLangEngine.follow`, `ServerPool.follow`). A server whose connection fails under one of its requests it
takes out of its rotation at once and reports (`leader`), and the leader takes it down as if its own
request had failed (relaunching it when the trainer launched it); the requests it re-sends to another
server are reported too, so the leader's events and counters (the rollout/server_* metrics) hold both.
"""

from __future__ import annotations

from collections.abc import Callable


def follower_spec(engine) -> dict:
    """What a process needs to build a follower of `engine` (an SGLangEngine): picklable."""
    kwargs = {name: getattr(engine, name) for name in (
        "max_concurrency", "max_batch_size", "request_timeout_s", "connect_timeout_s", "control_timeout_s",
        "max_retries", "backoff_s", "max_backoff_s", "tp_size", "policy_version")}
    kwargs.update(open_weight_sessions=False, health_check_interval_s=engine.pool.interval_s,
                  server_down_timeout_s=engine.pool.down_timeout_s, return_routed_experts=engine.routing)
    return {"urls": list(engine.urls), "facts": engine.connect_facts(), "kwargs": kwargs}


def follower_engine(spec: dict, *, leader: Callable[..., None]):
    """The follower engine of `spec` (follower_spec); leader("down", url, error) / leader("reissue", url,
    survivor, requests): what its pool reports (ServerPool `report`)."""
    from megatron_dapo.rollout.sglang.engine import SGLangEngine

    return SGLangEngine(spec["urls"], facts=spec["facts"], leader=leader, **spec["kwargs"])


def leader_states(engine) -> tuple[dict, int]:
    """What a follower of `engine` takes (SGLangEngine.follow): the servers' states and the weight version."""
    return engine.pool.leader_states(), engine.policy_version
