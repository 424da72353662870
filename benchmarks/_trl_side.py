"""The TRL half of bench_vs_trl.py: TRL's GRPOTrainer (loss_type="dapo") on the same workload.

Run by bench_vs_trl.py with the separate TRL environment's interpreter (.venv-trl/bin/python):
it must not import megatron_dapo, so everything it needs arrives in one JSON file written by
the main script:

    {"vocab": ["<pad>", "<bos>", "<eos>", "0", ...],   # token strings in id order
     "pad_id": 0, "bos_id": 1, "eos_id": 2,
     "prompts": [{"prompt": "12+7=", "ground_truth": "19"}, ...],  # in the order they are consumed
     "init_hf_dir": "/tmp/.../init_hf",            # config.json + model.safetensors (Qwen2)
     "probe": {"ids": [1, 4, 13, ...], "logits": [[...], ...]},   # [S] ids, [S, V] our logits
     "model": {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 768, "num_attention_heads": 4,
               "num_query_groups": 2},                     # checked against init_hf_dir/config.json
     "train": {"prompts_per_step": 8, "n": 8, "max_new_tokens": 8, "min_new_tokens": 0, "lr": ..., "clip_grad": ...,
               "adam_beta1": ..., "adam_beta2": ..., "adam_eps": ..., "weight_decay": ...,
               "temperature": 1.0, "seed": 42, "warmup_steps": 2, "timed_steps": 8}}

Model: transformers' Qwen2ForCausalLM loaded from `init_hf_dir`, the main side's randomly initialised
Megatron model exported as an HF checkpoint (RMSNorm, RoPE, QKV bias, SwiGLU, untied embeddings),
fp32, CPU. Before training it checks its logits on `probe.ids` against the main side's
`probe.logits` (max abs difference <= 1e-3), so both trainers start from the same policy.
Tokenizer: a PreTrainedTokenizerFast built in memory from the character vocabulary (one token per
character, "<bos>" prepended, as the main side's prompts are). Reward: 1.0 when the completion is
exactly the right integer, else 0.0 (the rule of megatron_dapo.rewards.arithmetic).

Generation: HF generate with TRL's settings; min_new_tokens > 0 goes in through
GRPOConfig.generation_kwargs (transformers' MinNewTokensLengthLogitsProcessor keeps EOS out before it).

Phases: `time_phases` wraps `_generate` (generation), `_get_per_token_logps_and_entropies` while inside
`_generate_and_score_completions` (the old-log-prob forward; TRL skips it here) and
`_generate_and_score_completions` itself; a step's update time is the step time outside the latter
(the loss forward, backward and the optimizer step).

Timing: a TrainerCallback reads perf_counter (and process CPU time) at on_step_begin and
on_step_end; generation, reward, advantages, forward/backward and the optimizer step all happen
between the two (TRL's Trainer logs after on_step_end, as our fit() does after its timer). Tokens
per step are the growth of `state.num_input_tokens_seen`, which TRL advances by the prompt plus
completion tokens of each generation batch. The first `warmup_steps` steps are left out.

Last line of stdout: one JSON object with per-step seconds and tokens and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import time

_INTEGER_RE = re.compile(r"-?\d+")


def integer_reward(completions: list[str], ground_truth: list[str], **_) -> list[float]:
    """1.0 when a completion is exactly the ground-truth integer (surrounding spaces ignored)."""
    out = []
    for text, truth in zip(completions, ground_truth, strict=True):
        body = text.strip()
        out.append(1.0 if _INTEGER_RE.fullmatch(body) and int(body) == int(truth) else 0.0)
    return out


def build_tokenizer(vocab: list[str], *, pad_id: int, bos_id: int, eos_id: int):
    """A character-level PreTrainedTokenizerFast over `vocab`; encoding prepends <bos>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = {pad_id: "pad", bos_id: "bos", eos_id: "eos"}
    tk = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token=vocab[pad_id]))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tk.decoder = decoders.Fuse()  # join characters back without separators
    tk.post_processor = processors.TemplateProcessing(single=f"{vocab[bos_id]} $A",
                                                      special_tokens=[(vocab[bos_id], bos_id)])
    named = {f"{name}_token": vocab[i] for i, name in specials.items()}  # pad_token=..., bos_token=..., ...
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, **named)
    tok.padding_side = "left"
    return tok


