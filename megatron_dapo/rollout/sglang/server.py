"""Launching SGLang servers: the command line, the process with its log file, and the health wait.

A server is `python -m sglang.launch_server` with SGLang's documented flags (`--model-path`,
`--host`, `--port`, `--tp-size`, `--mem-fraction-static`, `--dtype`, `--context-length`, and for MTP
models `--speculative-algorithm EAGLE|NEXTN`, `--speculative-num-steps`, `--speculative-eagle-topk`,
`--speculative-num-draft-tokens`, `--speculative-draft-model-path` (the model path by default: the MTP
layer lives in the target's checkpoint, and SGLang defaults the flag only for DeepSeek-style
architectures)), every one present in each supported release (sglang.versions;
tests launch the stand-in of each release with these commands, whose parser is that release's).
Servers bind to loopback unless a cluster-internal address is given. `--enable-memory-saver` is
required for /release_memory_occupation (colocation) and `--enable-deterministic-inference` for
SGLang to honour per-request `sampling_seed`; `--enable-return-routed-experts` for it to capture the MoE
routing a request asks for (R3: sglang/routing.py, every supported release). `--context-length` is what
the server reports in /server_info; the client refuses prompts that cannot fit it before sending them (without it SGLang
reports None and only refuses an input of the model's whole context, cutting max_new_tokens).

Nothing here imports sglang: the server runs in its own process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests

from megatron_dapo.rollout.sglang.versions import ROUTED_EXPERTS_FLAG

SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN")


@dataclass(frozen=True)
class SGLangServerSpec:
    """Everything `build_launch_command` puts on the command line of one server."""

    model_path: str
    port: int
    tokenizer_path: str | None = None
    """--tokenizer-path; None = SGLang reads the tokenizer from model_path."""
    host: str = "127.0.0.1"
    """Loopback by default; a cluster-internal address when engines serve other nodes."""
    tp_size: int = 1
    mem_fraction_static: float = 0.85
    dtype: str = "auto"
    """SGLang --dtype: auto, bfloat16, float16, float32."""
    base_gpu_id: int | None = None
    """First GPU of this server (servers on one node use disjoint GPU ranges)."""
    enable_memory_saver: bool = False
    """Needed by /release_memory_occupation and /resume_memory_occupation (colocation)."""
    return_routed_experts: bool = False
    """--enable-return-routed-experts: capture each request's MoE routing (actor.router_replay; MoE models)."""
    deterministic_inference: bool = False
    """SGLang honours sampling_seed only with --enable-deterministic-inference (batch-invariant kernels,
    the pytorch sampling backend, a deterministic attention backend: slower decoding)."""
    context_length: int | None = None
    """--context-length (None: the model's). SGLang generates in full up to 2 tokens less (versions.py)."""
    device: str | None = None
    """--device (cuda, cpu, ...); None = SGLang's default."""
    attention_backend: str | None = None
    """--attention-backend; None = SGLang's choice for the device and model."""
    max_total_tokens: int | None = None
    """--max-total-tokens: the KV pool in tokens; None = sized from mem_fraction_static (on CPU, from RAM)."""
    speculative_algorithm: str | None = None
    """None (off), "EAGLE" or "NEXTN" (MTP layers as the drafter)."""
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4
    speculative_draft_model_path: str | None = None
    """Where the drafter's weights start from; None = model_path (the MTP layer's own checkpoint)."""
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    """Appended verbatim (e.g. ("--trust-remote-code",))."""

    def __post_init__(self):
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"SGLangServerSpec.model_path must be a non-empty path, got {self.model_path!r}")
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"SGLangServerSpec.port must be in 1..65535, got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"SGLangServerSpec.host must be a non-empty address, got {self.host!r}")
        if self.host in ("0.0.0.0", "::"):
            # DESIGN.md: services bind to loopback or a cluster-internal address, never to all
            # interfaces by default; an explicit address is how a user opts in to a network.
            raise ValueError(
                f"SGLangServerSpec.host {self.host!r} binds every interface; give a loopback or "
                "cluster-internal address"
            )
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"SGLangServerSpec.tp_size must be an int >= 1, got {self.tp_size!r}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(
                f"SGLangServerSpec.mem_fraction_static must be in (0, 1], got {self.mem_fraction_static!r}"
            )
        if self.context_length is not None and (
            not isinstance(self.context_length, int) or isinstance(self.context_length, bool) or self.context_length < 2
        ):
            raise ValueError(
                f"SGLangServerSpec.context_length must be an int >= 2 or None, got {self.context_length!r}"
            )
        if self.max_total_tokens is not None and (
            not isinstance(self.max_total_tokens, int) or isinstance(self.max_total_tokens, bool)
            or self.max_total_tokens < 1
        ):
            raise ValueError(
                f"SGLangServerSpec.max_total_tokens must be an int >= 1 or None, got {self.max_total_tokens!r}"
            )
        if self.base_gpu_id is not None and (not isinstance(self.base_gpu_id, int) or self.base_gpu_id < 0):
            raise ValueError(
                f"SGLangServerSpec.base_gpu_id must be an int >= 0 or None, got {self.base_gpu_id!r}"
            )
        if self.speculative_algorithm is not None:
            if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
                raise ValueError(
                    f"SGLangServerSpec.speculative_algorithm must be None or one of {SPECULATIVE_ALGORITHMS}, "
                    f"got {self.speculative_algorithm!r}"
                )
            for name in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
                v = getattr(self, name)
                if not isinstance(v, int) or v < 1:
                    raise ValueError(f"SGLangServerSpec.{name} must be an int >= 1, got {v!r}")
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def build_launch_command(
    spec: SGLangServerSpec, *, launcher: Sequence[str] = (sys.executable, "-m", "sglang.launch_server")
) -> list[str]:
    """The argv that starts one server; `launcher` replaces `python -m sglang.launch_server`."""
    cmd = [
        *launcher,
        "--model-path",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--tp-size",
        str(spec.tp_size),
        "--mem-fraction-static",
        repr(float(spec.mem_fraction_static)),
        "--dtype",
        spec.dtype,
    ]
    for flag, value in (("--tokenizer-path", spec.tokenizer_path), ("--context-length", spec.context_length),
                        ("--device", spec.device), ("--attention-backend", spec.attention_backend),
                        ("--max-total-tokens", spec.max_total_tokens)):
        if value is not None:
            cmd += [flag, str(value)]
    if spec.base_gpu_id is not None:
        cmd += ["--base-gpu-id", str(spec.base_gpu_id)]
    if spec.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if spec.deterministic_inference:
        cmd.append("--enable-deterministic-inference")
    if spec.return_routed_experts:
        cmd.append(ROUTED_EXPERTS_FLAG)
    if spec.speculative_algorithm is not None:
        cmd += [
            "--speculative-algorithm",
            spec.speculative_algorithm,
            "--speculative-num-steps",
            str(spec.speculative_num_steps),
            "--speculative-eagle-topk",
            str(spec.speculative_eagle_topk),
            "--speculative-num-draft-tokens",
            str(spec.speculative_num_draft_tokens),
            "--speculative-draft-model-path",
            spec.speculative_draft_model_path or spec.model_path,
        ]
    cmd += list(spec.extra_args)
    return cmd


