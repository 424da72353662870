"""Config tree: defaults, recipes, overrides, named errors, CLI behaviour and docs sync."""

import dataclasses
import glob
import pathlib
import subprocess
import sys

import pytest
import yaml

from megatron_dapo.config import Config, ConfigError, from_dict, load_config, to_dict, to_yaml
from megatron_dapo.config.docs import BEGIN, END, field_docs, table
from megatron_dapo.config.loader import load_yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPES = sorted(glob.glob(str(ROOT / "configs" / "*.yaml")))


def test_defaults_are_a_valid_config():
    cfg = load_config()
    assert cfg.actor.clip_ratio_low == 0.2 and cfg.actor.clip_ratio_high == 0.28
    assert cfg.actor.loss_agg_mode == "token-mean"
    assert cfg.algorithm.filter_groups.enable


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: pathlib.Path(p).name)
def test_every_shipped_recipe_loads_and_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def _redundant(d, base, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _redundant(v, base[k], prefix + k + ".")
        elif base[k] == v:
            yield prefix + k


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: pathlib.Path(p).name)
def test_recipes_hold_only_overrides(path):
    """STYLE rule 5: a recipe lists only what differs from the base."""
    assert list(_redundant(load_yaml(path), to_dict(load_config()))) == []


def test_full_dapo_recipe_values():
    cfg = load_config(str(ROOT / "configs/dapo_qwen2.5_32b.yaml"))
    assert (cfg.data.gen_batch_size, cfg.data.train_batch_size, cfg.rollout.n) == (1536, 512, 16)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (2048, 20480)
    assert (cfg.reward.overlong_buffer.enable, cfg.reward.overlong_buffer.len,
            cfg.reward.overlong_buffer.penalty_factor) == (True, 4096, 1.0)
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high, cfg.actor.clip_ratio_c) == (0.2, 0.28, 10.0)
    fg = cfg.algorithm.filter_groups
    assert (fg.enable, fg.metric, fg.max_num_gen_batches) == (True, "acc", 10)
    assert (cfg.actor.lr, cfg.actor.lr_warmup_steps, cfg.actor.weight_decay, cfg.actor.clip_grad) == (1e-6, 10, 0.1, 1.0)
    assert cfg.actor.loss_agg_mode == "token-mean" and not cfg.actor.use_kl_loss and not cfg.needs_reference
    wo_ds = load_config(str(ROOT / "configs/dapo_wo_ds_qwen2.5_32b.yaml"))
    assert not wo_ds.algorithm.filter_groups.enable
    early = load_config(str(ROOT / "configs/dapo_early_qwen2.5_32b.yaml"))
    assert not early.algorithm.filter_groups.enable and early.actor.loss_agg_mode == "seq-mean-token-mean"


def test_precedence_base_then_recipe_then_dotlist(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  lr: 0.5\n  clip_ratio_high: 0.3\n")
    cfg = load_config(str(recipe), ["actor.lr=0.25"])
    assert cfg.actor.lr == 0.25            # dotlist beats recipe
    assert cfg.actor.clip_ratio_high == 0.3  # recipe beats base
    assert cfg.actor.clip_ratio_low == 0.2   # base


def test_dotlist_values_are_typed():
    cfg = load_config(None, ["trainer.logger=[console]", "data.gen_batch_size=null", "actor.lr=1e-5",
                             "algorithm.rollout_correction.rollout_is_threshold=0.5_2.0"])
    assert cfg.trainer.logger == ["console"] and cfg.data.gen_batch_size is None
    assert cfg.actor.lr == 1e-5
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.5_2.0"


def test_unknown_key_names_it_and_suggests_the_closest():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor.clip_ratio_hgh=0.3"])
    assert e.value.key == "actor.clip_ratio_hgh" and "actor.clip_ratio_high" in str(e.value)
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["nosuchsection.x=1"])
    # a key of a section is answered with a key, never with the section itself
    with pytest.raises(ConfigError, match="did you mean 'trainer.total_training_steps'"):
        load_config(None, ["trainer.totl_training_steps=3"])
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.foo=1"])
    assert str(e.value).endswith("unknown key; trainer has no key 'foo' (docs/configuration.md lists its keys)")


