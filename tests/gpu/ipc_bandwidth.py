"""Bandwidth of the colocated weight transport: buckets of bf16 tensors serialised in this process
(`rollout.sglang.weights.serialize_named_tensors`: CUDA IPC handles) and rebuilt in a second process on
the same GPU, as an SGLang server does on /update_weights_from_tensor.

    python tests/gpu/ipc_bandwidth.py [--bucket-mb 512] [--total-mb 4096] [--passes 3]
    python tests/gpu/ipc_bandwidth.py --tiny     # CPU tensors through shared memory (checks the script)

The receiver is a fresh Python process (`--receive`), not a multiprocessing child, as the server is. Per
bucket the sender serialises the bucket (timed) and writes the base64 text to the receiver's stdin; the
receiver decodes and unpickles it (opening the IPC handles), copies every tensor into its own preallocated
weights (param.data.copy_, as a server's weight loader does), synchronises, and replies with its timings
and the checksums of what it copied. A bucket's time is the sender's wall clock from the start of the
serialisation to the reply, less the receiver's checksum time; GB/s = bucket bytes / that time, the
median over every bucket of every pass. A tensor's checksum is the int64 sum of its 16-bit patterns, and
every name's must equal the sender's.

Tensors are [4096, 4096] bf16 (32 MiB: a 7B model's attention projection), grouped by the trainer's own
`bucket_named_tensors` into buckets of --bucket-mb (the default of rollout.weight_sync_bucket_mb). The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler

import torch

# Registers the tensor reducers (CUDA IPC, shared memory) with ForkingPickler, in the receiver too.
import torch.multiprocessing  # noqa: F401

SIDE = 4096
TINY = dict(side=256, bucket_mb=0.25, total_mb=1.0, passes=2)


def checksum(t: torch.Tensor) -> int:
    """Exact and independent of summation order: the int64 sum of the 16-bit patterns."""
    return int(t.view(torch.int16).sum(dtype=torch.int64))


def receive() -> None:
    """The receiver: one `setup` JSON line (device, names and shapes), then one base64 bucket a line."""
    setup = json.loads(sys.stdin.readline())
    device = torch.device(setup["device"])
    weights = {name: torch.empty(shape, dtype=torch.bfloat16, device=device) for name, shape in setup["shapes"]}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        named = ForkingPickler.loads(base64.b64decode(line.strip(), validate=True))
        t1 = time.perf_counter()
        for name, tensor in named:
            weights[name].copy_(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        names = [name for name, _ in named]
        del named, tensor  # drop the sender's memory, as the server does once a bucket is loaded
        sums = {name: checksum(weights[name]) for name in names}
        t3 = time.perf_counter()
        print(json.dumps({"open_s": t1 - t0, "copy_s": t2 - t1, "checksum_s": t3 - t2, "checksums": sums}),
              flush=True)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def send(device: torch.device, *, side: int, bucket_mb: float, total_mb: float, passes: int) -> dict:
    from megatron_dapo.rollout.sglang.weights import MIB, bucket_named_tensors, serialize_named_tensors

    count = max(1, int(total_mb * MIB) // (side * side * 2))
    gen = torch.Generator(device=device).manual_seed(0)
    named = [(f"layers.{i}.weight", torch.randn(side, side, generator=gen, device=device).to(torch.bfloat16))
             for i in range(count)]
    want = {name: checksum(t) for name, t in named}
    buckets = list(bucket_named_tensors(named, bucket_bytes=max(1, int(bucket_mb * MIB))))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    receiver = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--receive"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=repo)

    def ask(line: str) -> dict:
        receiver.stdin.write(line + "\n")
        receiver.stdin.flush()
        reply = receiver.stdout.readline()
        if not reply:
            raise RuntimeError(f"the receiver exited (code {receiver.wait()}); its error is above")
        return json.loads(reply)

    rows, mismatched = [], set()
    try:
        ask(json.dumps({"device": str(device), "shapes": [(n, list(t.shape)) for n, t in named]}))
        for _ in range(passes):
            for bucket in buckets:
                nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
                t0 = time.perf_counter()
                text = serialize_named_tensors(bucket)
                t1 = time.perf_counter()
                reply = ask(text)
                wall = time.perf_counter() - t0 - reply["checksum_s"]
                mismatched.update(n for n, s in reply["checksums"].items() if s != want[n])
                mismatched.update(n for n, _ in bucket if n not in reply["checksums"])
                rows.append({"bytes": nbytes, "wall_s": wall, "serialize_s": t1 - t0, "open_s": reply["open_s"],
                             "copy_s": reply["copy_s"], "payload_chars": len(text)})
    finally:
        receiver.stdin.close()
        code = receiver.wait(timeout=120)
    if code != 0:
        raise RuntimeError(f"the receiver exited with code {code}")
    return {"device": device.type, "tensor_shape": [side, side], "tensors": count, "buckets": len(buckets),
            "bucket_mb": bucket_mb, "passes": passes, "total_bytes": sum(r["bytes"] for r in rows),
            "gbps": _median([r["bytes"] / r["wall_s"] / 1e9 for r in rows]),
            "min_gbps": min(r["bytes"] / r["wall_s"] / 1e9 for r in rows),
            **{f"{k}_median": _median([r[k] for r in rows]) for k in ("wall_s", "serialize_s", "open_s", "copy_s")},
            "payload_chars_median": _median([r["payload_chars"] for r in rows]),
            "checksum_match": not mismatched, "mismatched": sorted(mismatched)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bucket-mb", type=float, default=512.0)
    p.add_argument("--total-mb", type=float, default=4096.0, help="MiB of tensors sent per pass")
    p.add_argument("--passes", type=int, default=3, help="times every bucket is sent")
    p.add_argument("--tiny", action="store_true", help="CPU shared memory: 1 MiB in buckets of 0.25 MiB")
    p.add_argument("--receive", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.receive:
        receive()
        return
    if args.tiny:
        figures = send(torch.device("cpu"), **TINY)
    elif torch.cuda.is_available():
        figures = send(torch.device("cuda"), side=SIDE, bucket_mb=args.bucket_mb, total_mb=args.total_mb,
                       passes=args.passes)
    else:
        raise SystemExit("ipc_bandwidth.py needs CUDA (or --tiny for the CPU check)")
    print(f"{figures['device']}: {figures['buckets']} buckets of {figures['bucket_mb']} MiB x {figures['passes']} "
          f"passes: {figures['gbps']:.1f} GB/s median (serialise {figures['serialize_s_median'] * 1e3:.2f} ms, "
          f"open {figures['open_s_median'] * 1e3:.2f} ms, copy {figures['copy_s_median'] * 1e3:.2f} ms per "
          f"bucket), checksums {'match' if figures['checksum_match'] else 'DIFFER'}", file=sys.stderr)
    print(json.dumps(figures))
    if not figures["checksum_match"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