class ServerStartError(RuntimeError):
    """A server process exited or never became healthy."""


@dataclass
class ServerProcess:
    """A launched server: its process, URL and log file. `stop()` ends it (SIGTERM, then SIGKILL)."""

    process: subprocess.Popen
    url: str
    log_path: Path
    command: list[str]
    env: dict[str, str] | None = None
    """Extra environment of the process (launch_server's `env`), kept for `restart`."""

    def is_running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError as e:
            return f"<log {self.log_path} unreadable: {e}>"

    def stop(self, timeout_s: float = 30.0) -> int:
        """Terminate the server and the processes it spawned (SGLang runs its scheduler and
        detokenizer as children), SIGTERM first, SIGKILL after `timeout_s`; return its exit code."""
        import psutil

        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)
        for child in children:  # the ones the server did not take down with it
            try:
                child.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(children, timeout=timeout_s)
        for child in alive:
            child.kill()
        return self.process.returncode

    def restart(self, timeout_s: float = 1800.0) -> float:
        """Stop what is left of the server (its process tree) and start it again with the same command,
        environment and log file (appended); return the seconds until it answered /health."""
        self.stop()
        self.process = launch_server(self.command, url=self.url, log_path=self.log_path, env=self.env).process
        return wait_for_health(self.url, timeout_s=timeout_s, server=self)


def stop_servers(servers: Sequence) -> None:
    """Stop every server at once, each in its own thread (anything with `.stop()`: a ServerProcess, a Ray
    placed server). SGLang drains for seconds after SIGTERM (6-10 s measured on 2 CPU cores), so stopping
    one after the other costs that per server, at every end of a run and every relaunch. The first failure
    is raised once every stop has returned."""
    servers = list(servers)
    if len(servers) <= 1:
        for server in servers:
            server.stop()
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(servers), thread_name_prefix="sglang-stop") as pool:
        futures = [pool.submit(server.stop) for server in servers]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


def launch_server(
    command: Sequence[str], *, url: str, log_path: str | os.PathLike, env: dict[str, str] | None = None
) -> ServerProcess:
    """Start `command` (from `build_launch_command`) with stdout and stderr in `log_path`, in the log's
    directory: `python -m` puts its working directory first on sys.path, and from this repository's root
    the top-level kernels/ folder would shadow the `kernels` package SGLang and transformers import.
    Relative paths in the command are made absolute first, so they keep their meaning."""
    log_path = Path(log_path).absolute()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = _absolute_paths(command)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=log_path.parent,
            env=server_environment(env),
        )
    return ServerProcess(process=process, url=url, log_path=log_path, command=list(command), env=env)


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
"""torchrun's per-process variables, removed from a server's environment with every TORCHELASTIC_* one."""
TRAINER_ONLY_VARIABLES = ("CUDA_DEVICE_MAX_CONNECTIONS",)
"""The trainer's own settings, also removed (with every NVTE_* one, Transformer Engine's): launch/slurm/env.sh sets
CUDA_DEVICE_MAX_CONNECTIONS=1 for Megatron's communication overlap, which would serialise the server's kernel
launches on one hardware queue."""


