"""Build every part from the config and run `fit`: the body of `python -m megatron_dapo.train`."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import re
import sys
import threading
import time
import warnings
from typing import NoReturn

import torch

from megatron_dapo.config import Config, ConfigError, to_dict, to_yaml
from megatron_dapo.trainer.schedule import schedule

log = logging.getLogger("megatron_dapo")


def _engine(cfg: Config, actor, pgs, tokenizer):
    if cfg.rollout.engine == "local":
        from megatron_dapo.models.forward import unwrap_model
        from megatron_dapo.rollout.local_engine import LocalEngine

        if len(actor.policy.chunks) > 1:
            raise ValueError("rollout.engine=local needs parallel.virtual_pipeline_model_parallel_size=null")
        # Every rank generates the same batch (SPMD): a streaming stop is decided on rank 0 for all.
        return LocalEngine(unwrap_model(actor.policy.chunks[0]), pgs=pgs, eos_token_id=tokenizer.eos_id,
                           pad_token_id=tokenizer.pad_id, max_batch_size=cfg.rollout.max_num_seqs,
                           decision_group=pgs.ctrl if pgs.world_size > 1 else None)
    from megatron_dapo.rollout.sglang.build import build_engine

    return build_engine(cfg, pgs, vocab_size=tokenizer.vocab_size)


def weight_sync(cfg: Config, parts):
    """The per-step actor -> engine sync: the local engine shares the actor's weights (only the version
    changes); SGLang servers are pushed every tensor (rollout/sglang/build.py weight_push)."""
    if cfg.rollout.engine == "local":
        return lambda version: parts.engine.update_weights(None, policy_version=version)
    from megatron_dapo.rollout.sglang.build import weight_push
    from megatron_dapo.workers.memory import free_for_rollout

    return weight_push(cfg, pgs=parts.pgs, engine=parts.engine, chunks=parts.actor.policy.chunks,
                       vocab_size=parts.tokenizer.vocab_size, free_memory=lambda: free_for_rollout(parts.actor.offload))


def build_parts(cfg: Config):
    from megatron_dapo.algos.advantage import get_adv_estimator_fn
    from megatron_dapo.algos.kl import get_kl_controller
    from megatron_dapo.data.build import build_datasets
    from megatron_dapo.data.sampler import ResumableSampler
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.metrics import MetricsLogger
    from megatron_dapo.parallel import init_parallel
    from megatron_dapo.rewards.build import build_reward_manager
    from megatron_dapo.trainer.fit import TrainerParts
    from megatron_dapo.workers.build import build_actor

    par = cfg.parallel
    pgs = init_parallel(tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
                        ep=par.expert_model_parallel_size, cp=par.context_parallel_size,
                        etp=par.expert_tensor_parallel_size, vpp=par.virtual_pipeline_model_parallel_size,
                        seed=cfg.trainer.seed)
    if pgs.world_size != cfg.trainer.world_size:
        raise ValueError(f"trainer.nnodes * trainer.n_gpus_per_node = {cfg.trainer.world_size} but the job has "
                         f"{pgs.world_size} processes")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if pgs.device.type == "cuda":  # refuse a layout that cannot fit before building anything
        from megatron_dapo.models.config_arch import model_arch
        from megatron_dapo.plan import check_fits, format_plan, plan_from_config

        gib = torch.cuda.get_device_properties(pgs.device).total_memory / 2**30
        from megatron_dapo.models.builder import default_backend

        plan = plan_from_config(cfg, arch=model_arch(cfg, vocab_size=tokenizer.vocab_size), gpu_memory_gib=gib,
                                backend=default_backend(pgs.device))
        log.info("memory plan:\n%s", format_plan(plan))
        check_fits(plan)
    train, val = build_datasets(cfg, tokenizer)
    length = schedule(cfg, prompts=len(train))
    if pgs.rank == 0:
        log.info("schedule: %s", length.describe())
        if length.problem():
            log.warning("%s", length.problem())
    rm = build_reward_manager(cfg)
    actor = build_actor(cfg, pgs, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    sampler = ResumableSampler(len(train), cfg.data.effective_gen_batch_size, seed=cfg.data.seed,
                               shuffle=cfg.data.shuffle)
    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = (get_kl_controller(kc.type, kc.kl_coef, target_kl=kc.target_kl, horizon=kc.horizon)
               if cfg.algorithm.use_kl_in_reward else None)
    logger = None
    if pgs.rank == 0:
        logger = MetricsLogger(os.path.join(cfg.run_dir, "tb") if "tensorboard" in cfg.trainer.logger else None,
                               backends=tuple(cfg.trainer.logger), total_steps=cfg.trainer.total_training_steps,
                               project=cfg.trainer.project_name, experiment=cfg.trainer.experiment_name,
                               wandb_dir=cfg.run_dir, config=to_dict(cfg))
    parts = TrainerParts(actor=actor, engine=_engine(cfg, actor, pgs, tokenizer), tokenizer=tokenizer,
                         reward_manager=rm, train_data=train, val_data=val, sampler=sampler, logger=logger, pgs=pgs,
                         adv_fn=get_adv_estimator_fn(cfg.algorithm.adv_estimator), kl_ctrl=kl_ctrl,
                         reference=None)
    parts.sync_weights = weight_sync(cfg, parts)
    return parts


def _warmup_probe(cfg: Config, parts):
    """The warm-up's accuracy check (trainer.sft_warmup_target_acc): mean@n with rollout.val_kwargs on the
    first sft.PROBE_SIZE training problems, rank 0's value on every rank (all ranks stop together)."""
    from megatron_dapo.data.dataset import PromptDataset
    from megatron_dapo.trainer.sft import PROBE_SIZE
    from megatron_dapo.trainer.validate import validate

    subset = PromptDataset([parts.train_data[i] for i in range(min(PROBE_SIZE, len(parts.train_data)))])

    def probe() -> float:
        out = validate(parts.engine, subset, cfg, tokenizer=parts.tokenizer, reward_manager=parts.reward_manager,
                       seed=cfg.trainer.seed, group=parts.pgs.ctrl)
        accs = [v for k, v in out.items() if "/acc/mean@" in k]
        acc = torch.tensor([sum(accs) / len(accs)], device=parts.pgs.device)
        if torch.distributed.is_initialized() and parts.pgs.world_size > 1:
            torch.distributed.broadcast(acc, src=0)
        return float(acc.item())

    return probe


