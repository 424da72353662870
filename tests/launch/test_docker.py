"""docker/Dockerfile cannot be built here (no registry for the NGC base image), so: it parses as a
Dockerfile, its shell steps parse with bash -n, what it copies exists, every package it installs is
named in pyproject.toml or the README / docs, the SGLang requirement filter keeps the image's torch and refuses
a torch of another minor, and `make docker` builds it."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "CMD", "ENTRYPOINT", "LABEL", "USER",
                "EXPOSE", "VOLUME", "SHELL", "HEALTHCHECK", "STOPSIGNAL", "ONBUILD"}


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped, as docker reads it."""
    out, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):       # comment lines inside a continuation
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        word, _, rest = current.strip().partition(" ")
        out.append((word, rest.strip()))
        current = ""
    assert not current, f"dangling continuation: {current!r}"
    return out


STEPS = _instructions(DOCKERFILE.read_text())


def test_dockerfile_parses_on_an_ngc_pytorch_base():
    assert all(word in INSTRUCTIONS for word, _ in STEPS), [w for w, _ in STEPS if w not in INSTRUCTIONS]
    words = [w for w, _ in STEPS]
    first = next(i for i, w in enumerate(words) if w != "ARG")
    assert words[first] == "FROM" and words.count("FROM") == 1
    args = dict(a.split("=", 1) for w, a in STEPS[:first] if w == "ARG")
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", args["BASE_IMAGE"])
    assert STEPS[first][1] == "${BASE_IMAGE}"
    assert any(w == "ARG" and a.startswith("SGLANG_VERSION=") for w, a in STEPS)
    cmd = next(a for w, a in STEPS if w == "CMD")
    assert json.loads(cmd) == ["bash"]


def test_copied_files_exist_and_the_context_skips_environments():
    for word, args in STEPS:
        if word == "COPY":
            *sources, _ = shlex.split(args)
            assert all((REPO / s).exists() for s in sources), sources
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert {".venv", ".venv-*", "runs", "models", ".git"} <= set(ignored)


def _run_scripts() -> list[str]:
    return [args for word, args in STEPS if word == "RUN"]


def test_every_run_step_parses_as_bash():
    for script in _run_scripts():
        proc = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
        assert proc.returncode == 0, (script, proc.stderr)


def _pip_installs() -> list[list[str]]:
    """The arguments of every `pip install` in the RUN steps."""
    out = []
    for script in _run_scripts():
        lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token in (";", "&&", "||", "|"):
                if command[:2] == ["pip", "install"]:
                    out.append(command[2:])
                command = []
            else:
                command.append(token)
    return out


def _named_packages() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [s for extra in project["optional-dependencies"].values() for s in extra]
    return {re.split(r"[<>=!~\[ ;]", s, maxsplit=1)[0].lower() for s in specs}


def test_every_installed_package_is_named_in_pyproject_or_the_readme():
    named = _named_packages()
    readme = " ".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]).lower()
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    installs = _pip_installs()
    assert installs, "the Dockerfile installs nothing"
    seen = set()
    for args in installs:
        words = iter(args)
        for word in words:
            if word == "-r":             # a requirements file: only the SGLang filter's output
                assert next(words) == "/tmp/sglang-requirements.txt"
                seen.add("<sglang requirements>")
            elif word == "-e" or word.startswith("--"):
                continue
            elif word.startswith("."):   # this project, with extras it declares
                extra = re.fullmatch(r"\.(?:\[([a-z,]+)\])?", word)
                assert extra and set((extra.group(1) or "").split(",")) - {""} <= extras, word
                seen.add("megatron-dapo")
            else:
                name = re.split(r"[<>=!~\[ ]", word, maxsplit=1)[0].lower()
                assert name in named or name in readme, f"{name}: installed by the Dockerfile, named nowhere"
                seen.add(name)
    assert {"sglang", "megatron-dapo", "<sglang requirements>"} <= seen
    filter_step = next(s for s in _run_scripts() if "/tmp/sglang-requirements.txt" in s)
    assert "sglang_requirements.py > /tmp/sglang-requirements.txt" in filter_step


def _filter_module():
    spec = importlib.util.spec_from_file_location("sglang_requirements", REPO / "docker" / "sglang_requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Requires-Dist lines as sglang 0.5.23's wheel states them (a sample).
SGLANG_REQUIRES = [
    "torch==2.14.1", "torchaudio==2.11.0", "torchvision", "triton", "transformers==5.19.0",
    "flashinfer_python[cu13]==0.7.2", "sglang-kernel==0.4.10",
    'av==16.1.0; sys_platform == "linux" and (platform_machine == "aarch64" or platform_machine == "arm64")',
    'checkpoint-engine==0.1.2; extra == "checkpoint-engine"',
]


def test_sglang_filter_keeps_the_images_torch_and_drops_other_platforms():
    kept = _filter_module().requirements_to_install(SGLANG_REQUIRES, torch_version="2.14.0a0+e4b5d2c")
    # x86-64 Linux: the aarch64-only `av` pin and the checkpoint-engine extra are not for this image.
    assert kept == ["transformers==5.19.0", "flashinfer_python[cu13]==0.7.2", "sglang-kernel==0.4.10"]


def test_sglang_filter_refuses_a_torch_of_another_minor():
    with pytest.raises(SystemExit, match=r"sglang pins torch==2\.14\.1 but the base image has torch 2\.10\.0a0"):
        _filter_module().requirements_to_install(SGLANG_REQUIRES, torch_version="2.10.0a0+b4e4ee81d3")


def test_sglang_filter_script_reads_a_wheels_metadata(tmp_path):
    metadata = tmp_path / "METADATA"
    metadata.write_text("Metadata-Version: 2.4\nName: sglang\nVersion: 0.5.23\n"
                        + "".join(f"Requires-Dist: {line}\n" for line in SGLANG_REQUIRES))
    script = [sys.executable, str(REPO / "docker" / "sglang_requirements.py"), "--metadata", str(metadata)]
    ok = subprocess.run([*script, "--torch", "2.14.0a0"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.splitlines() == [
        "transformers==5.19.0", "flashinfer_python[cu13]==0.7.2", "sglang-kernel==0.4.10"]
    bad = subprocess.run([*script, "--torch", "2.13.0"], capture_output=True, text=True)
    assert bad.returncode == 1 and "choose BASE_IMAGE" in bad.stderr


def test_make_docker_builds_the_dockerfile_with_the_chosen_base():
    out = subprocess.run(["make", "--no-print-directory", "-n", "docker", "BASE_IMAGE=nvcr.io/nvidia/pytorch:26.10-py3",
                          "SGLANG_VERSION=0.5.22", "IMAGE=reg/megatron-dapo:t"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    words = shlex.split(out.replace("\\\n", " "))
    assert words[:4] == ["docker", "build", "-f", "docker/Dockerfile"] and words[-1] == "."
    assert "BASE_IMAGE=nvcr.io/nvidia/pytorch:26.10-py3" in words and "SGLANG_VERSION=0.5.22" in words
    assert words[words.index("-t") + 1] == "reg/megatron-dapo:t"
    default = shlex.split(subprocess.run(["make", "--no-print-directory", "-n", "docker"], cwd=REPO, capture_output=True, text=True,
                                         check=True).stdout.replace("\\\n", " "))
    assert "--build-arg" not in default and default[default.index("-t") + 1] == "megatron-dapo:latest"