SERVER_DEFAULTS = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
"""Set on every launched server unless the user's environment or rollout.server_env says otherwise: /health
then answers whether the server is up without running a generation (SGLang 0.5.23 runs one by default,
srt/environ.py:344, entrypoints/http_server.py:745-749), so the launch's own readiness wait and a restart's
never run a forward, which on a colocated server whose memory the pool released would kill it. The pool's
generating check uses /health_generate explicitly, only where it is safe (health.py)."""


def server_environment(extra: dict[str, str] | None) -> dict[str, str]:
    """The environment a server starts with: SERVER_DEFAULTS, then this process's, without torchrun's rendezvous
    variables and the trainer-only ones (TRAINER_ONLY_VARIABLES, NVTE_*), plus `extra`. SGLang's scheduler initialises torch.distributed for its own TP group: with a launching rank's
    RANK / WORLD_SIZE / MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE it waits forever on the trainer's
    rendezvous store instead of creating its own (measured: 0.5.23 hangs in init_process_group)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES + TRAINER_ONLY_VARIABLES
           and not k.startswith(("TORCHELASTIC_", "NVTE_"))}
    return {**SERVER_DEFAULTS, **env, **(extra or {})}


_PATH_FLAGS = ("--model-path", "--tokenizer-path", "--speculative-draft-model-path")


def _absolute_paths(command: Sequence[str]) -> list[str]:
    """The command with the values of its path flags made absolute when they name existing local paths
    (a hub id or a path on another node stays as written), and a relative interpreter resolved."""
    cmd = [str(c) for c in command]
    if cmd and os.sep in cmd[0] and not os.path.isabs(cmd[0]):
        cmd[0] = os.path.abspath(cmd[0])
    for i in range(1, len(cmd)):
        if cmd[i - 1] in _PATH_FLAGS and os.path.exists(cmd[i]):
            cmd[i] = os.path.abspath(cmd[i])
    return cmd


def wait_for_health(
    url: str,
    *,
    timeout_s: float,
    poll_interval_s: float = 1.0,
    server: ServerProcess | None = None,
    endpoint: str = "/health",
) -> float:
    """Poll `url + endpoint` until it answers 200; return the seconds waited.

    Raises ServerStartError when `timeout_s` passes or `server` exits first (with its log tail).
    """
    start = time.monotonic()
    deadline = start + timeout_s
    last_error = "no answer yet"
    while True:
        if server is not None and not server.is_running():
            raise ServerStartError(
                f"SGLang server for {url} exited with code {server.process.returncode} before becoming "
                f"healthy; log {server.log_path}:\n{server.log_tail()}"
            )
        try:
            r = requests.get(url + endpoint, timeout=max(poll_interval_s, 1.0))
            if r.status_code == 200:
                return time.monotonic() - start
            last_error = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            last_error = f"{type(e).__name__}: {e}"
        if time.monotonic() + poll_interval_s > deadline:
            tail = f"; log {server.log_path}:\n{server.log_tail()}" if server is not None else ""
            raise ServerStartError(
                f"SGLang server {url}{endpoint} not healthy after {timeout_s:.0f} s (last: {last_error}){tail}"
            )
        time.sleep(poll_interval_s)


def launch_servers(
    specs: Sequence[SGLangServerSpec],
    *,
    log_dir: str | os.PathLike,
    timeout_s: float,
    launcher: Sequence[str] = (sys.executable, "-m", "sglang.launch_server"),
    env: dict[str, str] | None = None,
) -> list[ServerProcess]:
    """Start every server (logs `log_dir/sglang_<port>.log`) and wait until all are healthy.

    The servers load their weights in parallel; if one fails, all are stopped before the error
    propagates, so a failed start leaves no process behind.
    """
    ports = [s.port for s in specs]
    if len(set(ports)) != len(ports):
        raise ValueError(f"launch_servers: ports must be distinct, got {ports}")
    servers: list[ServerProcess] = []
    try:
        for spec in specs:
            cmd = build_launch_command(spec, launcher=launcher)
            log_path = Path(log_dir) / f"sglang_{spec.port}.log"
            servers.append(launch_server(cmd, url=spec.url, log_path=log_path, env=env))
        deadline = time.monotonic() + timeout_s
        for server in servers:
            wait_for_health(server.url, timeout_s=max(0.0, deadline - time.monotonic()), server=server)
    except BaseException:
        stop_servers(servers)
        raise
    return servers
