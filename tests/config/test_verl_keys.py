"""verl's keys (config/verl.py): every key of verl's DAPO-32B recipe script maps to one key here, has no
effect here, or is refused naming what to set; the script's overrides load onto our 32B recipe with the
values verl would use; verl's nested YAML layout works; the alias table is the one the docs show."""

import pathlib

import pytest

from megatron_dapo.config import ConfigError, load_config, verl
from megatron_dapo.config.loader import _leaf_keys

ROOT = pathlib.Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests/assets/verl"


def _overrides(name: str) -> list[str]:
    return [line for line in (ASSETS / name).read_text().splitlines() if line and not line.startswith("#")]


def _fate(item: str) -> str:
    """What one override becomes: 'ours' (the same key here), '-> <key>', 'no effect', or 'refused: ...'."""
    key, text = item.split("=", 1)
    key = key.lstrip("+")
    if verl.lookup(key) is None:
        assert key in _leaf_keys(), f"{key} is neither a key here nor in the verl table"
        return "ours"
    import yaml

    try:
        translated = verl.translate(key, yaml.safe_load(text))
    except ConfigError as e:
        return f"refused: {e}"
    return "no effect" if translated is None else f"-> {translated[0]}"


def test_every_key_of_verls_dapo_32b_script_maps_has_no_effect_or_is_refused_with_the_reason():
    fates = {item.split("=", 1)[0]: _fate(item) for item in _overrides("run_dapo_qwen2.5_32b.overrides")
             + _overrides("run_dapo_qwen2.5_32b.older.overrides")}
    print("\n".join(f"{k:62s} {v}" for k, v in fates.items()))  # the table for the record (pytest -s)
    refused = {k: v for k, v in fates.items() if v.startswith("refused")}
    assert set(refused) == {"actor_rollout_ref.rollout.name", "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                            "actor_rollout_ref.ref.ulysses_sequence_parallel_size"}
    assert "rollout.engine=sglang" in refused["actor_rollout_ref.rollout.name"]
    ulysses = refused["actor_rollout_ref.actor.ulysses_sequence_parallel_size"]
    assert "parallel.sequence_parallel" in ulysses and "megatron_dapo.plan" in ulysses
    assert "context_parallel_size" not in ulysses  # itself refused: never the way out
    assert fates["actor_rollout_ref.actor.optim.lr"] == "-> actor.lr"
    assert fates["actor_rollout_ref.model.use_remove_padding"] == "no effect"
    assert fates["custom_reward_function.overlong_buffer.len"] == "-> reward.overlong_buffer.len"


def test_the_scripts_overrides_load_onto_the_32b_recipe_with_verls_values():
    items = [i for i in _overrides("run_dapo_qwen2.5_32b.overrides")
             if not i.startswith(("actor_rollout_ref.rollout.name=", "actor_rollout_ref.actor.ulysses",
                                  "actor_rollout_ref.ref.ulysses"))]
    cfg = load_config(str(ROOT / "configs/dapo_qwen2.5_32b.yaml"), items)
    d, a, r, t = cfg.data, cfg.actor, cfg.rollout, cfg.trainer
    assert (d.train_files, d.val_files) == ("/home/user/verl/data/dapo-math-17k.parquet",
                                            "/home/user/verl/data/aime-2024.parquet")
    assert (d.max_prompt_length, d.max_response_length, d.gen_batch_size, d.train_batch_size) == (2048, 20480, 1536, 512)
    assert (a.lr, a.lr_warmup_steps, a.weight_decay, a.clip_grad, a.ppo_mini_batch_size) == (1e-6, 10, 0.1, 1.0, 32)
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.loss_agg_mode) == (0.2, 0.28, 10.0, "token-mean")
    assert (a.kl_loss_coef, a.entropy_coeff, a.max_tokens_per_microbatch) == (0.0, 0, 22528)
    assert (cfg.model.hf_path, cfg.model.recompute) == ("/home/user/verl/models/Qwen2.5-32B", "full")
    assert (r.n, r.temperature, r.top_p, r.top_k, r.tensor_model_parallel_size, r.gpu_memory_utilization) == \
        (16, 1.0, 1.0, -1, 4, 0.8)
    assert (r.val_kwargs.n, r.val_kwargs.temperature, r.val_kwargs.top_p, r.val_kwargs.top_k) == (1, 1.0, 0.7, -1)
    ob = cfg.reward.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor) == (True, 4096, 1.0)
    fg = cfg.algorithm.filter_groups
    assert (fg.enable, fg.metric, fg.max_num_gen_batches, cfg.algorithm.adv_estimator) == (True, "acc", 10, "grpo")
    assert (t.logger, t.nnodes, t.n_gpus_per_node, t.test_freq, t.save_freq, t.total_epochs) == \
        (["console", "wandb"], 16, 8, 5, 25, 1)
    assert (t.val_before_train, t.resume_mode, t.default_local_dir) == \
        (True, "auto", "/home/user/verl/ckpts/DAPO/DAPO-Qwen2.5-32B")


