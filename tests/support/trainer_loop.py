"""Trainer-loop test helpers: the trainer role run on a thread (``start``/``finish``), scored groups sent to its
topic (``send_groups``) and the metrics rows it wrote (``metric_rows``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from consumers.trainer.trainer import run_trainer
from support.trainer import scored


def send_groups(transport, sink, prompts, version: int, duplicate_of: int | None = None) -> None:
    for p in prompts:
        for s in range(2):
            rec = scored(p, s, version=version, reward=float(s == 0), response_ids=[6 + s, 7])
            sink.send(transport.names.scored, rec, key=rec.group_id)
    if duplicate_of is not None:
        rec = scored(duplicate_of, 0, version=0, reward=1.0, response_ids=[6, 7])
        sink.send(transport.names.scored, rec, key=rec.group_id)
    sink.flush()


def metric_rows(cfg) -> list[dict]:
    path = Path(cfg.run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def start(cfg, resume: bool = False):
    stop, result, errors = threading.Event(), {}, []

    def target():
        try:
            from stream_rl.cli.config import agreements  # what the CLI hands the trainer of the other sections
            result["state"] = run_trainer(cfg, cfg.trainer, stop_event=stop, resume=resume, agreements=agreements(cfg))
        except BaseException as exc:  # surfaced by finish()
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, stop, result, errors


def finish(thread, stop, result, errors, timeout_s: float = 90.0):
    thread.join(timeout_s)
    if thread.is_alive():
        stop.set()
        thread.join(30)
        raise AssertionError("trainer did not reach max_steps in time")
    if errors:
        raise errors[0]
    return result["state"]
