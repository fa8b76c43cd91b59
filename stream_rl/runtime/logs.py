"""Logging for role processes: our events at INFO, third-party libraries only when something is wrong.

Consumes: a `debug` flag from the command that starts a role (produce, score, train). Produces: one stderr handler
on the root logger (the run directory's ROLE-N.log under `stream-rl run`), one line per event:
`2026-01-01 12:00:00,000 INFO stream_rl.producer: ...`.

Guarantees:
- Without `debug`: loggers of this project (`stream_rl`, `producers`, `consumers`, `schemas`, ...) log at INFO;
  the libraries in `LIBRARY_LOGGERS` (kafka-python, urllib3, transformers, torch, ...) only at ERROR and above.
  With `debug`: ours at DEBUG, the libraries at INFO (kafka-python's DEBUG logs every request).
- In both modes `KnownNoiseFilter` drops exactly these kafka-python records that carry no action for an operator
  of this project: the selector's "Task ... ran for 0.148s (>0.100s threshold)" (a busy CPU, not a fault) and
  the cluster's "Topic ... topic_id changed from ... -- likely recreated" (tansu 0.6.0 answers metadata with
  changing topic ids, see docs/operations.md). It also drops the cluster's ERROR "Topic ....weights.vN not found
  in cluster metadata": a weights version topic the trainer's garbage collection deleted on purpose, which a
  client that once used it keeps asking for. And the transport's ERROR "<KafkaTCPTransport ... (closed)>: Error
  receiving network data closing socket": a read that raced the client's own close (the socket is already gone,
  ``'NoneType' object has no attribute 'recv'``; seen once when `stream-rl rescore` closed its clients). And the
  selector's ERROR "Error closing coroutine for cancelled task" whose exception is ``ValueError: generator already
  executing``: closing a task that is running at that moment, the same race at a client's close (seen once, a
  traceback in `stream-rl rescore`'s stderr after its one-line refusal). Any other record, kafka's errors
  included, passes.
- A kafka-python network record that carries a lost connection (an ``OSError``: reset, broken pipe, refused) as
  its exception is kept as one line, the error's type and text appended, without the traceback: a broker that went
  away is an operator's fact, not a program's fault (kafka-python logs it with ``log.exception``; seen when the
  broker died during a read). Any other exception keeps its traceback.
- Calling it again replaces the handler it installed (no duplicated lines); handlers installed by others stay.
"""

from __future__ import annotations

import logging
import os
import re

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LIBRARY_LOGGERS = (
    "kafka",
    "urllib3",
    "httpx",
    "httpcore",
    "filelock",
    "fsspec",
    "huggingface_hub",
    "transformers",
    "torch",
    "deepspeed",
    "vllm",
    "opentelemetry",
    "asyncio",
    "botocore",
    "s3transfer",
)
"""Top-level logger names of third-party libraries a role imports (their children inherit the level)."""

_SLOW_TASK = re.compile(r"^Task .* ran for [0-9.]+s \(>[0-9.]+s threshold\)", re.DOTALL)
_TOPIC_RECREATED = re.compile(r"^Topic \S+ topic_id changed from \S+ to \S+ -- likely recreated", re.DOTALL)
_COLLECTED_VERSION = re.compile(r"^Topic \S+\.weights\.v[0-9]+ not found in cluster metadata$", re.DOTALL)
_CANCELLED_CLOSE = re.compile(r"^Error closing coroutine for cancelled task$")
_CLOSED_RECV = re.compile(r"^<KafkaTCPTransport .*\(closed\)>: Error receiving network data closing socket$", re.DOTALL)
_KNOWN_NOISE = ((logging.WARNING, "kafka.net.selector", _SLOW_TASK, None),
                (logging.WARNING, "kafka.cluster", _TOPIC_RECREATED, None),
                (logging.ERROR, "kafka.cluster", _COLLECTED_VERSION, None),
                (logging.ERROR, "kafka.net.transport", _CLOSED_RECV, None),
                (logging.ERROR, "kafka.net.selector", _CANCELLED_CLOSE, (ValueError, "generator already executing")))
"""(level, logger, message pattern, the exception it must carry as (type, text), or None: whatever it carries)."""


class KnownNoiseFilter(logging.Filter):
    """Drops the known kafka-python noise (see the module docstring); keeps every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        for level, logger_name, pattern, raised in _KNOWN_NOISE:
            if (record.levelno == level and record.name == logger_name and pattern.match(record.getMessage())
                    and (raised is None or (isinstance(error, raised[0]) and str(error) == raised[1]))):
                return False
        if record.name.startswith("kafka.net") and isinstance(error, OSError):  # a lost connection: one line
            record.msg, record.args = f"{record.getMessage()}: {type(error).__name__}: {error}", None
            record.exc_info, record.exc_text = None, None
        return True


class _RoleHandler(logging.StreamHandler):
    """The handler `setup_role_logging` owns, recognised (and replaced) on a second call. Unless given a stream
    (``setStream``), it writes to the ``sys.stderr`` of the moment, not the one it was built with, so a replaced
    or closed stream (a test runner's capture) is never written to."""

    _explicit = None

    @property
    def stream(self):
        import sys

        return self._explicit if self._explicit is not None else sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        import sys

        self._explicit = None if value is sys.stderr else value


def setup_role_logging(debug: bool) -> logging.Handler:
    """Configure the root logger for a role process (see the module docstring); returns the handler."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _RoleHandler)]:
        root.removeHandler(old)
    handler = _RoleHandler()  # stderr, looked up at each record
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(KnownNoiseFilter())
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if debug else logging.ERROR)
    return handler
