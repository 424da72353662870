"""torchrun --nproc_per_node 2 (see test_local_engine.py): the local engine's streaming stop is decided on rank 0
of decision_group and broadcast; rank 1's callback is never called; an error in rank 0's callback reaches rank 1
as a RolloutEngineError instead of leaving it waiting."""

import sys
import types

import torch.distributed as dist

from megatron_dapo.rollout.base import RolloutEngineError
from megatron_dapo.rollout.local_engine import LocalEngine


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    eng = LocalEngine.__new__(LocalEngine)  # only the decision needs no model: _decide and its agreement
    eng.decision_group, eng.pgs = dist.group.WORLD, types.SimpleNamespace(tp_size=1)
    calls = []

    def stop_on_second(groups):
        if rank != 0:
            raise AssertionError("the callback ran on rank 1")
        calls.append(groups)
        return len(calls) == 2

    answers = [eng._decide(stop_on_second, [["g"]]) for _ in range(2)]

    def boom(groups):
        raise KeyError("reward down")

    try:
        eng._decide(boom if rank == 0 else stop_on_second, [["g"]])
        error = "none"
    except (KeyError, RolloutEngineError) as e:
        error = f"{type(e).__name__}: {e}"
    with open(f"{out_dir}/decide{rank}.txt", "w") as f:
        f.write(f"{answers}\n{len(calls)}\n{error}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1]))  # as python -m megatron_dapo.train ends
