#!/usr/bin/env bash
# Builds the venv of the real SGLang server the tests start (`make sglang-env`): SGLang 0.5.23 with its
# pure-Python requirements beside the CPU torch 2.13.0, plus the environment shims of this folder.
# Never a dependency of the project's own venv. Usage: build.sh VENV_DIR [PYTHON]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$1"
py="${2:-python3.11}"
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0  # the release built against torch 2.13

command -v "$py" >/dev/null || { echo "sglang-env: need $py on PATH" >&2; exit 2; }
test -x "$venv/bin/python" || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"$venv/bin/python" -m pip install -q --upgrade pip
# torch first, from this machine's CPU wheel: anything later that asks for torch finds it satisfied.
"${pip[@]}" "torch==$TORCH_VERSION"
"${pip[@]}" -r "$here/requirements.txt" -c "$here/constraints.txt"
# --no-deps: torchvision and sglang pin CUDA builds (torch 2.14.1, sglang-kernel, flashinfer, nvidia-*).
"${pip[@]}" --no-deps "torchvision==$TORCHVISION_VERSION" "sglang==$SGLANG_VERSION"

site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$site/sgl_kernel"
cp -r "$here/sgl_kernel" "$site/sgl_kernel"
cp "$here/megatron_dapo_torchvision_schemas.py" "$here/megatron_dapo_torchvision_schemas.pth" "$site/"
cp "$here/megatron_dapo_host_alloc.py" "$here/megatron_dapo_host_alloc.pth" "$site/"

# The checks: the CPU torch survived every step, and the server's entry point imports (in a fresh
# interpreter with the .pth hook, as SGLang's spawned scheduler and detokenizer will be).
"$venv/bin/python" - "$TORCH_VERSION" "$SGLANG_VERSION" <<'PY'
import sys
import torch
want_torch, want_sglang = sys.argv[1], sys.argv[2]
if torch.__version__.split("+")[0] != want_torch or torch.version.cuda is not None:
    sys.exit(f"sglang-env: torch {torch.__version__} (cuda {torch.version.cuda}) replaced the CPU torch {want_torch}")
import sglang
if sglang.__version__ != want_sglang:
    sys.exit(f"sglang-env: sglang {sglang.__version__} installed, expected {want_sglang}")
import sglang.srt.entrypoints.http_server  # noqa: F401  (the module launch_server runs)
print(f"sglang-env: sglang {sglang.__version__}, torch {torch.__version__}")
PY
