"""Test harness: the pipeline's roles as separate OS processes on the session broker, and readers of what a run
leaves behind.

Consumes: a :class:`~stream_rl.config.StreamRLConfig` (from the ``make_config`` fixture) and a tiny policy
directory. Produces: role processes started exactly as ``stream-rl run`` starts them
(:class:`stream_rl.launch.orchestrator.Supervisor`: ``python -m stream_rl.cli.main ROLE --config FILE --instance N``,
``OMP_NUM_THREADS=1``, one log per role in ``run_dir/logs``), plus plain-data views of the run's topics,
``metrics.jsonl``, ``trained.jsonl``, checkpoints and consumer-group offsets, and the (prompt, epoch) accounting.
Guarantees:
- Every wait has a deadline; a wait fails with an ``AssertionError`` naming what it waited for, the accounting so
  far (when asked) and the tail of every role's log. A role that exits while it should be running fails the
  wait at once.
- Every process this harness started is stopped on ``close()`` (SIGTERM, then SIGKILL after a grace period),
  always by its own PID; a process frozen with SIGSTOP is killed directly.
- :func:`gated_addition_reward` is the demo verifier plus a test gate: while the file named by ``$GATE_ENV``
  exists, the scorer that calls it records the prompt in ``<gate>.held`` and stops itself (SIGSTOP) inside the
  batch, so a test can kill it holding records it polled but never committed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from schemas import DeadLetter, Prompt, SchemaError, StaleRollout, decode, rollout_id_for
from stream_rl.launch.orchestrator import Child, Supervisor, write_run_config
from stream_rl.transport.client import Transport
from support.topics import committed, read_records

LOG_TAIL_CHARS = 2500
GATE_ENV = "TEST_PIPELINE_REWARD_GATE"  # not STREAM_RL_*: that prefix is config
TESTS_DIR = Path(__file__).resolve().parents[1]  # tests/: holds the support package
_KIND_OF_SOURCE = {"prompts": "prompt", "rollouts": "rollout", "scored": "scored_rollout"}


def tiny_policy_dir(path: Path, seed: int = 0) -> Path:
    """A random-weight LlamaForCausalLM (hidden 64, 2 layers, 2 heads of dim 32) with the demo's char tokenizer,
    saved with ``stream_rl.models.save_model``: it can write every addition prompt, and loads fast."""
    import torch
    from transformers import LlamaForCausalLM

    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models import save_model
    from support.producers import tiny_llama_config

    torch.set_num_threads(1)  # the roles run as their own processes; the test process only builds the model
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    return save_model(LlamaForCausalLM(tiny_llama_config(tokenizer)), tokenizer, path)


def demo_prompts(tmp_path: Path, n_prompts: int, epochs: int, group_size: int, seed: int = 0) -> list[Prompt]:
    """``n_prompts`` demo additions written to a JSON-lines file and turned into records by ``stream_rl.prompts``
    (one per (prompt, epoch), each epoch shuffled), as ``stream-rl prompts load`` does."""
    from stream_rl.demo.task import make_prompts
    from stream_rl.prompts import prompt_messages, read_prompt_file

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in make_prompts(n_prompts, seed=seed)))
    return prompt_messages(read_prompt_file(path), epochs, group_size, seed)


def role_overrides(model_dir: Path, **extra) -> dict:
    """Dotted config overrides for a small, fast pipeline run (tiny model, short responses, no reference model)."""
    base = {
        "producer.model_dir": str(model_dir), "producer.engine": "hf", "producer.max_new_tokens": 5,
        "producer.prompts_per_batch": 8, "producer.poll_timeout_s": 0.5, "producer.weights_startup_wait_s": 1.0,
        "scorer.reward_fn": "stream_rl.demo.task:addition_reward", "scorer.batch_size": 64,
        "scorer.poll_timeout_s": 0.5,
        "trainer.model_dir": str(model_dir), "trainer.groups_per_step": 4, "trainer.micro_batch_size": 16,
        "trainer.broadcast_every": 1, "trainer.checkpoint_every": 3, "trainer.poll_timeout_s": 0.5,
        "trainer.lr": 1e-3,
    }
    base.update(extra)
    return base


def gated_addition_reward(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    """``stream_rl.demo.task:addition_reward``, except that while the gate file exists the calling process writes
    ``prompt`` to ``<gate>.held`` and stops itself (SIGSTOP) before returning (see the module docstring)."""
    from stream_rl.demo.task import addition_reward

    gate = os.environ.get(GATE_ENV)
    if gate and Path(gate).exists():
        held = Path(f"{gate}.held")
        # one temporary file per thread: the scorer's reward calls run concurrently, and two threads sharing one
        # would let the second truncate the file the first just renamed into place (the held prompt read as '')
        tmp = held.with_name(f"{held.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(prompt)
        tmp.replace(held)
        os.kill(os.getpid(), signal.SIGSTOP)
    return addition_reward(prompt, response, answer, metadata)


# ----------------------------------------------------------------------------------------------- reading a run
def read_jsonl(path: Path) -> list[dict]:
    """Whole JSON lines of ``path`` (a line still being written is skipped); [] if it does not exist."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def trained_ids(lines: Iterable[dict]) -> list[str]:
    """Every rollout id of ``trained.jsonl`` lines, in order, repeats kept."""
    return [rid for line in lines for rid in line["rollout_ids"]]