def close_parts(parts) -> None:
    """Release what build_parts opened: reward workers, SGLang weight-update groups, the engine (and the
    servers it launched), the metric sinks."""
    parts.reward_manager.close()
    sync = getattr(parts.sync_weights, "sync", None)  # SGLang weight-update groups
    if sync is not None:
        sync.close()
    parts.engine.close()
    if parts.logger is not None:
        parts.logger.close()
    from megatron_dapo.trainer.rundir import release_run_directories

    release_run_directories()


def _check_fresh_start(cfg: Config) -> None:
    """trainer.resume_mode=disable where checkpoints already are would mix two runs' steps, and the new run's
    pruning (max_ckpt_to_keep) would delete its own checkpoints as older than the old run's: refused."""
    import glob

    found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(cfg.ckpt_dir, "global_step_*")))
    if cfg.trainer.resume_mode == "disable" and found:
        raise ConfigError("trainer.resume_mode", f"disable, but {cfg.ckpt_dir} holds checkpoints ({', '.join(found)}) "
                          "that a fresh run there would mix with its own and prune: resume them (auto), or give this "
                          "run its own trainer.experiment_name or trainer.default_local_dir")


def build_trainer(cfg: Config):
    """Parts, the supervised warm-up, the reference (when a KL term is used), then the trainer:
    the queue trainer when `queue.enable`, else the sync `DAPOTrainer`."""
    from megatron_dapo.trainer.rundir import lock_run_directory

    if int(os.environ.get("RANK", "0")) == 0:  # before anything is written: a second job on the directory refuses
        lock_run_directory(cfg.run_dir)
        if os.path.commonpath([os.path.abspath(cfg.ckpt_dir), os.path.abspath(cfg.run_dir)]) != \
                os.path.abspath(cfg.run_dir):  # checkpoints elsewhere (trainer.default_local_dir)
            lock_run_directory(cfg.ckpt_dir)
    _check_fresh_start(cfg)
    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    prestarted = None
    if cfg.queue.enable and cfg.queue.max_staleness != 0 and cfg.rollout.engine == "sglang" \
            and int(os.environ.get("RANK", "0")) == 0:  # its start overlaps the model's build
        from megatron_dapo.trainer.server_producers import prestart

        prestarted = prestart(cfg)
    try:
        return _build_trainer(cfg, prestarted)
    except BaseException:
        if prestarted is not None:
            prestarted.close()
        raise


