"""The machine a GPU run measured on, and its two ceilings: a dense matrix product and a copy.

    python tests/gpu/gpu_env.py            # CUDA: bf16 8192^3 products, a 2 GiB device-to-device copy
    python tests/gpu/gpu_env.py --tiny     # CPU: fp32 256^3 products, a 16 MiB copy (checks the script)

Versions (Python, glibc, torch, CUDA, triton, megatron-core, Transformer Engine, and the other packages
the GPU steps import: "missing" when absent), the device (name, compute capability, multiprocessors,
memory), and the ceilings the other figures are read against: matmul TFLOP/s on random inputs (median
of 10 after 3 warm-ups) and copy GB/s counting bytes read plus bytes written (median of 10). The last
line printed is one JSON object.
"""

import argparse
import importlib.metadata
import json
import platform
import subprocess
import sys
import time

import torch

# What the steps of tests/gpu/run_all.sh import beyond torch (distribution names).
PACKAGES = ("triton", "megatron-core", "transformer-engine", "numpy", "packaging", "pyyaml", "einops",
            "safetensors", "transformers", "tensorboard", "psutil", "pytest")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def _median_s(fn, *, warmup: int, repeats: int, sync) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def ceilings(device: torch.device, *, n: int, dtype: torch.dtype, copy_bytes: int) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    mm_s = _median_s(lambda: a @ b, warmup=3, repeats=10, sync=sync)
    src = torch.randn(copy_bytes // 4, device=device, generator=gen)
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), warmup=3, repeats=10, sync=sync)
    return {"matmul_n": n, "matmul_dtype": str(dtype).removeprefix("torch."), "matmul_s": mm_s,
            "matmul_tflops": 2 * n**3 / mm_s / 1e12, "copy_bytes": copy_bytes, "copy_s": copy_s,
            "copy_gbps": 2 * copy_bytes / copy_s / 1e9}


def _nvidia_smi() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU, small sizes")
    args = p.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("gpu_env.py needs CUDA (or --tiny for the CPU check)")
    env = {"python": platform.python_version(), "glibc": "-".join(platform.libc_ver()),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "packages": {name: _version(name) for name in PACKAGES}}
    if args.tiny:
        device = torch.device("cpu")
        env.update(device="cpu", gpu=None, cpu=platform.processor() or platform.machine(),
                   threads=torch.get_num_threads())
        env.update(ceilings(device, n=256, dtype=torch.float32, copy_bytes=16 * 2**20))
    else:
        device = torch.device("cuda")
        props = torch.cuda.get_device_properties(device)
        env.update(device="cuda", gpu=props.name, capability=f"{props.major}.{props.minor}",
                   multiprocessors=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                   nvidia_smi=_nvidia_smi())
        env.update(ceilings(device, n=8192, dtype=torch.bfloat16, copy_bytes=2 * 2**30))
    print(f"{env['gpu'] or env['cpu']}: matmul {env['matmul_tflops']:.1f} TFLOP/s ({env['matmul_dtype']}, "
          f"n={env['matmul_n']}), copy {env['copy_gbps']:.0f} GB/s; torch {env['torch']}, cuda {env['cuda']}, "
          f"triton {env['packages']['triton']}, megatron-core {env['packages']['megatron-core']}", file=sys.stderr)
    print(json.dumps(env))


if __name__ == "__main__":
    main()