@pytest.mark.parametrize("override,key", [
    (["actor.clip_ratio_c=1.0"], "actor.clip_ratio_c"),
    (["data.gen_batch_size=4"], "data.gen_batch_size"),
    (["rollout.n=1"], "rollout.n"),
    (["reward.overlong_buffer.len=0"], "reward.overlong_buffer.len"),
    (["reward.overlong_buffer.len=13"], "reward.overlong_buffer.len"),
    (["rollout.min_new_tokens=-1"], "rollout.min_new_tokens"),
    (["rollout.min_new_tokens=13"], "rollout.min_new_tokens"),
    (["actor.ppo_mini_batch_size=5"], "actor.ppo_mini_batch_size"),
    (["parallel.tensor_model_parallel_size=2"], "parallel.tensor_model_parallel_size"),
    (["trainer.n_gpus_per_node=4", "parallel.expert_model_parallel_size=8"], "parallel.expert_model_parallel_size"),
    (["actor.lr=fast"], "actor.lr"),
    (["actor.loss_agg_mode=seq-mean"], "actor.loss_agg_mode"),
    (["trainer.val_before_train=1"], "trainer.val_before_train"),
    (["actor.policy_loss=ppo2"], "actor.policy_loss"),
    (["algorithm.adv_estimator=grp"], "algorithm.adv_estimator"),
    (["actor.kl_loss_type=k4"], "actor.kl_loss_type"),
    (["data.task=files", "data.train_files=x.parquet", "data.tokenizer=tok"], "data.val_files"),
    (["algorithm.rollout_correction.preset=decoupled_seq_is", "algorithm.rollout_correction.bypass_mode=true"],
     "algorithm.rollout_correction.bypass_mode"),
    (["trainer.experiment_name=.."], "trainer.experiment_name"),  # would write into output_dir's parent
    (["trainer.exit_signals=[SIGHUP]"], "trainer.exit_signals"),
    (["trainer.preemption_exit_code=2"], "trainer.preemption_exit_code"),
    (["rollout.health_check_interval_s=0"], "rollout.health_check_interval_s"),
    (["rollout.server_down_timeout_s=0"], "rollout.server_down_timeout_s"),
])
def test_invalid_values_raise_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    assert e.value.key == key, str(e.value)


def test_filter_groups_off_relaxes_its_checks():
    cfg = load_config(None, ["algorithm.filter_groups.enable=false", "rollout.n=1", "data.gen_batch_size=null",
                             "data.train_batch_size=8", "actor.ppo_mini_batch_size=4"])
    assert cfg.rollout.n == 1
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.filter_groups.enable=false", "data.gen_batch_size=32"])
    assert e.value.key == "data.gen_batch_size"


