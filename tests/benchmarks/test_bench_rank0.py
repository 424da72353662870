"""bench_rank0.py's replay server answers in the recorded SGLang 0.5.23 reply's shape, at the stated lengths."""

import importlib.util
import json
import math
import pathlib
import statistics

import orjson
import pytest

from megatron_dapo.rollout.sglang.payloads import parse_generate_output

ROOT = pathlib.Path(__file__).resolve().parents[2]
ASSETS = ROOT / "benchmarks" / "assets"
_spec = importlib.util.spec_from_file_location("bench_rank0", ROOT / "benchmarks" / "bench_rank0.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_capped_lognormal_mu_gives_the_stated_capped_mean():
    for mean, sigma, cap in ((6000, 0.8, 20480), (500, 1.0, 4096)):
        mu = bench.capped_lognormal_mu(mean, sigma, cap)
        d = statistics.NormalDist(mu, sigma)
        n = 200_000  # the capped mean by quadrature over the quantiles
        got = sum(min(math.exp(d.inv_cdf((i + 0.5) / n)), cap) for i in range(n)) / n
        assert abs(got - mean) / mean < 1e-3


def test_replay_replies_have_the_recorded_keys_in_order_and_parse_as_the_client_parses_them():
    rows = 64
    server = bench.ReplayServer(0, rows=rows, mean_len=300, sigma=0.8, max_len=2048, window_s=10.0)
    try:
        recorded = json.loads((ASSETS / "sglang-0.5.23-generate-reply.json").read_bytes())[0]
        rids = [f"call-0.0.{j:02d}" for j in range(bench.N)]
        lengths = []
        for g in range(rows // bench.N):
            data, due = server.reply({"input_ids": [bench.prompt_ids(g)] * bench.N, "rid": rids})
            items = orjson.loads(data)
            assert 0 < due <= 10.0
            for j, item in enumerate(items):
                assert list(item) == list(recorded)
                assert list(item["meta_info"]) == [k for k in recorded["meta_info"] if k != "routed_experts"]
                assert item["meta_info"]["id"] == rids[j]
                parsed = parse_generate_output(item, request="r", max_new_tokens=2048)
                assert parsed.token_ids.tolist() == item["output_ids"]
                ends = parsed.finish_reason == "stop"  # the stop token, last, has no text (skip_special_tokens)
                assert len(item["text"]) == len(item["output_ids"]) - ends
                assert item["output_ids"][-1] == 2 or not ends
                lengths.append(len(parsed.token_ids))
        assert sorted(lengths) == sorted(server.quantiles) and abs(sum(lengths) / rows - 300) < 30
        assert max(server.due) == 10.0
    finally:
        server.server_close()


@pytest.mark.parametrize("r3", [None, (4, 2, 8)], ids=["plain", "r3"])
def test_queue_bench_fills_the_queue_with_scored_groups_of_the_stated_lengths(tmp_path, r3):
    """bench_queue_rank0.py's untimed set-up: the trainer's Producer writes every group, scored, in claims;
    with --r3 each row's routing too (a spool file of layers x (prompt + response - 1) x top-k bytes)."""
    from types import SimpleNamespace

    from megatron_dapo.data.tokenizer import CharTokenizer
    from megatron_dapo.queue import TransferQueue, spool
    from megatron_dapo.rewards.manager import RewardManager
    from megatron_dapo.trainer.queue_trainer import TRAIN

    spec = importlib.util.spec_from_file_location("bench_queue_rank0", ROOT / "benchmarks" / "bench_queue_rank0.py")
    qbench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qbench)
    rows, args = 96, SimpleNamespace(mean_len=40, sigma=0.8, max_len=256, r3=r3)
    with RewardManager(qbench.parity_reward, max_response_length=256, timeout_s=0) as rm:
        fill = qbench._fill_queue(str(tmp_path / "q.sqlite"), rows, args, CharTokenizer(), rm)
    assert fill["scored_in_producer"]
    q = TransferQueue(tmp_path / "q.sqlite")
    keys = q.list_keys(TRAIN, is_prompt=True)
    assert len(keys) == rows // bench.N and {t["status"] for t in q.get_tags(TRAIN, keys)} == {"done"}
    tkeys = [f"q{g}@1.0_{j}" for g in range(rows // bench.N) for j in range(bench.N)]
    f = q.get(TRAIN, tkeys, ["responses", "rm_scores", "acc"])
    assert [len(r) for r in f["responses"]] == bench.row_lengths(rows, 40, 0.8, 256)
    assert f["rm_scores"] == [float(a) for a in f["acc"]] and 0 < sum(f["acc"]) < rows
    if r3:
        refs = q.get(TRAIN, tkeys, ["routed_experts"])["routed_experts"]
        prompts = q.get(TRAIN, tkeys, ["prompts"])["prompts"]
        directory = spool.spool_dir(tmp_path / "q.sqlite")
        for ref, prompt, response in zip(refs, prompts, f["responses"], strict=True):
            routing = spool.read_tensor(directory, ref)
            assert routing.shape == (4, len(prompt) + len(response) - 1, 2) and int(routing.max()) < 8
        assert fill["queue_bytes_per_row"] > sum(spool.read_tensor(directory, r).numel() for r in refs) / rows
    q.close()
