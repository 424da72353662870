"""The wheels a GPU machine without network needs: download them here, check them there.

    python tools/gpu_wheels.py download [--dest .gpu-wheels]     # `make gpu-wheels`; needs PyPI
    python tools/gpu_wheels.py check [--dir .gpu-wheels]         # run by tests/gpu/run_all.sh
    python tools/gpu_wheels.py install --target DIR [--dir ...]  # there: pip install, no index, no deps
    python tools/gpu_wheels.py install --dry-run [--dir ...]     # here: would pip install them on 3.12?

The list is tests/gpu/wheels.txt, one `name==version` a line. `download` fetches exactly those, without
dependencies, built for CPython 3.12 on manylinux x86_64 (the GPU machine's Python), and removes any other
wheel from the folder. `check` needs only the standard library and `packaging`: every pin has exactly one
wheel and the folder holds nothing else, each wheel's tags fit CPython 3.12 on manylinux x86_64 (glibc up
to 2.39), each is a readable zip whose METADATA names the pinned version and admits Python 3.12, and the
folder fits the size budget (the device tool carries at most 64 MiB with the working tree). It prints one
JSON line, then exits 0, or 1 with one line per problem on stderr (2 on bad arguments). `install` runs
pip on the folder's wheels: into --target (put that on PYTHONPATH), or with --dry-run pip's own check that
they install on CPython 3.12, manylinux x86_64; it exits with pip's code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEEL_LIST = REPO / "tests" / "gpu" / "wheels.txt"
DEFAULT_DIR = REPO / ".gpu-wheels"
PYTHON_VERSION = (3, 12)
PYTHON = "3.12"  # the same, as pip's --python-version
MAX_GLIBC_MINOR = 39  # the GPU image's Python 3.12.3 is Ubuntu 24.04's, which has glibc 2.39
MAX_MIB = 48.0  # of the 64 MiB the device tool carries; the tracked tree takes about 4
# pip matches --platform tags exactly: every manylinux tag a glibc-2.39 x86_64 machine accepts.
PLATFORMS = ([f"manylinux_2_{m}_x86_64" for m in range(MAX_GLIBC_MINOR, 16, -1)]
             + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])


def read_pins(path: Path = WHEEL_LIST) -> dict[str, str]:
    """{canonical name: version} from `name==version` lines (comments and blank lines skipped)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or req.extras or req.marker:
            raise ValueError(f"{path.name}:{lineno}: expected one `name==version` pin, got {line!r}")
        name = canonicalize_name(req.name)
        if name in pins:
            raise ValueError(f"{path.name}:{lineno}: {req.name} is pinned twice")
        pins[name] = specs[0].version
    if not pins:
        raise ValueError(f"{path.name} pins no wheel")
    return pins


def device_tags() -> set:
    """The wheel tags CPython 3.12 accepts on manylinux x86_64 with glibc <= 2.39."""
    from packaging import tags

    abis = ["cp312", "abi3", "none"]
    return {*tags.cpython_tags(PYTHON_VERSION, abis=abis, platforms=PLATFORMS),
            *tags.compatible_tags(PYTHON_VERSION, interpreter="cp312", platforms=PLATFORMS)}


