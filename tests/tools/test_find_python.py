"""tools/find_python.sh (what `make install` runs unless PY is given): the first Python >= 3.11 on PATH,
3.11 preferred, or exit 2 saying what was found."""

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _fake(directory: pathlib.Path, name: str, version: str) -> None:
    path = directory / name
    path.write_text(f"#!/bin/bash\necho {version}\n")  # answers the script's version query
    path.chmod(0o755)


def _find(tmp_path, *pythons):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, version in pythons:
        _fake(bin_dir, name, version)
    return subprocess.run(["/bin/bash", str(ROOT / "tools/find_python.sh")], capture_output=True, text=True,
                          env={"PATH": f"{bin_dir}:/nonexistent"})


def test_3_11_is_preferred_then_any_newer_one(tmp_path):
    r = _find(tmp_path, ("python3.12", "3.12"), ("python3.11", "3.11"), ("python3", "3.10"))
    assert r.returncode == 0 and r.stdout.strip() == str(tmp_path / "bin/python3.11")


def test_a_newer_python_when_there_is_no_3_11(tmp_path):
    r = _find(tmp_path, ("python3", "3.13"), ("python3.12", "3.12"))
    assert r.returncode == 0 and r.stdout.strip() == str(tmp_path / "bin/python3.12")


def test_none_new_enough_exits_2_naming_what_was_found(tmp_path):
    r = _find(tmp_path, ("python3", "3.10"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("need Python 3.11 or newer on PATH (found: python3 (3.10)); pass one with "
                                "PY=/path/to/python3.11")
