"""`python -m sglang.launch_server` that starts the stand-in (tests/standin/server.py), for tests in which the
trainer launches, kills and relaunches its own servers through its real launch path: put this folder first
on the servers' PYTHONPATH (rollout.server_env) and point rollout.sglang_python at this venv's Python. Never on
the trainer's own path."""
