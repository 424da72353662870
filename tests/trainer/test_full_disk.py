"""A full disk during a checkpoint save, on a real one: the trainer runs on a small tmpfs (mounted in a user
and mount namespace, `unshare -rm`, so no privilege is needed) that holds two checkpoints but not a third.
The user is told "No space left on device" with the directory, the torn directory is gone, and the last
good checkpoint is intact and verifies."""

import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.trainer.test_fit import TINY as FIT_TINY

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = [*FIT_TINY, "trainer.test_freq=0", "trainer.val_before_train=false"]  # test_fit's tiny run, no validation


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _namespaces_work(), reason="needs unshare -rm (user and mount namespaces) for a tmpfs")
def test_a_full_disk_mid_save_names_the_directory_removes_it_and_keeps_the_last_checkpoint(tmp_path):
    out = tmp_path / "disk"
    out.mkdir()
    train = [sys.executable, "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml", *TINY,
             f"trainer.output_dir={out}", "trainer.experiment_name=full", "trainer.total_training_steps=4",
             "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2"]
    check = [sys.executable, "-c", "import sys; from megatron_dapo.trainer.checkpoint import verify_checkpoint; "
             "print('verify:', verify_checkpoint(sys.argv[1]))", f"{out}/full/ckpt/global_step_2"]
    # A checkpoint of the tiny model takes 7.1 MiB: 18 MiB hold two, and the third save runs out of space.
    script = (f"mount -t tmpfs -o size=18m tmpfs {out} || exit 99; "
              f"{shlex.join(train)} 2>&1; rc=$?; echo; echo \"rc: $rc\"; "  # its own line, whatever came last
              f"echo \"dirs: $(ls {out}/full/ckpt | tr '\\n' ' ')\"; echo \"latest: $(cat {out}/full/ckpt/latest_*)\"; "
              f"{shlex.join(check)}")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and "rc: 1" in lines, r.stdout[-4000:] + r.stderr[-2000:]
    error = next((line for line in lines if "CheckpointWriteError" in line), r.stdout[-4000:])
    assert (f"writing checkpoint {out}/full/ckpt/tmp_global_step_3: No space left on device (" in error
            and "the incomplete directory was removed, the last good checkpoint is global_step_2" in error), error
    assert "dirs: global_step_1 global_step_2 latest_checkpointed_iteration.txt " in lines, r.stdout[-3000:]
    assert "latest: 2" in lines and "verify: None" in lines, r.stdout[-3000:]


def test_a_start_removes_the_directories_of_saves_that_never_completed(tmp_path):
    from megatron_dapo.trainer.checkpoint import remove_torn

    (tmp_path / "global_step_2" / "model").mkdir(parents=True)
    (tmp_path / "tmp_global_step_3" / "model").mkdir(parents=True)
    (tmp_path / "tmp_global_step_3" / "model" / "__0_0.distcp").write_bytes(b"torn")
    assert remove_torn(str(tmp_path)) == [str(tmp_path / "tmp_global_step_3")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2"]
    assert remove_torn(str(tmp_path / "missing")) == []
