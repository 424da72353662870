"""Record one real SGLang /generate reply, the shape `bench_rank0.py` generates its synthetic replies in.

Launches a real SGLang server (the venv `make sglang-env` builds, through the trainer's own launch path)
on the tiny Qwen3-MoE of the real-server tests with --enable-return-routed-experts, sets a weight version
with `/update_weights_from_disk` (so `meta_info.weight_version` is a trainer version, as in a run), posts
one batched /generate built by the engine's own `build_generate_payload` (log-probs, R3 routing, seeds),
and writes the raw reply bytes, the request and the server's /server_info and /model_info replies to
`benchmarks/assets/`.

    .venv/bin/python benchmarks/record_sglang_reply.py [--out benchmarks/assets]

The recorded file is committed; run this again only to follow a new SGLang release.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import requests

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/assets"))
    args = ap.parse_args()

    from megatron_dapo.config import load_config
    from megatron_dapo.rollout.base import PromptInput, SamplingParams
    from megatron_dapo.rollout.sglang.build import sglang_launch_plan
    from megatron_dapo.rollout.sglang.payloads import build_generate_payload
    from megatron_dapo.rollout.sglang.server import launch_servers
    from tests.sglang_real.conftest import cpu_server_overrides, free_port_pair, model_overrides
    from tests.sglang_real.model import write_tiny_qwen3_moe

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, tokenizer_dir = write_tiny_qwen3_moe(f"{tmp}/model")
        cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
            *model_overrides(model_dir, tokenizer_dir), *cpu_server_overrides(), "rollout.engine=sglang",
            "trainer.n_gpus_per_node=1", f"rollout.server_base_port={free_port_pair()}",
            f"trainer.output_dir={tmp}/run",
            "rollout.server_extra_args=[--sleep-on-idle,--skip-server-warmup,--enable-return-routed-experts]"])
        specs, launcher, env = sglang_launch_plan(cfg)
        (server,) = launch_servers(specs, log_dir=f"{tmp}/logs", timeout_s=600, launcher=launcher, env=env)
        try:
            r = requests.post(server.url + "/update_weights_from_disk",
                              json={"model_path": model_dir, "weight_version": "3"}, timeout=300)
            r.raise_for_status()
            prompts = [PromptInput("p0", (5, 6, 7, 8)), PromptInput("p1", (9, 10, 11))]
            sampling = SamplingParams(max_new_tokens=12, n=2, temperature=1.0, stop_token_ids=(2,), seed=11)
            items = [(p, j) for p in prompts for j in range(sampling.n)]
            body = build_generate_payload(items, sampling, [f"rec-{k}" for k in range(len(items))],
                                          routed_experts=True)
            reply = requests.post(server.url + "/generate", json=body, timeout=300)
            reply.raise_for_status()
            infos = {path: requests.get(server.url + path, timeout=60).json() for path in ("/server_info", "/model_info")}
        finally:
            server.stop()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sglang-0.5.23-generate-reply.json").write_bytes(reply.content)
    (out / "sglang-0.5.23-generate-request.json").write_text(json.dumps(body, indent=1) + "\n")
    for path, info in infos.items():
        (out / f"sglang-0.5.23{path.replace('/', '-').replace('_', '-')}.json").write_text(json.dumps(info, indent=1) + "\n")
    items = reply.json()
    print(f"recorded {len(items)} items, {len(reply.content)} bytes; meta_info keys: {sorted(items[0]['meta_info'])}")


if __name__ == "__main__":
    main()
