"""Checkpoints that cannot lie (trainer/checkpoint.py): every file's size and SHA-256 in manifest.json,
checked before anything is unpickled; a resume takes the newest step directory that verifies."""

from __future__ import annotations

import json
import logging
import pathlib
import re

import pytest

from megatron_dapo.trainer import checkpoint as ckpt

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _step(root: pathlib.Path, step: int, payload: bytes = b"weights") -> pathlib.Path:
    d = root / f"global_step_{step}"
    (d / "model").mkdir(parents=True)
    (d / "model" / "__0_0.distcp").write_bytes(payload * 100)
    (d / "trainer_state.pt").write_bytes(b"state")
    ckpt.write_manifest(str(d), is_rank0=True)
    return d


def test_the_manifest_lists_every_file_with_its_size_and_digest(tmp_path):
    import hashlib

    d = _step(tmp_path, 1)
    manifest = json.loads((d / ckpt.MANIFEST).read_text())
    assert manifest["algorithm"] == "sha256" and sorted(manifest["files"]) == ["model/__0_0.distcp", "trainer_state.pt"]
    assert manifest["files"]["trainer_state.pt"] == {"size": 5, "sha256": hashlib.sha256(b"state").hexdigest()}
    assert ckpt.verify_checkpoint(str(d)) is None


@pytest.mark.parametrize("damage,message", [
    (lambda f: f.write_bytes(f.read_bytes()[:-1] + b"X"), r"__0_0.distcp does not match its sha256 in the manifest"),
    (lambda f: f.write_bytes(f.read_bytes()[:10]), r"__0_0.distcp has 10 bytes, the manifest 700 \(truncated"),
    (lambda f: f.unlink(), r"__0_0.distcp is missing"),
], ids=["flipped", "truncated", "missing"])
def test_a_damaged_file_is_named_and_the_resume_falls_back_to_the_newest_that_verifies(tmp_path, caplog, damage,
                                                                                       message):
    _step(tmp_path, 1)
    _step(tmp_path, 2)
    d3 = _step(tmp_path, 3)
    (tmp_path / ckpt.LATEST).write_text("3")
    damage(d3 / "model" / "__0_0.distcp")
    assert re.search(message, ckpt.verify_checkpoint(str(d3)))
    with caplog.at_level(logging.WARNING):
        assert ckpt.newest_verified(str(tmp_path)) == str(tmp_path / "global_step_2")
    assert any(r.levelno == logging.ERROR and "global_step_3 fails verification" in r.message for r in caplog.records)
    assert "skipped" in caplog.text and "global_step_3" in caplog.text


def test_the_marker_may_be_missing_or_stale_the_newest_verified_directory_wins(tmp_path, caplog):
    _step(tmp_path, 1)
    _step(tmp_path, 2)
    assert ckpt.newest_verified(str(tmp_path)) == str(tmp_path / "global_step_2")  # no marker at all
    (tmp_path / ckpt.LATEST).write_text("7")  # names a directory that does not exist
    with caplog.at_level(logging.WARNING):
        assert ckpt.newest_verified(str(tmp_path)) == str(tmp_path / "global_step_2")
    assert "latest_checkpointed_iteration.txt names 7" in caplog.text


def test_none_verifying_is_an_error_naming_each_and_an_old_directory_without_manifest_is_taken(tmp_path):
    d1 = _step(tmp_path, 1)
    (d1 / "trainer_state.pt").write_bytes(b"other")
    with pytest.raises(ckpt.CheckpointCorrupt, match=r"no checkpoint under .* verifies: .*global_step_1 .*"
                                                      r"trainer_state.pt does not match"):
        ckpt.newest_verified(str(tmp_path))
    (d1 / ckpt.MANIFEST).unlink()  # as written before checkpoints carried manifests
    assert ckpt.newest_verified(str(tmp_path)) == str(d1)
    assert ckpt.newest_verified(str(tmp_path / "nothing")) is None