def _metadata(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        if len(names) != 1:
            raise ValueError(f"{len(names)} top-level .dist-info/METADATA files")
        headers = HeaderParser().parsestr(zf.read(names[0]).decode("utf-8"))
    return {k: headers.get(k, "") for k in ("Name", "Version", "Requires-Python")}


def check(wheel_dir: Path, pins: dict[str, str], *, max_mib: float = MAX_MIB) -> tuple[dict, list[str]]:
    """(a summary of the folder, the problems found: empty when the folder is ready to carry)."""
    from packaging.specifiers import SpecifierSet
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
    from packaging.version import Version

    problems: list[str] = []
    if not wheel_dir.is_dir():
        return {"dir": str(wheel_dir), "wheels": [], "total_mib": 0.0, "max_mib": max_mib}, [
            f"{wheel_dir} does not exist: run `make gpu-wheels` (needs PyPI) before carrying it"]
    files = sorted(p for p in wheel_dir.iterdir() if p.is_file())
    wheels, found = [], {}
    tags_ok = device_tags()
    for path in files:
        if path.suffix != ".whl":
            problems.append(f"{path.name}: not a wheel (the folder travels whole: remove it)")
            continue
        try:
            name, version, _build, wheel_tags = parse_wheel_filename(path.name)
        except InvalidWheelFilename as e:
            problems.append(f"{path.name}: {e}")
            continue
        found.setdefault(name, []).append(path.name)
        entry = {"file": path.name, "name": str(name), "version": str(version),
                 "mib": round(path.stat().st_size / 2**20, 2)}
        wheels.append(entry)
        if name not in pins:
            problems.append(f"{path.name}: {name} is not in {WHEEL_LIST.name} (remove it or pin it)")
        elif Version(pins[name]) != version:
            problems.append(f"{path.name}: version {version}, but {WHEEL_LIST.name} pins {name}=={pins[name]}")
        if not wheel_tags & tags_ok:
            problems.append(f"{path.name}: tags {sorted(map(str, wheel_tags))} do not install on CPython 3.12, "
                            f"manylinux x86_64 (glibc <= 2.{MAX_GLIBC_MINOR})")
        try:
            meta = _metadata(path)
        except (zipfile.BadZipFile, ValueError, UnicodeDecodeError) as e:
            problems.append(f"{path.name}: unreadable wheel ({e})")
            continue
        if canonicalize_name(meta["Name"]) != name or Version(meta["Version"]) != version:
            problems.append(f"{path.name}: METADATA says {meta['Name']} {meta['Version']}")
        if meta["Requires-Python"] and "3.12" not in SpecifierSet(meta["Requires-Python"]):
            problems.append(f"{path.name}: Requires-Python {meta['Requires-Python']} excludes 3.12")
    for name, names in found.items():
        if len(names) > 1:
            problems.append(f"{name}: {len(names)} wheels ({', '.join(names)}); pip refuses two versions of one package")
    for name, version in pins.items():
        if name not in found:
            problems.append(f"{name}=={version} is pinned but has no wheel in {wheel_dir}: run `make gpu-wheels`")
    size = sum(p.stat().st_size for p in files)
    total = round(size / 2**20, 2)
    if size > max_mib * 2**20:
        problems.append(f"the folder takes {total} MiB, over the {max_mib} MiB budget of the carried tree")
    return {"dir": str(wheel_dir), "wheels": wheels, "total_mib": total, "max_mib": max_mib}, problems


def download(dest: Path, pins: dict[str, str]) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           PYTHON, "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
           *(a for p in PLATFORMS for a in ("--platform", p)), "--dest", str(dest),
           *(f"{n}=={v}" for n, v in pins.items())]
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        print(f"pip download failed (exit {rc}); the list is {WHEEL_LIST}", file=sys.stderr)
        return rc
    summary, _ = check(dest, pins)
    for w in summary["wheels"]:  # an older pin's wheel would make two versions of one package
        if w["name"] not in pins or w["version"] != pins[w["name"]]:
            print(f"removing {w['file']} (not pinned in {WHEEL_LIST.name})")
            (dest / w["file"]).unlink()
    return 0


def install(wheel_dir: Path, *, target: Path | None) -> int:
    wheels = sorted(str(p) for p in wheel_dir.glob("*.whl"))
    if not wheels:
        print(f"no wheels in {wheel_dir}: run `make gpu-wheels`", file=sys.stderr)
        return 1
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check"]
    if target is None:  # pip decides, for the GPU machine's Python and platform, without installing
        cmd += ["--dry-run", "--ignore-installed", "--only-binary=:all:", "--python-version", PYTHON,
                "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p))]
    else:
        cmd += ["--upgrade", "--target", str(target)]
    return subprocess.run(cmd + wheels).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dl = sub.add_parser("download", help="fetch the pinned wheels (needs PyPI)")
    dl.add_argument("--dest", type=Path, default=DEFAULT_DIR)
    ck = sub.add_parser("check", help="the folder against the list; one JSON line")
    ck.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ck.add_argument("--max-mib", type=float, default=MAX_MIB)
    inst = sub.add_parser("install", help="pip install the folder's wheels (--target) or check they would")
    inst.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    where = inst.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", type=Path)
    where.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    try:
        pins = read_pins()
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.command == "install":
        return install(args.dir, target=args.target)
    if args.command == "download":
        rc = download(args.dest, pins)
        if rc:
            return rc
        args.dir, args.max_mib = args.dest, MAX_MIB
    summary, problems = check(args.dir, pins, max_mib=args.max_mib)
    print(json.dumps({**summary, "pins": pins, "ok": not problems}))
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
