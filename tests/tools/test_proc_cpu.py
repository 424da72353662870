"""tools/proc_cpu.py: a command's CPU by process kind, read from /proc, children and grandchildren included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BURN = """
import subprocess, sys, time
if sys.argv[1] == "parent":  # a grandchild that burns 0.6 s of CPU, then lives on past a sample
    subprocess.run([sys.executable, __file__, "child"], check=True)
else:
    while time.process_time() < 0.6:
        pass
    time.sleep(1.5)
"""


def test_the_cpu_of_a_grandchild_is_found_and_named_by_its_script(tmp_path):
    script = tmp_path / "burn_cpu.py"
    script.write_text(BURN)
    out = tmp_path / "procs.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools/proc_cpu.py"), "--out", str(out), "--",
                           sys.executable, str(script), "parent"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rc"] == 0 and summary["processes"] >= 2 and summary["wall_s"] >= 1.5
    records = json.loads(out.read_text())
    burners = [r for r in records if r["cmd"].endswith("burn_cpu.py child")]
    assert len(burners) == 1 and 0.55 <= burners[0]["cpu_s"] < 5, burners
    parent = next(r for r in records if r["cmd"].endswith("burn_cpu.py parent"))
    assert burners[0]["ppid"] == parent["pid"]
    assert summary["cpu_s"] >= burners[0]["cpu_s"]
    assert any(line.split()[-1] == str(script) and int(line.split()[1]) == 2 for line in proc.stdout.splitlines()
               if line.strip().endswith("burn_cpu.py")), proc.stdout


def test_a_process_kind_is_its_module_or_script():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from proc_cpu import kind
    finally:
        sys.path.pop(0)
    assert kind("/v/bin/python -u -m megatron_dapo.train --config c.yaml") == "-m megatron_dapo.train"
    assert kind("/v/bin/python -B -Wignore /repo/tests/trainer/_fault_run.py /tmp/x a=b") == \
        "/repo/tests/trainer/_fault_run.py"
    assert kind("/usr/bin/ray start --head") == "ray"
    assert kind("") == "(exited before its command line was read)"