def test_a_training_run_resumes_past_a_corrupted_checkpoint_from_the_one_before(tmp_path, caplog):
    """Three steps saved at every step; step 3's model shard gets one flipped byte; the resumed run names
    the file, resumes from step 2, and trains steps 3 and 4 (an explicit resume_mode path is refused)."""
    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.run import run
    from tests.trainer.test_fit import TINY, _scalars

    def cfg(*extra):
        return load_config(str(ROOT / "configs/tiny_cpu.yaml"),
                           TINY + [f"trainer.output_dir={tmp_path}", "trainer.experiment_name=c", "trainer.test_freq=0",
                                   "trainer.save_freq=1", "trainer.max_ckpt_to_keep=3", *extra])

    assert run(cfg("trainer.total_training_steps=3")) == 0
    root = tmp_path / "c/ckpt"
    shard = sorted((root / "global_step_3/model").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointCorrupt, match=rf"{shard.name} does not match its sha256"):
        run(cfg("trainer.total_training_steps=4", f"trainer.resume_mode={root / 'global_step_3'}"))
    with caplog.at_level(logging.INFO):
        assert run(cfg("trainer.total_training_steps=4")) == 0
    assert f"{shard} does not match its sha256 in the manifest (corrupted)" in caplog.text
    assert f"resumed from {root / 'global_step_2'} at step 2" in caplog.text
    assert sorted(_scalars(tmp_path / "c")["actor/pg_loss"]) == [1, 2, 3, 4]
    assert (root / ckpt.LATEST).read_text() == "4"


def test_a_checkpoint_written_before_the_first_optimizer_step_resumes_and_equals_the_uninterrupted_run(
        tmp_path, monkeypatch):
    """trainer.critic_warmup=3: steps 1 and 2 update nothing, so their checkpoints hold no Adam moments
    (the load used to fail on them: KeyError optimizer.state.exp_avg...). The resumed run loads the model
    alone, its optimizer as fresh as the saved one, and steps 3 and 4 equal the uninterrupted run's."""
    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.run import run
    from tests.trainer.test_fit import TINY, _scalars

    def cfg(name, *extra):
        return load_config(str(ROOT / "configs/tiny_cpu.yaml"),
                           TINY + [f"trainer.output_dir={tmp_path / name}", "trainer.experiment_name=w",
                                   "trainer.test_freq=0", "trainer.critic_warmup=3", *extra])

    from megatron_dapo.trainer import fit

    args = ("trainer.total_training_steps=4", "trainer.save_freq=1")
    assert run(cfg("a", *args)) == 0
    real = fit.DAPOTrainer._save

    def save_then_stop(self):  # the first attempt ends right after step 2's checkpoint, as a crash would
        real(self)
        if self.global_step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(fit.DAPOTrainer, "_save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run(cfg("b", *args))
    monkeypatch.setattr(fit.DAPOTrainer, "_save", real)
    import torch

    state = torch.load(tmp_path / "b/w/ckpt/global_step_2/trainer_state.pt", weights_only=True)
    assert state["optimizer_stepped"] is False and state["loss_history"] == []
    assert run(cfg("b", *args)) == 0
    a, b = _scalars(tmp_path / "a/w"), _scalars(tmp_path / "b/w")
    assert sorted(b["actor/pg_loss"]) == [3, 4]
    for name in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
        assert [a[name][s] for s in (3, 4)] == [b[name][s] for s in (3, 4)], name


def test_a_fresh_start_where_checkpoints_are_is_refused_and_pruning_spares_what_was_just_written(tmp_path):
    from megatron_dapo.config import ConfigError, load_config
    from megatron_dapo.trainer.run import build_trainer

    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [f"trainer.output_dir={tmp_path}", "trainer.resume_mode=disable"])
    for step in (10, 12):
        _step(pathlib.Path(cfg.ckpt_dir), step)
    with pytest.raises(ConfigError, match=r"trainer.resume_mode: disable, but .*ckpt holds checkpoints "
                                          r"\(global_step_10, global_step_12\)"):
        build_trainer(cfg)
    assert not (pathlib.Path(cfg.run_dir) / "config.yaml").exists()
    root = pathlib.Path(cfg.ckpt_dir)
    _step(root, 1)
    ckpt._prune(str(root), 2, written=1)  # a step below the ones there (resumed from another directory)
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_1", "global_step_10", "global_step_12"]
    ckpt._prune(str(root), 2, written=12)
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_10", "global_step_12"]