@pytest.mark.parametrize("override,names", [
    (["algorithm.filter_groups.enable=false", "data.gen_batch_size=null"], "algorithm.filter_groups.enable=false"),
    (["queue.enable=true"], "queue.enable=true"),
])
def test_streaming_is_refused_where_nothing_streams(override, names):
    """Dynamic sampling off, or the queue trainer: a named error. Both engines stream."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.filter_groups.streaming=true", *override])
    assert e.value.key == "algorithm.filter_groups.streaming" and names in str(e.value)
    assert load_config(None, ["algorithm.filter_groups.streaming=true"]).algorithm.filter_groups.streaming
    assert load_config(None, ["algorithm.filter_groups.streaming=true", "rollout.engine=sglang",
                              "model.hf_path=/m"]).algorithm.filter_groups.streaming


def test_parallel_sizes_that_divide_the_world_are_accepted():
    cfg = load_config(None, ["trainer.n_gpus_per_node=8", "parallel.tensor_model_parallel_size=2",
                             "parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=4",
                             "parallel.expert_tensor_parallel_size=1"])
    assert cfg.trainer.world_size == 8


def test_yaml_round_trip_reproduces_the_config():
    cfg = load_config(str(ROOT / "configs/dapo_qwen3_30b_a3b.yaml"))
    assert from_dict(yaml.safe_load(to_yaml(cfg))) == cfg


def test_every_field_has_a_docstring():
    def walk(cls):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert f.name in docs, f"{cls.__name__}.{f.name} has no docstring"
            if dataclasses.is_dataclass(f.type) or dataclasses.is_dataclass(getattr(cls(), f.name)):
                walk(type(getattr(cls(), f.name)))
    walk(Config)


def test_every_config_key_documented_in_the_config_page():
    text = (ROOT / "docs/configuration.md").read_text()
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert block == table(), ("docs/configuration.md's config table is stale: run "
                              "`python -m megatron_dapo.config.docs --write docs/configuration.md`")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_dapo.train", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_cli_print_config_prints_resolved_yaml_and_exits_0():
    r = _cli("--config", "configs/tiny_cpu.yaml", "--print-config", "actor.lr=0.01")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["actor"]["lr"] == 0.01


def test_cli_invalid_config_exits_2_with_one_line_naming_the_key():
    r = _cli("--config", "configs/tiny_cpu.yaml", "actor.clip_ratio_c=0.5", "--print-config")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "actor.clip_ratio_c" in lines[0] and "> 1" in lines[0]


@pytest.mark.parametrize("name, content, expected", [
    ("binary.yaml", b"\xf0\x9f\x00\xff\x01\x02", "is not UTF-8 text (byte 0xf0 at offset 0): a recipe is a YAML file"),
    ("latin1.yaml", "actor:\n  lr: 1e-6  # r\xe9glage\n".encode("latin-1"), "is not UTF-8 text (byte 0xe9 at offset 22): a recipe is a YAML file"),
    ("dir.yaml", None, "is a directory, expected a YAML file"),
    ("dup.yaml", b"data:\n  train_batch_size: 4\n  gen_batch_size: 8\n  train_batch_size: 8\n",
     "key 'train_batch_size' appears twice in one mapping (lines 2 and 4)"),
])
def test_cli_unreadable_or_ambiguous_recipe_exits_2_with_one_line_naming_the_file(tmp_path, name, content, expected):
    path = tmp_path / name
    path.mkdir() if content is None else path.write_bytes(content)
    r = _cli("--config", str(path), "--print-config")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0] == f"config error: --config: {path}{':' if name == 'dup.yaml' else ''} {expected}"


def test_a_key_repeated_in_different_mappings_is_not_a_duplicate(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("data:\n  seed: 3\ntrainer:\n  seed: 4\n")
    raw = load_yaml(str(path))
    assert raw == {"data": {"seed": 3}, "trainer": {"seed": 4}}


def test_every_bad_key_is_reported_in_one_run_one_line_each(tmp_path, capsys):
    from megatron_dapo.config import ConfigError, load_config_cli
    from megatron_dapo.config.errors import ConfigErrors

    overrides = ["actor.lrr=1e-6", "rollout.n=two", "actor.clip_ratio_low=-1", "trainer.total_epochs=0",
                 "data.arithmetic.num_train=0", "actor.lr=1e-6"]
    with pytest.raises(ConfigErrors) as e:
        load_config(None, overrides)
    assert [err.key for err in e.value.errors] == ["actor.lrr", "actor.clip_ratio_low", "rollout.n",
                                                  "trainer.total_epochs", "data.arithmetic.num_train"]
    assert isinstance(e.value, ConfigError) and e.value.key == "actor.lrr"
    assert load_config_cli(None, overrides) is None
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 5 and all(line.startswith("config error: ") for line in lines)
    assert "config error: rollout.n: expected an integer, got 'two'" in lines
    with pytest.raises(ConfigError) as one:  # a single bad key stays a plain ConfigError
        load_config(None, ["rollout.n=two"])
    assert type(one.value) is ConfigError