@dataclass
class Accounting:
    """Where each loaded (prompt_id, epoch) ended: trained (first try), trained after a stale drop and re-queue,
    dead-lettered (with the reason), or nowhere (``missing``)."""

    trained: set[tuple[str, int]] = field(default_factory=set)
    regenerated: set[tuple[str, int]] = field(default_factory=set)
    dead_lettered: dict[tuple[str, int], str] = field(default_factory=dict)
    missing: set[tuple[str, int]] = field(default_factory=set)

    def summary(self) -> str:
        missing = sorted(self.missing)
        return (f"trained {len(self.trained)} (of which stale-and-regenerated {len(self.regenerated)}), "
                f"dead-lettered {len(self.dead_lettered)}, missing {len(missing)}: {missing[:12]}")


def account(loaded: Iterable[Prompt], trained: Iterable[str], stale: Iterable[StaleRollout],
            dead: Iterable[DeadLetter], names) -> Accounting:
    """Classify every loaded (prompt, epoch): all ``group_size`` rollout ids trained, or a dead letter (with a
    non-empty reason) whose original record belongs to it; anything else is missing."""
    trained, requeued = set(trained), {(s.prompt_id, s.epoch) for s in stale if s.requeued}
    dead_by_group = {}
    for letter in dead:
        key = _dead_letter_group(letter, names)
        if key is not None and letter.reason.strip():
            dead_by_group[key] = letter.reason
    out = Accounting()
    for prompt in loaded:
        key = (prompt.prompt_id, prompt.epoch)
        ids = {rollout_id_for(prompt.prompt_id, prompt.epoch, i) for i in range(prompt.group_size)}
        if ids <= trained:
            out.trained.add(key)
            if key in requeued:
                out.regenerated.add(key)
        elif key in dead_by_group:
            out.dead_lettered[key] = dead_by_group[key]
        else:
            out.missing.add(key)
    return out


def _dead_letter_group(letter: DeadLetter, names) -> tuple[str, int] | None:
    sources = {names.prompts: "prompts", names.rollouts: "rollouts", names.scored: "scored"}
    logical = sources.get(letter.source_topic)
    if logical is None or letter.raw_value is None:
        return None
    try:
        msg = decode(letter.raw_value, _KIND_OF_SOURCE[logical])
    except SchemaError:
        return None
    inner = getattr(msg, "rollout", msg)  # a ScoredRollout wraps its Rollout
    return inner.prompt_id, inner.epoch


