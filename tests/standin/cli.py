"""The stand-in's command line: the emulated release's own `python -m sglang.launch_server` flags
(from its protocol JSON, so a flag that release lacks is an error: argparse exits with code 2 as
SGLang's does), plus a few stand-in flags.

Flags the stand-in acts on: --model-path, --host, --port, --tp-size (alias --tensor-parallel-size),
--dtype, --context-length, --enable-deterministic-inference, --enable-memory-saver,
--enable-weights-cpu-backup, --speculative-algorithm, --speculative-num-steps,
--speculative-num-draft-tokens, --speculative-draft-model-path. Every other flag of the release is accepted and reported in
/server_info, as SGLang does, without effect.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tests.standin.protocol import DEFAULT_VERSION, Protocol, available_versions

STANDIN_FLAGS = ("--emulate-version", "--toy", "--toy-vocab-size", "--max-lifetime-s", "--receive-timeout-s",
                 "--load-delay-s", "--forward-delay-s", "--draft-delay-s")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Protocol]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--emulate-version", default=DEFAULT_VERSION, choices=available_versions())
    known, _ = pre.parse_known_args(argv)
    proto = Protocol(known.emulate_version)

    ap = argparse.ArgumentParser(prog="python -m tests.standin.server",
                                 description=f"SGLang {proto.version} stand-in (tests only)")
    standin = ap.add_argument_group("stand-in (not SGLang flags)")
    standin.add_argument("--emulate-version", default=DEFAULT_VERSION, choices=available_versions(),
                         help="the SGLang release whose protocol to speak")
    standin.add_argument("--toy", action="store_true",
                         help="deterministic toy model instead of the HF model at --model-path")
    standin.add_argument("--toy-vocab-size", type=int, default=97)
    standin.add_argument("--max-lifetime-s", type=float, default=600.0,
                         help="exit by itself after this long (a test that forgets to stop it)")
    standin.add_argument("--receive-timeout-s", type=float, default=120.0,
                         help="timeout of weight-update group rendezvous and broadcasts")
    standin.add_argument("--load-delay-s", type=float, default=0.0,
                         help="wait this long before loading the model (/health answers 503 meanwhile)")
    standin.add_argument("--forward-delay-s", type=float, default=0.0,
                         help="emulated time of one target forward: the prefill, then every token (without "
                              "speculation) or every verify step (with it)")
    standin.add_argument("--draft-delay-s", type=float, default=0.0,
                         help="emulated time of one draft step; a verify step follows --speculative-num-steps "
                              "of them")
    interpreted = {"--port": int, "--tp-size": int, "--tensor-parallel-size": int, "--context-length": int,
                   "--speculative-num-steps": int, "--speculative-num-draft-tokens": int,
                   "--speculative-eagle-topk": int, "--mem-fraction-static": float, "--base-gpu-id": int}
    # --tp-size and its alias --tensor-parallel-size share one dest in every release layout
    dests = {"--tensor-parallel-size": "tp_size"}
    seen: set[str] = set()
    for flag, kind in proto.launch_flags.items():
        if flag in seen or not flag.startswith("--") or flag in STANDIN_FLAGS:
            continue
        seen.add(flag)
        kw: dict = {"dest": dests.get(flag, _dest(flag))}
        if kind == "switch":
            kw.update(action="store_true")
        elif kind == "values":
            kw.update(nargs="+")
        elif kind == "optional_value":
            kw.update(nargs="?")
        else:
            kw.update(type=interpreted.get(flag, str))
        if flag == "--model-path":
            kw["required"] = True
        ap.add_argument(flag, **kw)
    args = ap.parse_args(argv)
    args.host = args.host or "127.0.0.1"
    args.port = args.port or 30000
    args.tp_size = args.tp_size or 1
    args.dtype = args.dtype or "auto"
    for name in ("enable_deterministic_inference", "enable_memory_saver", "enable_weights_cpu_backup"):
        setattr(args, name, bool(getattr(args, name, False)))
    for name, default in (("speculative_algorithm", None), ("speculative_num_steps", None),
                          ("speculative_num_draft_tokens", None), ("speculative_draft_model_path", None),
                          ("context_length", None)):
        if not hasattr(args, name):
            setattr(args, name, default)
    if args.tp_size < 1:
        ap.error(f"--tp-size must be >= 1, got {args.tp_size}")
    return args, proto


def server_args_dict(args: argparse.Namespace) -> dict:
    """What /server_info reports of the launch: every flag's value (None / False when not given)."""
    out = {}
    for k, v in vars(args).items():
        if _dest("--" + k) in {_dest(f) for f in STANDIN_FLAGS}:
            continue
        out[k] = v
    return out
