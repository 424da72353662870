"""torchrun --nproc_per_node 4 (see test_weights.py): the weight sync's gathers under the recipes' layouts
scaled down. Each layout loads the same canonical weights (OUT/canonical_<arch>.pt, written at world 1),
then every rank walks models.weights.gather_stage_state; each stage's sender writes what it got, every
rank writes the (name, bytes) sequence it saw and its traffic counters.

    tp2_pp2        dense tiny, TP 2 x PP 2
    tp2_ep2_etp1   tiny MoE, TP 2 x EP 2, expert-TP 1 (sequence parallel, as Megatron requires)
    pp2_ep2        tiny MoE, PP 2 x EP 2
    pp2_dp2_vpp2   dense tiny, PP 2 x DP 2 with 2 virtual stages per rank
"""

import json
import sys

import torch

from megatron_dapo.models.arch import get_arch
from megatron_dapo.models.builder import build_gpt_model_chunks
from megatron_dapo.models.weights import gather_stage_state, is_stage_sender, load_canonical_state
from megatron_dapo.parallel import destroy_parallel, init_parallel

LAYOUTS = {"tp2_pp2": ("tiny", dict(tp=2, pp=2)), "tp2_ep2_etp1": ("tiny_moe", dict(tp=2, ep=2, etp=1)),
           "pp2_ep2": ("tiny_moe", dict(pp=2, ep=2)), "pp2_dp2_vpp2": ("tiny", dict(pp=2, vpp=2))}


def main(out: str, names: list[str]) -> None:
    for name in names:
        preset, sizes = LAYOUTS[name]
        pgs = init_parallel(**sizes, backend="gloo")
        canonical = torch.load(f"{out}/canonical_{preset}.pt", weights_only=True)
        chunks = build_gpt_model_chunks(get_arch(preset), pgs=pgs, seed=None, init_weights=False)
        for c in chunks:
            load_canonical_state(c, canonical.__getitem__, pgs=pgs)
        got, seen, traffic = {}, [], {}
        for c in chunks:
            for cname, full, nbytes in gather_stage_state(c, pgs=pgs, traffic=traffic):
                seen.append((cname, nbytes))
                if full is not None:
                    got[cname] = full.clone()
        if is_stage_sender(pgs):
            torch.save(got, f"{out}/{name}.stage{pgs.pp_rank}.pt")
        else:
            assert not got, f"rank {pgs.rank} is no sender but got {sorted(got)[:3]}"
        with open(f"{out}/{name}.rank{pgs.rank}.json", "w") as f:
            json.dump({"stage": pgs.pp_rank, "sender": is_stage_sender(pgs), "seen": seen, "traffic": traffic}, f)
        destroy_parallel()
    destroy_parallel(destroy_world=True)


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1], sys.argv[2:]))  # as python -m megatron_dapo.train ends