def test_the_older_scripts_keys_and_hydras_plus_prefix():
    cfg = load_config(str(ROOT / "configs/dapo_qwen2.5_32b.yaml"),
                      _overrides("run_dapo_qwen2.5_32b.older.overrides") + ["actor_rollout_ref.actor.use_token_level_loss=False"])
    assert cfg.actor.loss_agg_mode == "seq-mean-token-mean" and cfg.trainer.val_before_train is True
    assert (cfg.reward.overlong_buffer.enable, cfg.reward.overlong_buffer.len) == (True, 4096)
    assert cfg.trainer.logger == ["console", "wandb"]
    with pytest.raises(ConfigError, match=r"override_config.attention_dropout: verl key not supported with value 0.1"):
        load_config(None, ["+actor_rollout_ref.model.override_config.attention_dropout=0.1"])


def test_use_kl_loss_turns_the_kl_loss_and_its_reference_on_and_a_list_of_one_file_is_one_file(tmp_path):
    on = load_config(None, ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.5"])
    assert on.actor.use_kl_loss and on.actor.kl_loss_coef == 0.5 and on.needs_reference
    for items in (["actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.kl_loss_coef=0.5"],
                  ["actor_rollout_ref.actor.kl_loss_coef=0.5", "actor_rollout_ref.actor.use_kl_loss=False"]):
        off = load_config(None, items)
        assert not off.actor.use_kl_loss and not off.needs_reference
    recipe = tmp_path / "verl.yaml"  # verl's nested layout the same
    recipe.write_text("actor_rollout_ref:\n  actor:\n    use_kl_loss: true\n")
    assert load_config(str(recipe)).actor.use_kl_loss
    assert load_config(None, ["data.train_files=[a.parquet]"]).data.train_files == "a.parquet"
    with pytest.raises(ConfigError, match=r"data.train_files: .* 2 files: this project reads one training file"):
        load_config(None, ["data.train_files=[a.parquet,b.parquet]"])


def test_a_recipe_in_verls_nested_layout(tmp_path):
    recipe = tmp_path / "verl.yaml"
    recipe.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 2.0e-6\n    fsdp_config:\n      param_offload: true\n"
                      "  rollout:\n    n: 8\n    val_kwargs:\n      top_p: 0.7\nreward_model:\n  overlong_buffer:\n"
                      "    enable: true\n    len: 8\ndata:\n  train_batch_size: 16\n  truncation: left\n")
    cfg = load_config(str(recipe), ["data.max_response_length=16"])
    assert (cfg.actor.lr, cfg.rollout.n, cfg.rollout.val_kwargs.top_p) == (2e-6, 8, 0.7)
    assert (cfg.reward.overlong_buffer.len, cfg.data.train_batch_size) == (8, 16)


def test_a_verl_key_the_table_does_not_hold_is_named_with_the_closest_that_it_does():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.optim.lrr: not a verl key this project maps; "
                                          r"verl's 'actor_rollout_ref.actor.optim.lr' is"):
        load_config(None, ["actor_rollout_ref.actor.optim.lrr=1e-6"])


def test_every_alias_names_a_key_here_and_the_docs_table_is_current():
    leaves = _leaf_keys()
    assert all(a.key is None or a.key in leaves for a in [*verl.ALIASES.values(), *verl.PREFIXES.values()])
    text = (ROOT / "docs/migrating-from-verl.md").read_text()
    block = text[text.index(verl.BEGIN) + len(verl.BEGIN):text.index(verl.END)].strip()
    assert block == verl.table(), ("docs/migrating-from-verl.md is stale: run "
                                   "`python -m megatron_dapo.config.docs --write docs/migrating-from-verl.md`")


def test_each_verl_key_without_effect_is_named_once_with_its_reason(tmp_path, capsys, monkeypatch):
    from megatron_dapo.config import ignored_keys, load_config_cli

    recipe = tmp_path / "verl.yaml"
    recipe.write_text("data:\n  return_raw_chat: true\nactor_rollout_ref:\n  rollout:\n    mode: async\n")
    monkeypatch.delenv("RANK", raising=False)
    cfg = load_config_cli(str(recipe), ["trainer.log_val_generations=10", "actor.lr=2e-6"])
    assert [k for k, _ in ignored_keys(cfg)] == ["data.return_raw_chat", "actor_rollout_ref.rollout.mode",
                                                 "trainer.log_val_generations"]
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"ignored: {k} ({why})" for k, why in ignored_keys(cfg)]
    assert "ignored: data.return_raw_chat (the raw prompt is always kept)" in lines
    monkeypatch.setenv("RANK", "3")  # under torchrun only global rank 0 prints them
    load_config_cli(str(recipe), [])
    assert capsys.readouterr().err == ""


