"""The queue Megatron's checkpoint writer reports its results on (trainer/checkpoint.py WriteResultsFile): an
unlinked file instead of a Manager server process. Results put by a forked helper (an asynchronous save)
or by the trainer itself (a synchronous one) are read back whole and in order, however large; a save
starts from an empty file; a save made through Megatron reads its results from it and leaves no process."""

import multiprocessing as mp
import os
import queue

import psutil
import pytest
import torch

from megatron_dapo.trainer.checkpoint import WriteResultsFile, _writer_results_file


def _put_from_fork(results: WriteResultsFile, objs) -> int:
    proc = mp.get_context("fork").Process(target=lambda: [results.put(o) for o in objs])
    proc.start()
    proc.join(60)
    return proc.exitcode


def test_results_a_forked_writer_puts_are_read_back_in_order_whatever_their_size():
    results = WriteResultsFile()
    assert results.empty()
    with pytest.raises(queue.Empty):
        results.get_nowait()
    big = {"bucket": list(range(300_000)), "error": None}  # ~1.5 MB pickled: far past a pipe's 64 KB buffer
    assert _put_from_fork(results, [big, RuntimeError("shard 3 failed")]) == 0
    assert results.get_nowait() == big
    err = results.get()
    assert isinstance(err, RuntimeError) and str(err) == "shard 3 failed"
    assert results.empty()

    results.put({"own": 1})  # the synchronous save: the trainer puts, then reads, in one thread
    assert results.get_nowait() == {"own": 1}
    results.put("stale")
    results.reset()  # the next save starts empty
    assert results.empty()
    assert _put_from_fork(results, [[1, 2]]) == 0
    assert results.get_nowait() == [1, 2] and results.empty()
    assert not [f for f in os.listdir(os.path.dirname(os.path.realpath(f"/proc/self/fd/{results._fd}")))
                if f.startswith("megatron_dapo-checkpoint-results-")]  # unlinked: nothing on disk to leave


def test_a_megatron_save_reports_through_the_file_and_starts_no_process(tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from megatron_dapo.models import cpu_compat

    cpu_compat.install(device_mode=False)  # Megatron's writer calls torch.cuda.synchronize
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    children = {c.pid for c in psutil.Process().children()}
    weight = torch.arange(12.0).reshape(3, 4)
    for step in (1, 2):
        _writer_results_file()
        state = {"w": ShardedTensor.from_rank_offsets("w", weight * step, replica_id=0)}
        os.makedirs(tmp_path / f"s{step}")
        dist_checkpointing.save(state, str(tmp_path / f"s{step}"))
        assert isinstance(fa._results_queue, WriteResultsFile) and fa._results_queue.empty()  # read by Megatron
        loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), replica_id=0)},
                                         str(tmp_path / f"s{step}"))
        assert torch.equal(loaded["w"], weight * step)
    alive = {c.pid for c in psutil.Process().children() if c.status() != psutil.STATUS_ZOMBIE}
    assert alive <= children, alive - children