# ----------------------------------------------------------------------------------------------- the harness
class Pipeline:
    """Role processes of one run plus readers of its outputs; use as a context manager (see module docstring)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.transport = Transport(cfg, "harness")
        self.transport.ensure_topics()
        self.names = self.transport.names
        self.supervisor = Supervisor(self.run_dir, write_run_config(cfg, self.run_dir))
        self.running: list[Child] = []  # children expected to stay alive
        self.frozen: set[int] = set()
        self.loaded: list[Prompt] = []

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- processes ----------------------------------------------------------------------------------------------
    def start(self, role: str, index: int, *args: str) -> Child:
        child = self.supervisor.start(role, index, list(args))
        self.running.append(child)
        return child

    def freeze(self, child: Child, signal_it: bool = True) -> None:
        """SIGSTOP: the process keeps its state (and its uncommitted work) but does nothing until killed.
        ``signal_it=False`` only records a process that stopped itself (:func:`gated_addition_reward`)."""
        if signal_it:
            os.kill(child.proc.pid, signal.SIGSTOP)
        self.frozen.add(child.proc.pid)

    def kill9(self, child: Child) -> int:
        """``kill -9`` the process (by its PID) and reap it; returns its exit status (-9)."""
        os.kill(child.proc.pid, signal.SIGKILL)
        code = child.proc.wait(timeout=30)
        self.frozen.discard(child.proc.pid)
        self.running.remove(child)
        return code

    def finished(self, child: Child) -> bool:
        """True once ``child`` exited; a non-zero exit fails at once with the logs."""
        code = child.proc.poll()
        if code is None:
            return False
        if code != 0:
            self.fail(f"{child.role} exited with code {code}")
        return True

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout_s: float,
                   may_exit: Iterable[Child] = (), diagnose: Callable[[], str] | None = None,
                   poll_s: float = 0.5) -> None:
        """Poll ``predicate`` until it holds; fail on the deadline or when a running child (other than
        ``may_exit``) exits. ``diagnose`` adds a line to the failure message."""
        allowed = {id(c) for c in may_exit}
        deadline = time.monotonic() + timeout_s
        while not predicate():
            for child in self.running:
                code = child.proc.poll()
                if code is not None and (id(child) not in allowed or code != 0):
                    self.fail(f"{child.role} exited with code {code} while waiting for {what}", diagnose)
            if time.monotonic() > deadline:
                self.fail(f"timed out after {timeout_s:.0f}s waiting for {what}", diagnose)
            time.sleep(poll_s)

    def fail(self, message: str, diagnose: Callable[[], str] | None = None) -> None:
        extra = ""
        if diagnose is not None:
            try:
                extra = "\n" + diagnose()
            except Exception as exc:  # the diagnosis must not hide the failure it explains
                extra = f"\n(diagnosis failed: {exc!r})"
        raise AssertionError(f"{message}{extra}\n{self.log_tails()}")

    def log_tails(self) -> str:
        parts = []
        for log in sorted({c.log for c in self.supervisor.children}):
            text = log.read_text(errors="replace") if log.is_file() else "(no log)"
            parts.append(f"----- {log.name} (last {LOG_TAIL_CHARS} chars)\n{text[-LOG_TAIL_CHARS:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for child in self.supervisor.children:
            if child.proc.poll() is None and (child.proc.pid in self.frozen or _stopped(child.proc.pid)):
                child.proc.kill()
                child.proc.wait()
        self.supervisor.stop_all(grace_s=20.0)

    # -- inputs -------------------------------------------------------------------------------------------------
    def load(self, prompts: list[Prompt]) -> None:
        """Publish prompt records (keyed by prompt id, acknowledged) and remember them for the accounting."""
        from stream_rl.prompts import publish_prompts

        publish_prompts(self.transport, prompts)
        self.loaded.extend(prompts)

    # -- outputs ------------------------------------------------------------------------------------------------
    def metrics(self) -> list[dict]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def trained(self) -> list[dict]:
        return read_jsonl(self.run_dir / "trained.jsonl")

    def checkpoint_steps(self) -> list[int]:
        from stream_rl.storage.checkpoint import complete_checkpoints

        return [int(p.name.split("-")[1]) for p in complete_checkpoints(self.run_dir / "checkpoints")]

    def read(self, logical: str, kind: str) -> list[tuple[int, int, object]]:
        """Every record of one of the run's topics as (partition, offset, decoded message)."""
        return [(r.partition, r.offset, r.value)
                for r in read_records(self.transport, getattr(self.names, logical), kind)]

    def highwaters(self, logical: str) -> dict[int, int]:
        topic = getattr(self.names, logical)
        with self.transport.reader() as reader:
            return {p: mark for (_, p), mark in reader.highwaters(reader.partitions(topic)).items()}

    def committed(self, role_group: str, logical: str) -> dict[int, int]:
        """The consumer group ``{prefix}.{run}.{role_group}``'s committed offsets on one topic (0 if none)."""
        topic = getattr(self.names, logical)
        found = {p: offset for (t, p), offset in committed(self.transport, self.names.group(role_group)).items()
                 if t == topic}
        return {p: found.get(p, 0) for p in self.highwaters(logical)}

    def accounting(self) -> Accounting:
        return account(self.loaded, trained_ids(self.trained()),
                       [m for _, _, m in self.read("stale", "stale_rollout")],
                       [m for _, _, m in self.read("dlq", "dead_letter")], self.names)


def _stopped(pid: int) -> bool:
    """True if the process is stopped (state T in /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")
