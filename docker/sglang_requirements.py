"""Print what pip may install for SGLang on an NGC PyTorch image, after checking the image's torch fits.

    python docker/sglang_requirements.py > /tmp/sglang-requirements.txt      # in docker/Dockerfile
    python docker/sglang_requirements.py --metadata METADATA --torch 2.14.0a0  # a wheel's METADATA file

SGLang pins exact versions of torch, torchaudio and torchvision, the PyPI CUDA builds its kernels
(sglang-kernel, flashinfer) are compiled against. The NGC image has its own build of torch (a
pre-release of the same minor, e.g. 2.14.0a0+...), which Transformer Engine and NVIDIA apex in the image
are built for: pip must keep it. So SGLang's requirements are printed without those pins (and without
triton, which torch brings), after checking that the image's torch has the major.minor that SGLang
pins: a mismatch would load SGLang's kernels against the wrong torch ABI, so it stops the build
naming both versions. Requirements for other platforms or extras are dropped (their markers).
"""

from __future__ import annotations

import argparse
import sys
from email.parser import Parser
from importlib.metadata import requires, version

try:
    from packaging.requirements import Requirement
except ImportError:     # pip vendors the same module; no package is installed just for this script
    from pip._vendor.packaging.requirements import Requirement

IMAGE_BUILDS = frozenset({"torch", "torchaudio", "torchvision", "triton"})


def _minor(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def requirements_to_install(required: list[str], *, torch_version: str) -> list[str]:
    """SGLang's requirements (Requires-Dist lines) minus the image's builds, for this platform."""
    out = []
    for line in required:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name == "torch":
            pinned = [s.version for s in req.specifier if s.operator == "=="]
            if pinned and _minor(pinned[0]) != _minor(torch_version):
                raise SystemExit(f"sglang pins torch=={pinned[0]} but the base image has torch {torch_version}: "
                                 "choose BASE_IMAGE (an NGC release) whose torch has the same major.minor, or "
                                 "SGLANG_VERSION to match the image")
        if name in IMAGE_BUILDS:
            continue
        out.append(str(req))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metadata", help="a METADATA file (default: the installed sglang's)")
    parser.add_argument("--torch", help="the image's torch version (default: the installed torch's)")
    args = parser.parse_args(argv)
    if args.metadata:
        with open(args.metadata) as f:
            required = Parser().parse(f).get_all("Requires-Dist") or []
    else:
        required = requires("sglang") or []
    for line in requirements_to_install(required, torch_version=args.torch or version("torch")):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