def fwd_bwd_seconds(model, tok, rows: list[dict], tr: dict, *, vocab: int) -> float:
    """Median time of one plain forward + backward of a step's batch (prompts_per_step x n rows, the
    longest prompt + max_new_tokens positions), no generation, no optimizer: a floor for any step."""
    import torch

    width = max(len(tok(r["prompt"])["input_ids"]) for r in rows[:tr["prompts_per_step"]]) + tr["max_new_tokens"]
    ids = torch.randint(0, vocab, (tr["prompts_per_step"] * tr["n"], width),
                        generator=torch.Generator().manual_seed(0))
    model.train()
    times = []
    for i in range(7):
        t0 = time.perf_counter()
        model(ids).logits.float().log_softmax(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        if i >= 2:  # first calls: allocator warm-up
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def time_phases(trainer, timer) -> None:
    """Wrap three GRPOTrainer methods on this instance so that each step's timer.acc gets the seconds
    of generation (`_generate`), of the old-log-prob forward (`_get_per_token_logps_and_entropies`
    called inside `_generate_and_score_completions`; the loss's own forward is outside it) and of
    the whole generate-and-score stage (`prepare`). The trainer calls them through self, so the
    instance attributes take effect."""
    inside = [False]

    def timed(fn, key, *, only_inside=False, marks=False):
        def wrapper(*a, **kw):
            if only_inside and not inside[0]:
                return fn(*a, **kw)
            if marks:
                inside[0] = True
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timer.acc[key] = timer.acc.get(key, 0.0) + time.perf_counter() - t0
                if marks:
                    inside[0] = False
        return wrapper

    for name in ("_generate", "_get_per_token_logps_and_entropies", "_generate_and_score_completions"):
        if not callable(getattr(trainer, name, None)):
            raise RuntimeError(f"GRPOTrainer has no method {name} in this TRL release: the phase timers need it")
    trainer._generate = timed(trainer._generate, "gen")
    trainer._get_per_token_logps_and_entropies = timed(trainer._get_per_token_logps_and_entropies, "old_log_prob",
                                                       only_inside=True)
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "prepare", marks=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="JSON file written by bench_vs_trl.py")
    args = ap.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    tr, m = spec["train"], spec["model"]
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))

    import accelerate
    import datasets
    import torch
    import transformers
    import trl
    from transformers import Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    tok = build_tokenizer(spec["vocab"], pad_id=spec["pad_id"], bos_id=spec["bos_id"], eos_id=spec["eos_id"])
    probe = spec["prompts"][0]["prompt"]
    if tok(probe)["input_ids"] != [spec["bos_id"]] + [spec["vocab"].index(c) for c in probe]:
        raise RuntimeError(f"tokenizer check failed on {probe!r}: got {tok(probe)['input_ids']}")

    model = Qwen2ForCausalLM.from_pretrained(spec["init_hf_dir"], dtype=torch.float32)
    cfg = model.config
    expected = {"num_hidden_layers": m["num_layers"], "hidden_size": m["hidden_size"],
                "intermediate_size": m["ffn_hidden_size"], "num_attention_heads": m["num_attention_heads"],
                "num_key_value_heads": m["num_query_groups"], "vocab_size": len(spec["vocab"]),
                "tie_word_embeddings": False}
    wrong = {k: (getattr(cfg, k), v) for k, v in expected.items() if getattr(cfg, k) != v}
    if wrong:
        raise RuntimeError(f"{spec['init_hf_dir']}/config.json differs from the workload "
                           f"(got, expected): {wrong}")
    with torch.no_grad():
        logits = model(torch.tensor([spec["probe"]["ids"]])).logits[0]
    max_diff = (logits - torch.tensor(spec["probe"]["logits"])).abs().max().item()
    if max_diff > 1e-3:  # fp32, same weights: only summation-order round-off differs
        raise RuntimeError(f"the loaded model's probe logits differ from ours by {max_diff:.3g} (> 1e-3)")
    n_params = sum(p.numel() for p in model.parameters())

    total_steps = tr["warmup_steps"] + tr["timed_steps"]
    n_prompts = total_steps * tr["prompts_per_step"]
    rows = spec["prompts"][:n_prompts]
    if len(rows) < n_prompts:
        raise ValueError(f"spec has {len(spec['prompts'])} prompts, the run needs {n_prompts}")
    train = datasets.Dataset.from_list(rows)

    out_dir = tempfile.mkdtemp(prefix="bench_trl_")
    gcfg = GRPOConfig(
        output_dir=out_dir, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0,
        num_generations=tr["n"], per_device_train_batch_size=tr["prompts_per_step"] * tr["n"],
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=tr["max_new_tokens"],
        temperature=tr["temperature"], top_p=1.0, top_k=0, scale_rewards="group",
        mask_truncated_completions=False, generation_kwargs=({"min_new_tokens": tr["min_new_tokens"]}
                                                             if tr["min_new_tokens"] else None),
        learning_rate=tr["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=tr["weight_decay"], adam_beta1=tr["adam_beta1"],
        adam_beta2=tr["adam_beta2"], adam_epsilon=tr["adam_eps"], max_grad_norm=tr["clip_grad"],
        max_steps=total_steps, shuffle_dataset=False, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        seed=tr["seed"], dataloader_num_workers=0, log_completions=False)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self.cpu_seconds: list[float] = []
            self.tokens: list[int] = []
            self.phases: list[dict[str, float]] = []
            self.acc: dict[str, float] = {}
            self._t0 = self._c0 = 0.0
            self._seen = 0

        def on_step_begin(self, args, state, control, **kw):
            self.acc = {"gen": 0.0, "old_log_prob": 0.0, "prepare": 0.0}
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            self.seconds.append(time.perf_counter() - self._t0)
            self.cpu_seconds.append(time.process_time() - self._c0)
            self.tokens.append(int(state.num_input_tokens_seen) - self._seen)
            self._seen = int(state.num_input_tokens_seen)
            a = self.acc  # update: everything outside generate-and-score (loss, backward, optimizer)
            self.phases.append({"gen": a["gen"], "old_log_prob": a["old_log_prob"],
                                "update": self.seconds[-1] - a["prepare"]})

    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=integer_reward, args=gcfg, train_dataset=train,
                          processing_class=tok, callbacks=[timer])
    time_phases(trainer, timer)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    wall = time.perf_counter() - t0
    if len(timer.seconds) != total_steps:
        raise RuntimeError(f"expected {total_steps} optimizer steps, TRL ran {len(timer.seconds)}")
    w = tr["warmup_steps"]
    secs, toks = timer.seconds[w:], timer.tokens[w:]
    phase_seconds = {k: sum(p[k] for p in timer.phases[w:]) for k in ("gen", "old_log_prob", "update")}
    floor = fwd_bwd_seconds(model, tok, rows, tr, vocab=len(spec["vocab"]))
    print(f"TRL {trl.__version__}: {total_steps} steps in {wall:.1f} s; timed steps "
          f"{' '.join(f'{s:.2f}' for s in secs)} s; tokens {toks}")
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                "accelerate": accelerate.__version__, "datasets": datasets.__version__}
    print(json.dumps({"seconds": secs, "tokens": toks, "cpu_seconds": timer.cpu_seconds[w:],
                      "probe_logits_max_abs_diff": max_diff, "warmup_seconds": timer.seconds[:w],
                      "wall_s": wall, "params": n_params, "threads": torch.get_num_threads(),
                      "hf_fwd_bwd_s": floor, "phase_seconds": phase_seconds,
                      "versions": versions}))


if __name__ == "__main__":
    main()