def test_a_verl_model_path_implies_hf_arch_its_tokenizer_and_bf16_unless_given(tmp_path):
    recipe = tmp_path / "verl.yaml"
    recipe.write_text("actor_rollout_ref:\n  model:\n    path: /models/Qwen2.5-32B\n"
                      "data:\n  train_files: [/data/dapo.parquet]\n")
    cfg = load_config(str(recipe))
    assert (cfg.model.hf_path, cfg.model.arch, cfg.data.tokenizer, cfg.model.params_dtype) == \
        ("/models/Qwen2.5-32B", "hf", "/models/Qwen2.5-32B", "bf16")
    assert cfg.data.train_files == "/data/dapo.parquet"  # a list of one in YAML too, as on the command line
    cli = load_config(None, ["actor_rollout_ref.model.path=/m", "data.train_files=[/d.parquet]"])
    assert (cli.model.arch, cli.data.tokenizer, cli.model.params_dtype, cli.data.train_files) == \
        ("hf", "/m", "bf16", "/d.parquet")
    # what the configuration gives itself wins, whatever the order and wherever it is given
    given = load_config(None, ["model.arch=qwen2.5-32b", "actor_rollout_ref.model.path=/m", "model.params_dtype=fp32",
                               "data.tokenizer=/tok"])
    assert (given.model.arch, given.data.tokenizer, given.model.params_dtype) == ("qwen2.5-32b", "/tok", "fp32")
    recipe.write_text("model:\n  arch: qwen2.5-32b\nactor_rollout_ref:\n  model:\n    path: /m\n")
    mixed = load_config(str(recipe), ["data.tokenizer=/tok"])
    assert (mixed.model.arch, mixed.data.tokenizer, mixed.model.params_dtype) == ("qwen2.5-32b", "/tok", "bf16")
    with pytest.raises(ConfigError, match=r"data.train_files: .* 2 files"):
        recipe.write_text("data:\n  train_files: [a.parquet, b.parquet]\n")
        load_config(str(recipe))


def test_common_verl_keys_map_or_name_why_they_have_no_effect(tmp_path):
    from megatron_dapo.config import ignored_keys

    cfg = load_config(None, ["actor_rollout_ref.actor.megatron.optimizer_offload=True",
                             "trainer.max_actor_ckpt_to_keep=5", f"trainer.resume_from_path={tmp_path}/ckpt",
                             "trainer.resume_mode=resume_path", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
                             "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.0", "trainer.default_hdfs_dir=null",
                             "trainer.val_only=False", "actor_rollout_ref.actor.megatron.param_offload=True",
                             "actor_rollout_ref.hybrid_engine=True", "actor_rollout_ref.rollout.free_cache_engine=True",
                             "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]",
                             "actor_rollout_ref.rollout.calculate_log_probs=True"])
    assert cfg.actor.offload_optimizer and cfg.trainer.max_ckpt_to_keep == 5
    assert cfg.trainer.resume_mode == f"{tmp_path}/ckpt"  # verl's resume_path mode with its path, in either order
    why = dict(ignored_keys(cfg))
    assert "token count" in why["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]
    assert "offload_optimizer" in why["actor_rollout_ref.actor.megatron.param_offload"]
    assert len(why) == 10
    for item, reason in (("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "set actor.lr_warmup_steps"),
                         ("trainer.default_hdfs_dir=hdfs://x", "no HDFS copy here"),
                         ("trainer.val_only=True", "python -m megatron_dapo.eval"),
                         ("actor_rollout_ref.hybrid_engine=False", "rollout.mode=colocate")):
        with pytest.raises(ConfigError, match=reason):
            load_config(None, [item])


def test_hints_for_an_unmapped_verl_key_follow_its_meaning_not_its_spelling():
    for item, hint in (("actor_rollout_ref.rollout.optim.weight_decay=0.1",
                        "verl's 'actor_rollout_ref.actor.optim.weight_decay' is \\(here actor.weight_decay\\)"),
                       ("critic.optim.lr=1e-5", "verl's 'actor_rollout_ref.actor.optim.lr' is \\(here actor.lr\\)")):
        with pytest.raises(ConfigError, match=hint):
            load_config(None, [item])
    with pytest.raises(ConfigError) as e:  # nothing of that meaning: no hint (it suggested entropy_coeff once)
        load_config(None, ["actor_rollout_ref.actor.megatron.tensor_offload=True"])
    assert str(e.value).endswith("not a verl key this project maps (docs/migrating-from-verl.md)")
