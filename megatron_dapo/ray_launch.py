"""`python -m megatron_dapo.ray_launch --config RECIPE [key=value ...]`: a recipe's whole world, started from
a Ray job (launch/ray_job.sh submits this as the job's entrypoint).

The recipe's `trainer.nnodes` x `trainer.n_gpus_per_node` ranks run as one torchrun agent per node
(`python -m megatron_dapo.torchrun`, c10d rendezvous), each agent in a bundle of a Ray placement group:
one bundle of one CPU per node (STRICT_SPREAD), on nodes with at least n_gpus_per_node GPUs when the
cluster has GPUs. The agents reserve no GPU: the trainer's rank 0 places the SGLang servers on those same
GPUs through Ray (colocated, rollout/sglang/placement.py), which a bundle holding a node's GPUs would leave
waiting; the ranks use the node's GPUs directly (CUDA_VISIBLE_DEVICES as the node has it, not Ray's empty
value for a task without GPUs). Each agent gets RAY_ADDRESS (the cluster's GCS address), so rank 0 finds the
cluster to place the servers on. The rendezvous is
hosted by the agent of bundle 0 (`is_host=1`), at its node's address. Each agent's output reaches the job's log with a
`[node i]` prefix. The job ends with the first agent that fails (the others are stopped; a torchrun that
loses its Ray worker gets SIGTERM and ends its ranks) or when all succeed, and exits with that status. A
node that stopped on a signal (trainer.preemption_exit_code, 75) stops no other: every node is then
writing the step's checkpoint; the job exits with that code once all have ended. A world of one process runs the trainer directly.

MEGATRON_DAPO_RAY_PLACEMENT sets the placement strategy (default STRICT_SPREAD; PACK puts the agents on
one node: the CPU test runs two "nodes" on one machine that way).
"""

from __future__ import annotations

import os
import subprocess
import sys

PLACEMENT_ENV = "MEGATRON_DAPO_RAY_PLACEMENT"


def _die_with_parent() -> None:
    """In the torchrun agent: SIGTERM when the Ray worker that started it dies (torchrun then ends its ranks)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def _host_address() -> tuple[str, int]:
    """This node's address and a free port on it: where the rendezvous of the job is hosted."""
    import ray

    from megatron_dapo.parallel import listen_on

    ip = ray.util.get_node_ip_address()
    sock = listen_on(ip)
    port = sock.getsockname()[1]
    sock.close()
    return ip, port


def agent_environment(environ: dict[str, str], ray_address: str) -> dict[str, str]:
    """The environment of a node's torchrun agent: RAY_ADDRESS set (rank 0 places the servers on the cluster),
    and CUDA_VISIBLE_DEVICES as the node has it, not the empty value Ray gives a task that reserved no GPU."""
    env = dict(environ, RAY_ADDRESS=ray_address)
    if env.get("CUDA_VISIBLE_DEVICES") == "":
        env.pop("CUDA_VISIBLE_DEVICES")
    return env


def _agent(cmd: list[str], index: int, ray_address: str = "") -> int:
    """Run one node's torchrun agent, streaming its output; returns its exit status."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_die_with_parent, env=agent_environment(dict(os.environ), ray_address))
    for line in proc.stdout:
        print(f"[node {index}] {line}", end="", flush=True)
    return proc.wait()


def main(argv: list[str] | None = None) -> int:
    import argparse

    from megatron_dapo.config import load_config_cli

    p = argparse.ArgumentParser(prog="python -m megatron_dapo.ray_launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML recipe (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    args = p.parse_args(argv)
    cfg = load_config_cli(args.config, args.overrides)
    if cfg is None:
        return 2
    train = ["-m", "megatron_dapo.train", "--config", args.config, *args.overrides]
    nnodes, nproc = cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node
    if nnodes * nproc == 1:
        return subprocess.call([sys.executable, *train])

    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address="auto", logging_level="ERROR")
    strategy = os.environ.get(PLACEMENT_ENV, "STRICT_SPREAD")
    if ray.cluster_resources().get("GPU", 0) > 0:
        gpu_nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= nproc]
        if len(gpu_nodes) < (nnodes if strategy == "STRICT_SPREAD" else 1):
            print(f"ray_launch: {nnodes} node(s) of {nproc} GPUs wanted, the cluster has {len(gpu_nodes)}: "
                  f"{ray.cluster_resources()}", file=sys.stderr)
            return 2
    bundle = {"CPU": 1}  # no GPU: the servers rank 0 places share the nodes' GPUs (module docstring)
    group = placement_group([bundle] * nnodes, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=600)
    if not ready:
        print(f"ray_launch: the cluster cannot place {nnodes} nodes of {bundle} ({strategy}) within 600 s: "
              f"{ray.cluster_resources()}", file=sys.stderr)
        return 2
    on = [PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
          for i in range(nnodes)]
    host, port = ray.get(ray.remote(_host_address).options(num_cpus=0, scheduling_strategy=on[0]).remote())
    agent = ray.remote(_agent)
    cmd = [sys.executable, "-m", "megatron_dapo.torchrun", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
           "--rdzv_backend=c10d", f"--rdzv_endpoint={host}:{port}", f"--rdzv_id={os.getpid()}-{port}",
           "--max_restarts=0", *train]
    print(f"ray_launch: {nnodes} node(s) x {nproc} rank(s), rendezvous at {host}:{port} ({strategy})", flush=True)
    # Bundle 0's agent hosts the rendezvous store, said explicitly: torch infers it by matching the endpoint
    # against the host name's addresses, which a node whose name resolves to loopback never matches.
    address = ray.get_runtime_context().gcs_address
    running = {agent.options(num_cpus=1, num_gpus=0, scheduling_strategy=on[i]).remote(
        [*cmd[:3], f"--rdzv_conf=is_host={int(i == 0)}", *cmd[3:]], i, address): i for i in range(nnodes)}
    return _wait_for_agents(running, stopped=cfg.trainer.preemption_exit_code, cancel=ray.cancel, wait=ray.wait,
                            get=ray.get)


def _wait_for_agents(running: dict, *, stopped: int, cancel, wait, get) -> int:
    """The job's status from its agents ({ref: node index}): the first failure stops the others at once; a
    node that exits with `stopped` (trainer.preemption_exit_code: a stop signal, a checkpoint written) does
    not, since every node is then checkpointing and stopping too, and cutting one short would tear the
    checkpoint; the job then ends when all have, with that status (unless another node fails)."""
    status = 0
    while running:
        done, _ = wait(list(running), num_returns=1)
        index = running.pop(done[0])
        code = get(done[0])
        if code == 0:
            continue
        if code == stopped:
            status = status or code
            print(f"ray_launch: node {index} stopped on a signal (status {code}); waiting for the others",
                  file=sys.stderr)
            continue
        status = code
        print(f"ray_launch: node {index} ended with status {code}; stopping the others", file=sys.stderr)
        for ref in running:
            cancel(ref, force=True)
        break
    return status


if __name__ == "__main__":
    sys.exit(main())
