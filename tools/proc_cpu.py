"""Where a command's CPU goes, by the kind of process that spent it (Linux /proc).

    python tools/proc_cpu.py [--out FILE] [--top N] -- COMMAND ...

Runs COMMAND and, every 0.5 s until it ends, reads /proc/<pid>/stat and cmdline of every process started
after it (servers, torchrun ranks, the processes they spawn, orphans reparented away from it included),
keeping each one's latest user + system CPU. Then prints the CPU by kind (the script or module a Python
process runs, else the program) with the process count, writes every process to FILE (JSON: pid, ppid,
start, cmd, cpu_s), and ends with one JSON line: {"cpu_s": ..., "processes": ..., "wall_s": ..., "rc": ...}.

Why not the suite's own `cpu_s` (tests/conftest.py): a process is counted there only when a test waits
for it, so a killed server's scheduler, an orphan, or a helper that outlives its test lands on another test
or nowhere. A process living less than 0.5 s may be missed; one's CPU after its last sample is lost.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
_SCRIPT = re.compile(r"python[\d.]*\s+(?:-\S+\s+)*(\S+\.py)\b")
_MODULE = re.compile(r"python[\d.]*\s+(?:-\S+\s+)*-m\s+(\S+)")


def boot_ticks_now() -> float:
    """The current time in the units of /proc/<pid>/stat's start time (clock ticks since boot)."""
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * TICK


def sample(seen: dict, since_ticks: float, me: int) -> None:
    """Update `seen` ((pid, start) -> record) from /proc: every process started at or after `since_ticks`."""
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) is index 0
            start = int(fields[19])
            if start < since_ticks:
                continue
            key = (int(name), start)
            record = seen.get(key)
            if record is None or not record["cmd"]:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                record = seen.setdefault(key, {"pid": int(name), "ppid": int(fields[1]), "start": start / TICK,
                                               "cmd": cmd, "cpu_s": 0.0})
                record["cmd"] = record["cmd"] or cmd
            record["cpu_s"] = max(record["cpu_s"], (int(fields[11]) + int(fields[12])) / TICK)
        except (OSError, ValueError, IndexError):  # gone between listdir and read
            continue


def kind(cmd: str) -> str:
    """What a process runs: `-m module` or the script of a Python process, else its program's name."""
    if not cmd:
        return "(exited before its command line was read)"
    if m := _MODULE.search(cmd):
        return f"-m {m.group(1)}"
    if m := _SCRIPT.search(cmd):
        return m.group(1)
    if " -c " in cmd and "python" in cmd.split()[0]:
        return f"{os.path.basename(cmd.split()[0])} -c {cmd.split(' -c ', 1)[1][:40]!r}"
    return os.path.basename(cmd.split()[0])


def by_kind(records: list[dict]) -> list[tuple[str, float, int]]:
    cpu, count = collections.Counter(), collections.Counter()
    for r in records:
        k = kind(r["cmd"])
        cpu[k] += r["cpu_s"]
        count[k] += 1
    return [(k, round(s, 1), count[k]) for k, s in cpu.most_common()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write every process (JSON) here")
    parser.add_argument("--top", type=int, default=25, help="kinds to print (default 25)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command (put it after --)")
    seen: dict = {}
    since, t0 = boot_ticks_now() - 1, time.monotonic()  # a tick of slack: start times are whole ticks
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        sample(seen, since, os.getpid())
        time.sleep(args.interval)
    sample(seen, since, os.getpid())
    records = sorted(seen.values(), key=lambda r: r["start"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=0)
    total = round(sum(r["cpu_s"] for r in records), 1)
    print(f"{'cpu s':>9} {'procs':>6}  kind")
    for k, seconds, n in by_kind(records)[:args.top]:
        print(f"{seconds:9.1f} {n:6d}  {k}")
    print(json.dumps({"cpu_s": total, "processes": len(records), "wall_s": round(time.monotonic() - t0, 1),
                      "rc": proc.returncode}))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
