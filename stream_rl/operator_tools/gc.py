"""``stream-rl gc``: plan and apply the removal of old checkpoints, weight versions and run files.

Consumes: :class:`GcPaths` (where a run keeps its checkpoints, weights store, logs, spans and telemetry files,
resolved from the config by :func:`paths_from_config`), a :class:`GcPolicy` and the current time.
Produces: :func:`plan_gc` returns the :class:`GcAction` list (what would be removed and why, with sizes) without
touching anything; :func:`apply_gc` removes exactly those paths.
Guarantees:
- Checkpoints: the newest ``keep_checkpoints`` complete ``step-*`` directories are always kept (the naming and the
  "complete" test are the trainer's own, :func:`stream_rl.storage.checkpoint.complete_checkpoints`); an older one
  goes only when it is also older than ``older_than_s`` (if set). ``.del-*`` leftovers always go; ``.tmp-*``
  directories only when untouched for ``tmp_grace_s`` (a live trainer may be writing one). A checkpoint is renamed
  to ``.del-*`` before it is deleted, as the trainer's pruning does, so a crash never leaves a partial ``step-*``.
  Nothing else there is touched: ``best/`` and ``eval-pending/`` (``trainer.keep_best``) are never removed.
- Weights store: the newest ``keep_weights`` (>= 1) ``v{N:08d}.safetensors`` files are always kept, so the version
  producers fetch now is never removed; temporary files count as abandoned only for versions up to the newest
  complete one (the publisher's rule) and when untouched for ``tmp_grace_s``. Inline chunk topics are not
  touched here: the trainer's garbage collection deletes them and ``topics.retention_ms`` expires them.
- Run files (``logs/*.log*``, the span file and its rotations, ``telemetry/*.jsonl*``) go only when
  ``older_than_s`` is set and the file was not modified for that long. ``config.yaml``, ``metrics.jsonl``,
  ``trained.jsonl`` and reports are never removed.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

# run files: role logs and JSON-lines files, with rotation suffixes (the store's file names come from the publisher)
_LOG = re.compile(r"^.+\.log(\.\d+)?(\.gz)?$")
_JSONL = re.compile(r"^.+\.jsonl(\.\d+)?(\.gz)?$")
DAY_S = 86_400.0


@dataclass(frozen=True)
class GcPaths:
    """Where one run keeps what gc may prune (directories that do not exist are skipped)."""

    checkpoint_dir: Path
    weights_dir: Path
    logs_dir: Path
    spans_file: Path
    telemetry_dir: Path


@dataclass(frozen=True)
class GcPolicy:
    """What to keep. ``older_than_s=None``: checkpoints and weights by count only, run files kept."""

    keep_checkpoints: int
    keep_weights: int
    older_than_s: float | None = None
    tmp_grace_s: float = 6 * 3600.0

    def __post_init__(self) -> None:
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 (resume needs one), got {self.keep_checkpoints}")
        if self.keep_weights < 1:
            raise ValueError(f"keep_weights must be >= 1 (producers fetch the newest), got {self.keep_weights}")
        if self.older_than_s is not None and self.older_than_s < 0:
            raise ValueError(f"older_than must be >= 0, got {self.older_than_s}")


@dataclass(frozen=True)
class GcAction:
    """Remove ``path`` (a file or a directory tree) of ``kind``; ``reason`` says which rule chose it."""

    kind: str  # checkpoint | checkpoint-tmp | weights | weights-tmp | run-file
    path: Path
    reason: str
    size_bytes: int


def paths_from_config(cfg, checkpoint_dir: Path | None) -> GcPaths:
    """The run's paths as the roles resolve them (same defaults under ``cfg.run_dir``); ``cfg``: the shared
    sections, ``checkpoint_dir``: ``trainer.checkpoint_dir`` (handed over by the CLI; None: the default)."""
    from stream_rl.config.shared import checkpoint_root

    run_dir = Path(cfg.run_dir)
    return GcPaths(
        checkpoint_dir=checkpoint_root(run_dir, checkpoint_dir),
        weights_dir=Path(cfg.weights.store_dir or run_dir / "weights"),
        logs_dir=run_dir / "logs",
        spans_file=Path(cfg.tracing.jsonl_path or run_dir / "spans.jsonl"),
        telemetry_dir=Path(cfg.telemetry.jsonl_dir or run_dir / "telemetry"))


def plan_gc(paths: GcPaths, policy: GcPolicy, now: float) -> list[GcAction]:
    """Every removal the policy asks for at time ``now`` (seconds since the epoch); reads, never writes."""
    return (_plan_checkpoints(paths.checkpoint_dir, policy, now) + _plan_weights(paths.weights_dir, policy, now)
            + _plan_run_files(paths, policy, now))


def _age(path: Path, now: float) -> float:
    return now - path.lstat().st_mtime


def _old_enough(path: Path, policy: GcPolicy, now: float) -> bool:
    return policy.older_than_s is None or _age(path, now) >= policy.older_than_s


def _days(seconds: float) -> str:
    return f"{seconds / DAY_S:g} days"


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a directory (links not followed)."""
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        return info.st_size
    return sum((Path(d) / f).lstat().st_size for d, _, files in os.walk(path) for f in files)


