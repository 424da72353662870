"""Run by test_multiproc.py under `torchrun --nproc_per_node 2` (gloo, CPU).

Computes token log-probs of fixed batches under several parallel layouts of the same weights
and writes them to OUT/<case>.rank<r>.safetensors ({"lp": [B, S] or [M, B, S], "batch": idx}):

    layout tp1 (dp=2)   random tiny / tiny_moe, HF dense, HF MoE       (rank r feeds batch r)
    layout tp2 (SP on)  random tiny / tiny_moe, HF dense, HF MoE (etp=2); export of HF MoE
    layout ep2 (dp=2)   HF MoE with the alltoall dispatcher (rank r feeds batch r); export
    layout pp2          HF dense and HF MoE (2 layers) through the 1F1B schedule; export dense
    layout pp2 vpp2     HF dense (4 layers) through the interleaved schedule

Random models rely on use_cpu_initialization: the same seed gives the same master weights at
any TP size. HF models are loaded through models.hf / models.weights sharding.
"""

import argparse
import os

import torch
from safetensors.torch import save_file

from megatron_dapo.models.arch import get_arch
from megatron_dapo.models.builder import build_gpt_model, build_gpt_model_chunks
from megatron_dapo.models.forward import Microbatch, forward_only_logprobs, token_logprobs
from megatron_dapo.models.hf import arch_from_hf, load_hf_as_mcore, load_hf_weights_into, save_mcore_as_hf
from megatron_dapo.parallel import destroy_parallel, init_parallel

TEMPERATURE = 0.8


def batch(index: int, vocab: int, seq: int = 16):
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(100 + index))
    return ids, torch.arange(seq).expand(2, seq), ids.roll(-1, 1)


def write(out, case, pgs, lp, batch_index):
    save_file({"lp": lp.detach().contiguous(), "batch": torch.tensor(batch_index)},
              os.path.join(out, f"{case}.rank{pgs.rank}.safetensors"))


def logprobs_of(model, pgs, batch_index, vocab):
    ids, pos, labels = batch(batch_index, vocab)
    with torch.no_grad():
        return token_logprobs(model.eval(), ids, pos, labels, temperature=TEMPERATURE, pgs=pgs)


def run_flat_layout(name, args, **sizes):
    """TP / EP / DP layouts: every rank holds the output layer."""
    pgs = init_parallel(**sizes, backend="gloo")
    data_index = pgs.dp_rank                    # TP peers share data, DP replicas differ
    if name in ("tp1", "tp2"):
        for preset in ("tiny", "tiny_moe"):
            model = build_gpt_model(get_arch(preset), pgs=pgs, seed=5)
            write(args.out, f"random_{preset}_{name}", pgs, logprobs_of(model, pgs, data_index, 512), data_index)
    if name != "ep2":
        model = load_hf_as_mcore(args.hf_dense, pgs=pgs)
        write(args.out, f"hf_dense_{name}", pgs, logprobs_of(model, pgs, data_index, 128), data_index)
    model = load_hf_as_mcore(args.hf_moe, pgs=pgs)
    write(args.out, f"hf_moe_{name}", pgs, logprobs_of(model, pgs, data_index, 128), data_index)
    if name in ("tp2", "ep2"):
        save_mcore_as_hf(model, os.path.join(args.out, f"export_moe_{name}"), pgs=pgs,
                         arch=arch_from_hf(args.hf_moe))
    destroy_parallel()


def run_pipeline_layout(name, args, hf_dirs, **sizes):
    pgs = init_parallel(**sizes, backend="gloo")
    microbatches = [Microbatch(*batch(i, 128)) for i in range(2)]
    for label, hf_dir in hf_dirs:
        arch = arch_from_hf(hf_dir)
        chunks = build_gpt_model_chunks(arch, pgs=pgs, seed=None, init_weights=False)
        load_hf_weights_into(chunks, hf_dir, pgs=pgs, arch=arch)
        out = forward_only_logprobs([c.eval() for c in chunks], microbatches, pgs=pgs,
                                    temperature=TEMPERATURE)
        write(args.out, f"hf_{label}_{name}", pgs, torch.stack(out), -1)
        if name == "pp2" and label == "dense":
            save_mcore_as_hf(chunks[0], os.path.join(args.out, "export_dense_pp2"), pgs=pgs, arch=arch)
    destroy_parallel()


def main():
    parser = argparse.ArgumentParser()
    for flag in ("--hf-dense", "--hf-dense4", "--hf-moe", "--hf-moe2", "--out"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    run_flat_layout("tp1", args, tp=1)
    run_flat_layout("tp2", args, tp=2)
    run_flat_layout("ep2", args, ep=2, etp=1)
    run_pipeline_layout("pp2", args, [("dense", args.hf_dense), ("moe2", args.hf_moe2)], pp=2)
    run_pipeline_layout("vpp2", args, [("dense4", args.hf_dense4)], pp=2, vpp=2)
    destroy_parallel(destroy_world=True)


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main())  # as python -m megatron_dapo.train ends
