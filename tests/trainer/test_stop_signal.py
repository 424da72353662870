"""A stop signal during a long generation (trainer/preemption.py): 2 gloo ranks drive the SGLang stand-in (its
own process, 0.5.23's protocol) through rank 0, decoding one token every 0.3 s, so the generation batch
would take minutes. SIGUSR1, forwarded to both ranks as the SLURM script does, cuts it: rank 0 aborts the
requests in flight, the complete groups are kept on disk, the cut groups' prompts go back to the sampler,
and both ranks exit with trainer.preemption_exit_code within seconds, not at the end of the batch. The
restarted job regenerates exactly the cut prompts (the kept groups are not generated again) and trains."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_dapo.data.tokenizer import CharTokenizer
from megatron_dapo.trainer import checkpoint as ckpt
from tests.standin import StandinServer, free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
STOP_BOUND_S = 45.0  # signal -> both ranks exited (the cut, the kept groups on disk, torchrun's teardown)
TOKEN_DELAY_S = 0.3  # a 6-prompt x 4 batch of up to 64 tokens: minutes uncut


def _cmd(url: str, out: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml",
            "rollout.engine=sglang", f"rollout.sglang_urls=[{url}]", "rollout.require_memory_saver=false",
            "trainer.n_gpus_per_node=2", "trainer.total_training_steps=1", "trainer.sft_warmup_steps=0",
            "algorithm.filter_groups.metric=seq_reward", "data.max_response_length=64",
            "reward.overlong_buffer.len=32", "data.train_batch_size=2", "data.gen_batch_size=6", "rollout.n=4",
            "actor.ppo_mini_batch_size=2", "trainer.test_freq=0", "trainer.val_before_train=false",
            "trainer.logger=[]", "trainer.save_freq=-1", "rollout.weight_sync_bucket_mb=1",
            f"trainer.output_dir={out}", f"trainer.rollout_data_dir={out}/dumps"]


def _prompts(bodies) -> list[tuple[int, ...]]:
    """The prompt of each group sent, in order (a request holds whole groups: n identical inputs each)."""
    items = [tuple(x) for b in bodies for x in (b["input_ids"] if isinstance(b["input_ids"][0], list)
                                                else [b["input_ids"]])]
    return items[::4]


@pytest.mark.multiproc
def test_a_stop_signal_cuts_a_long_generation_keeps_its_complete_groups_and_loses_no_prompt(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with StandinServer(toy=True, args=["--toy-vocab-size", str(CharTokenizer().vocab_size)],
                       log_dir=tmp_path) as server:
        server.knobs(token_delay_s=TOKEN_DELAY_S)
        job = subprocess.Popen(_cmd(server.url, tmp_path), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 300
            while not server.requests("/generate"):  # the generation batch is at the server
                assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-4000:]
                time.sleep(0.2)
            time.sleep(2.0)  # a few tokens into it
            signalled = time.monotonic()
            for rank in psutil.Process(job.pid).children():  # SLURM forwards USR1 to every rank
                rank.send_signal(signal.SIGUSR1)
            out, _ = job.communicate(timeout=300)
            stopped_after = time.monotonic() - signalled
            print(f"both ranks exited {stopped_after:.1f} s after the signal")
        finally:
            if job.poll() is None:
                job.kill()
        assert "exitcode  : 75" in out, out[-4000:]
        assert "stop signal: the generation in flight is aborted" in out, out[-4000:]
        assert stopped_after < STOP_BOUND_S, (stopped_after, out[-4000:])
        first = _prompts(server.requests("/generate"))
        state, parts = ckpt.load_inflight(str(tmp_path / "tiny_cpu/ckpt"))
        buffer = state["buffer"]
        complete = buffer["num_prompts"] + buffer["dropped_groups"]  # kept (informative) + filtered, all finished
        assert state["step"] == 1 and len(set(first)) == 6
        assert sum(len(p["raw_prompt"]) // 4 for p in parts) == buffer["num_prompts"]

        server.reset()
        server.knobs(token_delay_s=0.0)
        r = subprocess.run(_cmd(server.url, tmp_path), cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        again = _prompts(server.requests("/generate"))
    # The cut prompts come first, each once; the complete groups are never generated again.
    cut = 6 - complete
    assert sorted(again[:cut]) == sorted(set(again[:cut])) and set(again[:cut]) <= set(first)
    assert not set(again[cut:]) & set(first)