def _build_trainer(cfg: Config, prestarted):
    from megatron_dapo.data.arithmetic import arithmetic_sft_examples
    from megatron_dapo.trainer.fit import DAPOTrainer
    from megatron_dapo.trainer.sft import sft_warmup
    from megatron_dapo.workers.build import build_reference

    parts = build_parts(cfg)
    if cfg.trainer.sft_warmup_steps and cfg.data.task == "arithmetic":
        m = sft_warmup(parts.actor, arithmetic_sft_examples(parts.train_data, parts.tokenizer), cfg,
                       pad_id=parts.tokenizer.pad_id, rank=parts.pgs.rank,
                       probe=_warmup_probe(cfg, parts) if cfg.trainer.sft_warmup_target_acc > 0 else None)
        log.info("supervised warm-up: %s", m)
    if cfg.needs_reference:  # a frozen copy of the (warmed-up) initial policy
        parts.reference = build_reference(cfg, parts.pgs, vocab_size=parts.tokenizer.vocab_size,
                                          pad_id=parts.tokenizer.pad_id, actor=parts.actor)
    freeze_startup_objects()
    if cfg.queue.enable:
        from megatron_dapo.trainer.queue_trainer import QueueTrainer

        return QueueTrainer(cfg, parts, prestarted=prestarted)
    if prestarted is not None:
        prestarted.close()
    return DAPOTrainer(cfg, parts)


def freeze_startup_objects() -> None:
    """Take what was built so far (modules, the model, datasets: about half a million objects) out of the
    cyclic garbage collector's full passes, which would otherwise walk all of it every time enough new
    containers survive. Parsing a 16 x 6k-token SGLang reply creates ~100k lists: with the startup objects
    frozen, the client's CPU per response token falls from 1.6 to 0.7 us (measured in a process holding
    torch and Megatron-Core, docs/benchmarks.md). Megatron-LM's --manual-gc answers the same stalls on
    training ranks."""
    gc.collect()
    gc.freeze()
    # At exit they go back to the collector: frozen objects are never finalized, so extension modules
    # (nanobind, in Triton) would report them as leaked on every run's last line.
    atexit.register(gc.unfreeze)


def exit_process(code: int | None) -> NoReturn:
    """End this process as the interpreter's own exit does, less the teardown after it: threading's exit
    hooks and the join of every non-daemon thread (`threading._shutdown`, the interpreter's first step at
    exit), then the atexit handlers (logging's flush, multiprocessing's joins of its children, W&B's finish,
    gc.unfreeze), stdout and stderr flushed, and `os._exit(code)`. Skipped: the module teardown and the
    garbage collections over every object the process holds, about 1 s of CPU per process holding torch
    and Megatron-Core (docs/benchmarks.md), paid by every rank at every exit. What the run wrote is on
    disk by then: `run` closes the logger, the reward workers and the engine before it returns.
    An exception leaves the normal way (its traceback, exit code 1)."""
    try:
        threading._shutdown()
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed by the process itself
                pass
    os._exit(code or 0)