def _plan_checkpoints(root: Path, policy: GcPolicy, now: float) -> list[GcAction]:
    if not root.is_dir():
        return []
    from stream_rl.storage.checkpoint import DEL_PREFIX, TMP_PREFIX, complete_checkpoints

    actions = []
    complete = complete_checkpoints(root)  # oldest first
    for path in complete[:-policy.keep_checkpoints]:
        if _old_enough(path, policy, now):
            why = f"beyond the newest {policy.keep_checkpoints}"
            if policy.older_than_s is not None:
                why += f" and older than {_days(policy.older_than_s)}"
            actions.append(GcAction("checkpoint", path, why, size_of(path)))
    for path in sorted(root.iterdir()):
        if path.is_dir() and path.name.startswith(DEL_PREFIX):
            actions.append(GcAction("checkpoint-tmp", path, "left over from an interrupted delete", size_of(path)))
        elif path.is_dir() and path.name.startswith(TMP_PREFIX) and _age(path, now) >= policy.tmp_grace_s:
            actions.append(GcAction("checkpoint-tmp", path, f"unfinished save untouched for "
                                    f"{_days(policy.tmp_grace_s)}", size_of(path)))
    return actions


def _plan_weights(root: Path, policy: GcPolicy, now: float) -> list[GcAction]:
    from stream_rl.weights.delta import doomed_versions
    from stream_rl.weights.publisher import DELTA_FILE, STORE_FILE, STORE_TMP  # the publisher's own file names

    if not root.is_dir():
        return []
    files, deltas, tmps = {}, {}, []
    for path in root.iterdir():
        if (match := STORE_FILE.match(path.name)) and path.is_file():
            files[int(match.group(1))] = path
        elif (match := DELTA_FILE.match(path.name)) and path.is_file():
            deltas[int(match.group(1))] = path
        elif (match := STORE_TMP.match(path.name)) and path.is_file():
            tmps.append((int(match.group(1)), path))
    actions = []
    for version in doomed_versions(set(files), set(deltas), policy.keep_weights):  # keeps what a delta needs
        path = files.get(version) or deltas[version]
        if _old_enough(path, policy, now):
            actions.append(GcAction("weights", path, f"version {version} is not among the newest "
                                    f"{policy.keep_weights} nor needed to rebuild one of them", size_of(path)))
    newest = max([*files, *deltas], default=-1)
    for version, path in sorted(tmps):
        if version <= newest and _age(path, now) >= policy.tmp_grace_s:
            actions.append(GcAction("weights-tmp", path, f"abandoned write of version {version} "
                                    f"(newest complete: {newest})", size_of(path)))
    return actions


def _run_file_candidates(paths: GcPaths) -> list[Path]:
    found = []
    if paths.logs_dir.is_dir():
        found += [p for p in paths.logs_dir.iterdir() if _LOG.match(p.name)]
    spans = paths.spans_file
    if spans.parent.is_dir():
        found += [p for p in spans.parent.iterdir() if p.name == spans.name or
                  (p.name.startswith(spans.name + ".") and p.name[len(spans.name) + 1:].split(".")[0].isdigit())]
    if paths.telemetry_dir.is_dir():
        found += [p for p in paths.telemetry_dir.iterdir() if _JSONL.match(p.name)]
    return sorted(p for p in set(found) if p.is_file() and not p.is_symlink())


def _plan_run_files(paths: GcPaths, policy: GcPolicy, now: float) -> list[GcAction]:
    if policy.older_than_s is None:
        return []
    return [GcAction("run-file", p, f"not modified for {_days(policy.older_than_s)}", size_of(p))
            for p in _run_file_candidates(paths) if _age(p, now) >= policy.older_than_s]


def apply_gc(actions: list[GcAction]) -> list[GcAction]:
    """Remove what ``actions`` name; a path already gone is skipped. Returns the actions carried out."""
    done = []
    for action in actions:
        path = action.path
        if not os.path.lexists(path):
            continue
        if path.is_dir() and not path.is_symlink():  # only checkpoints and their temporary directories
            from stream_rl.storage.checkpoint import delete_checkpoint_dir

            delete_checkpoint_dir(path)  # via .del-*, as the trainer's pruning: never a partial step-* left
        else:
            path.unlink()
        done.append(action)
    return done


def format_actions(actions: list[GcAction], dry_run: bool) -> str:
    """One line per action and a total, e.g. ``remove checkpoint runs/x/checkpoints/step-00000100 (12.0 MB): ...``."""
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} {a.kind} {a.path} ({a.size_bytes / 1e6:.1f} MB): {a.reason}" for a in actions]
    total = sum(a.size_bytes for a in actions)
    lines.append(f"{verb} {len(actions)} item(s), {total / 1e6:.1f} MB" if actions else "nothing to remove")
    return "\n".join(lines) + "\n"
