"""Merge the steps of tests/gpu/run_all.sh into one JSON of figures.

    python tests/gpu/collect_figures.py --work DIR --mode gpu|dry --budget-s 480 --out gpu_figures.json

DIR holds `steps.tsv` (one line per step: name, status, exit code, start and end [epoch s], limit [s])
and each step's stdout as `<name>.out`. A measuring step's figure is the JSON object on the last line of
its stdout; the pytest step's is the count of each outcome in its `-v` lines, with the names of the tests
that failed or errored (read from the output, so a run stopped at its limit still reports what finished).
Every step has its key, null when it printed no figure, so the file always has the same keys.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
from pathlib import Path

STEPS = ("wheels", "install", "env", "ipc", "fused_vs_eager", "mfu", "pytest")
FIGURE_STEPS = ("wheels", "env", "ipc", "fused_vs_eager", "mfu", "pytest")
# A `pytest -v` result line, "<node id> PASSED  [ 12%]" or "<node id> SKIPPED (reason)  [ 12%]": node ids
# may hold spaces, so the first outcome word ends one; summary lines start with the outcome instead.
_WORDS = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
_OUTCOME = re.compile(rf"^(?!(?:{_WORDS}) )(\S.*?::.*?) ({_WORDS})\b.*\[ *\d+%\]$", re.M)


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def pytest_outcomes(text: str) -> dict | None:
    found = _OUTCOME.findall(text)
    if not found:
        return None
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error", "xfail", "xpass")}
    for _, outcome in found:
        counts[outcome.lower()] += 1
    bad = sorted({test for test, outcome in found if outcome in ("FAILED", "ERROR")})
    return {**counts, "total": len(found), "failed_tests": bad}


def _commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def collect(work: Path, *, mode: str, budget_s: float) -> dict:
    steps: dict[str, dict] = {}
    tsv = work / "steps.tsv"
    for line in (tsv.read_text().splitlines() if tsv.exists() else []):
        name, status, rc, start, end, limit = line.split("\t")
        steps[name] = {"status": status, "rc": int(rc) if rc else None,
                       "duration_s": round(float(end) - float(start), 3), "limit_s": int(limit)}
    for name in STEPS:
        steps.setdefault(name, {"status": "not run", "rc": None, "duration_s": 0.0, "limit_s": 0})
    figures: dict = {}
    for name in FIGURE_STEPS:
        out = work / f"{name}.out"
        text = out.read_text(errors="replace") if out.exists() else ""
        figures[name] = pytest_outcomes(text) if name == "pytest" else last_json(text)
    mfu, env = figures["mfu"], figures["env"]
    if mfu and env and env.get("matmul_tflops"):
        # MFU against the matrix rate measured on this machine, beside the datasheet's
        mfu["mfu_of_measured_matmul"] = mfu["flops_per_token"] * mfu["tokens_per_s"] / (env["matmul_tflops"] * 1e12)
    repo = Path(__file__).resolve().parent.parent.parent
    return {"mode": mode, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": _commit(repo), "budget_s": budget_s,
            "total_s": round(sum(s["duration_s"] for s in steps.values()), 3),
            "ok": all(s["status"] == "ok" for s in steps.values()), "steps": steps, **figures}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--mode", choices=("gpu", "dry"), required=True)
    p.add_argument("--budget-s", type=float, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    result = collect(args.work, mode=args.mode, budget_s=args.budget_s)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    width = max(map(len, STEPS))
    for name, s in result["steps"].items():
        print(f"{name:{width}s}  {s['status']:8s} {s['duration_s']:7.1f} s (limit {s['limit_s']} s)")
    print(f"{'total':{width}s}  {'ok' if result['ok'] else 'FAILED':8s} {result['total_s']:7.1f} s "
          f"(budget {args.budget_s:.0f} s) -> {args.out}")


if __name__ == "__main__":
    main()
