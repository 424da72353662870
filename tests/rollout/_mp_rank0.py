"""torchrun --nproc_per_node 2 (see test_rank0.py): rank 0 drives a slow engine while the default group's
timeout is 3 s; the batch reaches rank 1 as tensors; an engine error reaches both ranks; rewards scored
once (sharded, gathered) are equal on both ranks even when rank 1's reward calls time out; a streaming
batch is scored on rank 0 as its groups complete and reaches rank 1 without tokens."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_dapo.data.dataset import PromptRecord
from megatron_dapo.parallel import destroy_parallel, init_parallel
from megatron_dapo.rewards.manager import RewardManager
from megatron_dapo.rollout.base import PromptInput, RolloutEngine, Sample, SamplingParams
from megatron_dapo.rollout.ragged import RaggedRows, share_kept_rows, to_dense
from megatron_dapo.rollout.rank0 import DriverError, RankZeroEngine
from megatron_dapo.trainer import stages
from megatron_dapo.trainer.dynamic_sampling import StopWhenFull


class SlowEngine(RolloutEngine):
    """Rank 0's engine: sleeps past the default group's timeout, then answers (or raises)."""

    supports_streaming = True

    def __init__(self, delay_s: float, fail: bool = False, abort_all: bool = True):
        self.delay_s, self.fail, self.abort_all = delay_s, fail, abort_all

    def generate(self, prompts, sampling):
        time.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("server http://10.0.0.7:30000 refused the request")
        out = []
        for p in prompts:
            for j in range(sampling.n):
                L = (len(p.token_ids) * 3 + j) % sampling.max_new_tokens
                aborted = j == 2 and (self.abort_all or p is prompts[0])
                reason = "abort" if aborted else ("length" if L == sampling.max_new_tokens else "stop")
                out.append(Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids,
                                  response_token_ids=tuple(range(3, 3 + L)),
                                  rollout_log_probs=tuple(-0.1 * (k + 1) for k in range(L)), finish_reason=reason,
                                  policy_version=7, meta={"spec_verify_ct": j} if j == 1 else {}))
        return out

    def generate_streaming(self, prompts, sampling, *, on_groups_done):
        """The groups in two reports (the complete ones only), as replies arriving at two moments."""
        samples = self.generate(prompts, sampling)
        groups = [samples[k:k + sampling.n] for k in range(0, len(samples), sampling.n)]
        complete = [g for g in groups if all(s.finish_reason != "abort" for s in g)]
        for part in (complete[:1], complete[1:]):
            if part:
                on_groups_done(part)
        return samples

    def update_weights(self, named_tensors=None, *, policy_version, **kw): ...
    def abort(self): ...
    def release_memory(self): ...
    def resume_memory(self): ...
    def health(self): return {"healthy": True, "policy_version": 7}

    @property
    def policy_version(self):
        return 7


def rank_dependent_reward(solution_str, ground_truth):
    """Slow on rank 1 (its calls time out there), instant on rank 0."""
    if os.environ.get("RANK") == "1":
        time.sleep(5)
    return {"score": float(len(solution_str) % 3 == 0), "acc": len(solution_str) % 3 == 0, "pred": solution_str[:2]}


class Tok:
    pad_id, eos_id, vocab_size = 0, 1, 64

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def _arrive_together(out_dir: str, deadline_s: float = 300.0) -> None:
    """Both ranks reach init_process_group at once: its 3 s timeout bounds the group's rendezvous too, which a
    rank still importing on a loaded machine missed ("wait timeout after 3000ms" at init)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    open(os.path.join(out_dir, f"arrived.{rank}"), "w").close()
    deadline = time.monotonic() + deadline_s
    while not all(os.path.exists(os.path.join(out_dir, f"arrived.{r}")) for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other ranks did not start within {deadline_s} s")
        time.sleep(0.05)


def main(out_dir: str) -> None:
    _arrive_together(out_dir)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))  # the default group times out fast
    pgs = init_parallel()
    rank = pgs.rank
    prompts = [PromptInput(prompt_id=f"p{i}", token_ids=tuple(range(2, 4 + i))) for i in range(3)]
    sampling = SamplingParams(max_new_tokens=6, n=4)
    eng = RankZeroEngine(SlowEngine(delay_s=6.0) if rank == 0 else None, rank=rank, world_size=2, group=pgs.ctrl)
    batch = eng.generate_batch(prompts, sampling, pad_id=0, max_response_length=8)
    # Each rank holds the token entries of its own rows only (rank 0: every row), then all of them dense.
    held = {"held_rows": batch.responses.present.nonzero().squeeze(1).tolist(),
            "held_values": int(batch.responses.values.numel() + batch.rollout_log_probs.values.numel())}
    shared = share_kept_rows(batch, group=pgs.ctrl)
    # the training batch: log-probs dense, ids still ragged (every row present), read in place by the actor
    held["ragged_ids"] = [isinstance(getattr(shared, f), RaggedRows) and getattr(shared, f).complete
                          for f in ("prompt_ids", "responses", "rollout_log_probs")]
    torch.save({**{k: v for k, v in vars(to_dense(shared)).items()}, **held}, f"{out_dir}/batch{rank}.pt")

    failing = RankZeroEngine(SlowEngine(delay_s=0.5, fail=True) if rank == 0 else None, rank=rank, world_size=2,
                             group=pgs.ctrl)
    try:
        failing.generate_batch(prompts, sampling, pad_id=0, max_response_length=8)
        message = "no error"
    except DriverError as e:
        message = str(e)
    with open(f"{out_dir}/error{rank}.txt", "w") as f:
        f.write(message)

    records = [PromptRecord(uid=p.prompt_id, prompt_ids=list(p.token_ids), raw_prompt="q", ground_truth="g",
                            data_source="toy") for p in prompts]
    with RewardManager(rank_dependent_reward, max_response_length=8, on_error="penalize", error_score=-1.0,
                       timeout_s=1.0) as rm:
        scored = stages.score(batch, records, n=4, tokenizer=Tok(), reward_manager=rm, group=pgs.ctrl)
    torch.save({"scores": scored.scores, "rewards": scored.rewards, "extra": scored.extra,
                "texts": scored.response_text}, f"{out_dir}/scored{rank}.pt")

    # The sync trainer on SGLang: rank 0 scores each complete group in the engine's callback; rank 1 receives
    # the batch without tokens and every row's values after generation (texts stay on rank 0).
    streaming = RankZeroEngine(SlowEngine(delay_s=0.5, abort_all=False) if rank == 0 else None, rank=rank,
                               world_size=2, group=pgs.ctrl)
    with RewardManager(rank_dependent_reward, max_response_length=8, on_error="penalize", error_score=-1.0,
                       timeout_s=1.0) as rm:
        stop = StopWhenFull.scoring_only(metric="acc", score_groups=stages.group_scorer(
            records, group_suffix="s", n=4, tokenizer=Tok(), reward_manager=rm))
        rows = stages.generate(streaming, records, sampling, group_suffix="s", pad_id=0, max_response_length=8,
                               on_groups_done=stop)
        in_callback = sorted(stop.scored)
        streamed = stages.score_streamed(rows, records, stop.scored, n=4, tokenizer=Tok(), reward_manager=rm,
                                         group=pgs.ctrl)
    torch.save({"scores": streamed.scores, "extra": streamed.extra, "texts": streamed.response_text,
                "held_rows": rows.responses.present.nonzero().squeeze(1).tolist(), "in_callback": in_callback,
                "responses": share_kept_rows(rows, group=pgs.ctrl).responses.dense()}, f"{out_dir}/streamed{rank}.pt")
    destroy_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1]))  # as python -m megatron_dapo.train ends
