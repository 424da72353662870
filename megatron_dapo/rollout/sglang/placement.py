"""Place SGLang servers on a Ray cluster: one Ray actor per server, each holding
`rollout.tensor_model_parallel_size` GPUs in its own placement-group bundle, launching
`python -m sglang.launch_server` on its node and reporting the URL. The trainer's rank 0 then drives
the servers over HTTP (`SGLangEngine`).

Servers bind to their node's cluster-internal address (Ray's node IP): they must be reachable from the
trainer's rank 0 on another node, and never bind to all interfaces.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

from megatron_dapo.rollout.sglang.server import SGLangServerSpec, launch_servers

_DEFAULT_LAUNCHER = (sys.executable, "-m", "sglang.launch_server")


def _server_actor_class():
    import ray

    @ray.remote
    class SGLangServerActor:
        def __init__(self, spec: SGLangServerSpec, launcher: Sequence[str], log_dir: str, timeout_s: float,
                     env: dict[str, str] | None):
            host = ray.util.get_node_ip_address() if spec.host == "auto" else spec.host
            # Ray gives this actor its GPUs through CUDA_VISIBLE_DEVICES: the server starts at GPU 0 of them.
            spec = dataclasses.replace(spec, host=host, base_gpu_id=0 if spec.tp_size else None)
            (self.server,) = launch_servers([spec], log_dir=log_dir, timeout_s=timeout_s, launcher=launcher, env=env)

        def url(self) -> str:
            return self.server.url

        def stop(self) -> int:
            return self.server.stop()

        def restart(self) -> float:
            return self.server.restart()

    return SGLangServerActor


@dataclasses.dataclass
class PlacedServers:
    """The servers' URLs and the Ray handles that own them; `stop()` ends every server."""

    urls: list[str]
    actors: list
    placement_group: object

    def restart_url(self, url: str) -> float:
        """Restart the server at `url` in its own bundle (the same GPUs); seconds until it answered."""
        import ray

        return ray.get(self.actors[self.urls.index(url)].restart.remote())

    def stop(self) -> None:
        import ray

        ray.get([a.stop.remote() for a in self.actors])
        for a in self.actors:
            ray.kill(a)
        ray.util.remove_placement_group(self.placement_group)


def place_sglang_servers(specs: Sequence[SGLangServerSpec], *, log_dir: str, timeout_s: float = 1800.0,
                         launcher: Sequence[str] = _DEFAULT_LAUNCHER, use_gpu: bool = True,
                         env: dict[str, str] | None = None) -> PlacedServers:
    """Start one server per spec on the connected Ray cluster (PACK placement: fill nodes in order);
    `env`: extra environment variables of every server process."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
    bundles = [{"CPU": 1, **({"GPU": s.tp_size} if use_gpu else {})} for s in specs]
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready(), timeout=timeout_s)
    cls = _server_actor_class()
    actors = [cls.options(num_cpus=1, num_gpus=s.tp_size if use_gpu else 0,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              placement_group=pg, placement_group_bundle_index=i)).remote(
        s, list(launcher), log_dir, timeout_s, env) for i, s in enumerate(specs)]
    urls = ray.get([a.url.remote() for a in actors], timeout=timeout_s)
    return PlacedServers(urls=urls, actors=actors, placement_group=pg)
