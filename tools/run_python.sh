#!/usr/bin/env bash
# The Python of the make targets that work on a run's model or data (eval-aime, data, tensorboard), printed:
# the project's venv ($1/bin/python) when it exists, else `python` on PATH when it already has megatron_dapo
# installed (the cluster image, docker/Dockerfile), else nothing (the caller then builds the venv with
# `make install`). Checked from / so that the repository's own source tree does not count as installed.
venv_python="$1/bin/python"
if [[ -x "$venv_python" ]]; then
    echo "$venv_python"
elif (cd / && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('megatron_dapo') is None)") \
        >/dev/null 2>&1; then
    command -v python
fi