def _exhausted_hint(cfg: Config) -> str:
    """Why nearly every group may be constant when the policy starts from nothing it was taught."""
    if cfg.model.hf_path or cfg.trainer.sft_warmup_steps > 0:
        return ""
    return ("; the policy starts from random weights (model.hf_path is empty) without a supervised warm-up "
            "(trainer.sft_warmup_steps=0), so almost no answer is right: set trainer.sft_warmup_steps "
            "(the embedded default's configs/tiny_cpu.yaml sets it) or start from a model")


def quiet_libraries() -> None:
    """Keep the log to what a user acts on: Megatron-Core's notices that it falls back from Transformer
    Engine / Apex (expected on CPU), its deprecation warnings, and its INFO lines (every parameter of every
    gradient bucket, the DDP and optimizer configs) are dropped; its own warnings and errors stay."""
    notices = ("Transformer Engine and Apex are not installed", "Apex is not installed", "full scope is deprecated")
    for text in notices:
        warnings.filterwarnings("ignore", message=re.escape(text))
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"megatron\.")
    # the processes this one starts (the asynchronous checkpoint writer, producers) import Megatron too
    mine = [f"ignore:{text}" for text in notices]
    given = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    os.environ["PYTHONWARNINGS"] = ",".join(given + [w for w in mine if w not in given])
    logging.getLogger("megatron.core").setLevel(logging.WARNING)


def run(cfg: Config) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_libraries()
    t0 = time.time()
    from megatron_dapo.data.dataset import DatasetError

    try:
        trainer = build_trainer(cfg)
    except DatasetError as e:  # a data file or row that cannot be used: one line, like a config error
        print(f"data error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:  # found while building (a reward file, a checkpoint directory): still one line
        print(f"config error: {e}", file=sys.stderr)
        return 2
    parts = trainer.p
    from megatron_dapo.trainer.dynamic_sampling import DynamicSamplingExhausted
    from megatron_dapo.trainer.mismatch import MismatchAlarmError
    from megatron_dapo.trainer.preemption import Preempted

    preempted = None
    try:
        val = trainer.fit()
    except Preempted as p:
        preempted = p
        log.warning("%s; exiting with trainer.preemption_exit_code=%d (resume_mode=auto continues from it)", p,
                    cfg.trainer.preemption_exit_code)
    except (DynamicSamplingExhausted, MismatchAlarmError) as e:  # every rank decides alike: one line, like a config error
        if parts.pgs.rank == 0:
            print(f"training error: {e}{_exhausted_hint(cfg)}", file=sys.stderr)
        return 2
    finally:
        close_parts(parts)
    if preempted is not None:
        torch.distributed.barrier() if torch.distributed.is_initialized() and parts.pgs.world_size > 1 else None
        return cfg.trainer.preemption_exit_code
    if parts.pgs.rank == 0:
        kind = f"queue trainer, {'sync' if trainer.sync_mode else 'async'} mode" if cfg.queue.enable else "sync trainer"
        began = getattr(trainer, "start_step", 0)
        if began and trainer.global_step == began:  # resumed at its last step: nothing was trained
            print(f"\ndone: nothing to train, the checkpoint in {cfg.ckpt_dir} is at step {began}, "
                  f"trainer.total_training_steps (a new run: another trainer.experiment_name)")
        else:
            resumed = f", {trainer.global_step - began} of them in this run" if began else ""
            print(f"\ndone: {trainer.global_step} steps{resumed} in {time.time() - t0:.0f} s ({kind})")
        first_step, first = trainer.first_val or (None, {})
        for k, v in sorted((k, v) for k, v in val.items() if k.startswith("val/")):  # not verl's duplicates
            since = f"  (step {first_step}: {first[k]:.4f})" if k in first and first_step != trainer.global_step else ""
            print(f"  {k} = {v:.4f}{since}")
        print(f"TensorBoard: tensorboard --logdir {os.path.join(cfg.run_dir, 'tb')} --host 127.0.0.1")
    torch.distributed.barrier() if torch.distributed.is_initialized() and parts.pgs.world_size > 1 else None
    return 0
