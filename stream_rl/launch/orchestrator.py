"""`stream-rl run`: the whole pipeline as separate processes on one machine.

Consumes: a resolved :class:`~stream_rl.config.StreamRLConfig` (its ``run`` section says how many of each role).
Produces: a run directory (``config.yaml`` — secrets excluded, children read them from the same environment —,
``metrics.jsonl`` written by the trainer, ``logs/ROLE-N.log``, checkpoints, spans when enabled) and a live
progress line.
Guarantees: every child is a separate process started with the same config file; when the trainer reaches its
step budget or the user presses Ctrl-C, every child gets SIGTERM (then SIGKILL after a grace period); when any role
dies unexpectedly, the others are stopped and :class:`RoleDied` names the role, its exit code and the role's last
error line from its log (:func:`last_error_line`: the last ERROR/CRITICAL log line, Python exception line or
one-line CLI failure; else the last line), at most :data:`ERROR_LINE_CHARS` characters.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ERROR_LINE_CHARS = 200
_ERROR_LINE = re.compile(
    r"^(?:\S+ ){0,3}\(?(?:ERROR|CRITICAL)\b"      # a log line at ERROR/CRITICAL (ours, vLLM's "ERROR 12-01 ...")
    r"|^(?:[A-Za-z_]\w*\.)*[A-Z][a-z]\w*: \S"      # a Python exception line: "SomeError: message"
    r"|^(?:error|stopped by alert): ")           # the one-line failure of a stream-rl command (cli/errors.py)


class RoleDied(RuntimeError):
    """A role process exited on its own with a non-zero code (or any code, for producers/scorers)."""

    def __init__(self, role: str, code: int, log: Path):
        super().__init__(f"role {role} exited with code {code}: {last_error_line(log)} (log: {log})")
        self.role, self.code, self.log = role, code, log


def last_error_line(log: Path, limit: int = ERROR_LINE_CHARS) -> str:
    """The role's last error line in ``log`` (see the module docstring), trimmed to ``limit`` characters."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    if not lines:
        return "(empty log)"
    line = next((x for x in reversed(lines) if _ERROR_LINE.search(x)), lines[-1])
    return line if len(line) <= limit else line[:limit - 3] + "..."


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    log: Path


@dataclass
class Supervisor:
    """Starts role processes and watches them."""

    run_dir: Path
    config_file: Path
    children: list[Child] = field(default_factory=list)

    def start(self, role: str, index: int, extra_args: list[str] | None = None, threads: int = 1,
              cuda_devices: str | None = None) -> Child:
        """Start ``role`` number ``index``; ``cuda_devices``: its ``CUDA_VISIBLE_DEVICES`` (the run's GPU layout,
        :mod:`stream_rl.launch.gpus`), None: the environment's."""
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{role}-{index}.log"
        cmd = [sys.executable, "-m", "stream_rl.cli.main", role, "--config", str(self.config_file),
               "--instance", str(index), *(extra_args or [])]
        log_fh = open(log_path, "ab")
        env = role_env(os.environ, threads, cuda_devices)
        proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=die_with_parent)
        log_fh.close()
        child = Child(f"{role}-{index}", proc, log_path)
        self.children.append(child)
        return child

    def check(self, expected_done: AbstractSet[str] = frozenset()) -> Child | None:
        """The first child that exited (its role in ``expected_done`` and code 0 is fine: returns it)."""
        for child in self.children:
            code = child.proc.poll()
            if code is None:
                continue
            if code == 0 and child.role in expected_done:
                return child
            raise RoleDied(child.role, code, child.log)
        return None

    def stop_all(self, grace_s: float = 30.0) -> None:
        """SIGTERM every child (each finishes its batch, flushes, commits), SIGKILL what is left after ``grace_s``.

        A second Ctrl-C while waiting escalates to SIGKILL at once instead of abandoning the children."""
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        try:
            for child in self.children:
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for child in self.children:
                if child.proc.poll() is None:
                    child.proc.kill()
                    child.proc.wait()


def role_env(base: dict[str, str] | os._Environ, threads: int, cuda_devices: str | None) -> dict[str, str]:
    """A role process's environment: ``base`` with ``threads`` compute threads (the placement's; 1 on a shared core)
    unless ``base`` says otherwise (on a small machine, roles that each start one thread per core fight over the
    cores: measured 3-4x slower steps on 2 cores), unbuffered output, and ``CUDA_VISIBLE_DEVICES`` set to
    ``cuda_devices`` when given (the run's GPU layout overrides the environment's)."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **base, "PYTHONUNBUFFERED": "1"}
    if cuda_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_devices
    return env


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies: a role child of the supervisor (called before exec)
    or a trainer rank of the launcher (called at its start)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's own shutdown (stop_all, the launcher's) is the only guard


def write_run_config(cfg, run_dir: Path, filename: str = "config.yaml") -> Path:
    """The resolved config as YAML (``run_dir/filename``) for the children, with secret fields left out (they stay in
    the env)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    from stream_rl.config.loading import secret_fields

    exclude: dict = {}
    for dotted in secret_fields(type(cfg)):
        *sections, name = dotted.split(".")
        node = exclude
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = True
    data = cfg.model_dump(mode="json", exclude=exclude)
    path = run_dir / filename
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=True))
    tmp.replace(path)
    return path


def read_new_metrics(path: Path, offset: int) -> tuple[list[dict], int]:
    """Whole JSON lines appended to ``path`` after byte ``offset``; returns them and the new offset."""
    if not path.is_file():
        return [], offset
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n") + 1
    rows = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return rows, offset + end


def progress_line(row: dict) -> str:
    def f(key: str, fmt: str = ".3f") -> str:
        value = row.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    return (f"step {row.get('step', '?'):>5}  reward {f('reward/mean')}  kl {f('kl/ref_mean', '.4f')}  "
            f"lag {f('staleness/mean_lag', '.2f')}  tok/s {f('throughput/train_tokens_per_s', '.0f')}  "
            f"v{row.get('policy_version', '?')}")


def supervise(sup: Supervisor, metrics_path: Path, echo: Callable[[str], None], max_wall_s: float | None,
              poll_s: float = 1.0, on_first_row: Callable[[], None] | None = None) -> list[dict]:
    """Watch the children and the trainer's metrics until the trainer finishes; returns all metric rows.
    ``on_first_row`` runs once, when the trainer's first metrics row appears (training has started)."""
    rows: list[dict] = []
    offset = 0
    start = time.monotonic()
    try:
        while True:
            new, offset = read_new_metrics(metrics_path, offset)
            if new and not rows and on_first_row is not None:
                on_first_row()
            for row in new:
                rows.append(row)
                echo(progress_line(row))
            done = sup.check(expected_done={"train-0"})
            if done is not None:
                new, offset = read_new_metrics(metrics_path, offset)
                rows.extend(new)
                return rows
            if max_wall_s is not None and time.monotonic() - start > max_wall_s:
                echo(f"wall-time budget of {max_wall_s:.0f}s reached; stopping")
                return rows
            time.sleep(poll_s)
    finally:
        sup.stop_all()
