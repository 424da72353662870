"""The sync trainer in a parallel layout against real SGLang servers, checking every server after every sync.

    torchrun --nproc_per_node 2 tests/sglang_real/_mp_train.py OUT key=value ...

Runs `fit` as `python -m megatron_dapo.train` would (build_trainer). After each weight sync, rank 0 loads
the actor's own HF export of that version (gathered over TP / PP / EP, every tensor required) into a
transformers model and compares its log-probs of a fixed probe sequence with each server's (SGLang's
`input_token_logprobs`): a server that missed any tensor of any stage answers with other log-probs.
Writes OUT/report.json (rank 0): per sync, the version and per server its reported weight version,
the max |log-prob difference| to the export, and its probe log-probs (and the export's own).
"""

import logging
import sys

import requests
import torch

from megatron_dapo.config import load_config
from megatron_dapo.trainer.run import build_trainer
from tests.trainer._mp_cluster import actor_export, fit_and_report

PROBE = [1, 4, 13, 5, 16, 7, 17, 9, 14, 3, 15, 11, 16, 6, 8, 10, 12, 17, 4, 5]
"""A fixed sequence over the arithmetic vocabulary (ids 1..17)."""


def export_logprobs(hf_path: str, tensors: dict) -> list[float]:
    """log p(PROBE[i] | PROBE[:i]) for i >= 1 under the HF model with the exported tensors (fp32)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(tensors, strict=True)  # the export holds every tensor, nothing else
    with torch.no_grad():
        logits = model(torch.tensor([PROBE])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(PROBE[1:])[:, None])[:, 0]
    return lp.tolist()


def server_logprobs(url: str) -> tuple[list[float], str]:
    """The server's log-probs of PROBE's tokens after the first, and its weight version."""
    r = requests.post(url + "/generate", json={"input_ids": PROBE, "return_logprob": True, "logprob_start_len": 0,
                                               "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
                      timeout=120)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return [x[0] for x in meta["input_token_logprobs"][1:]], meta["weight_version"]


def main(out: str, overrides: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config("configs/tiny_cpu.yaml", overrides + [f"trainer.output_dir={out}"])
    trainer = build_trainer(cfg)
    pgs, urls, push = trainer.p.pgs, list(cfg.rollout.sglang_urls), trainer.sync_weights
    report = []

    def checked_push(version):
        push(version)
        tensors = actor_export(trainer)
        if pgs.rank == 0:
            want = export_logprobs(cfg.model.hf_path, tensors)
            entry = {"version": version, "tensors": len(tensors), "export": want, "servers": {}}
            for url in urls:
                got, reported = server_logprobs(url)
                entry["servers"][url] = {"weight_version": reported, "logprobs": got,
                                         "max_abs_diff": max(abs(a - b) for a, b in zip(got, want, strict=True))}
            report.append(entry)

    trainer.sync_weights = checked_push
    fit_and_report(trainer, out, report=report)


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1], sys.argv[2:]))  # as python -m megatron_dapo.train ends
