"""SGLang servers placed on a Ray cluster (one actor and bundle per server) report reachable URLs and
serve generation; the SGLang stand-in (tests/standin, its own process) stands in for
`python -m sglang.launch_server`."""

import pytest

ray = pytest.importorskip("ray")

from megatron_dapo.rollout.base import PromptInput, SamplingParams  # noqa: E402
from megatron_dapo.rollout.sglang.engine import SGLangEngine  # noqa: E402
from megatron_dapo.rollout.sglang.placement import place_sglang_servers  # noqa: E402
from megatron_dapo.rollout.sglang.server import SGLangServerSpec  # noqa: E402
from tests.standin import LAUNCHER  # noqa: E402


@pytest.mark.multiproc
def test_servers_placed_by_ray_answer_generation_and_stop(tmp_path, unused_port_pair):
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        specs = [SGLangServerSpec(model_path="toy", host="127.0.0.1", port=p, tp_size=1,
                                  extra_args=("--toy", "--max-lifetime-s", "120")) for p in unused_port_pair]
        placed = place_sglang_servers(specs, log_dir=str(tmp_path), timeout_s=120, launcher=list(LAUNCHER),
                                      use_gpu=True)
        assert sorted(placed.urls) == sorted(f"http://127.0.0.1:{p}" for p in unused_port_pair)
        with SGLangEngine(placed.urls) as engine:
            samples = engine.generate([PromptInput("a", (1, 2, 3)), PromptInput("b", (4, 5))],
                                      SamplingParams(max_new_tokens=4, n=2))
        assert [(s.prompt_id, s.sample_index) for s in samples] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
        placed.stop()
    finally:
        ray.shutdown()


@pytest.fixture
def unused_port_pair():
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports
