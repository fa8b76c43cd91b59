"""One line for every failure a person can act on, applied once, in ``main()``, around every command.

Consumes: an exception that escaped a command (its class, message and traceback) and the config the command
resolved, if it got that far (for addresses and timeouts).
Produces: ``error: <what failed, the value or address, what to do>`` on stderr and the exit code: 1 for a runtime
failure (no broker, a role stopped by the broker, a port in use), 2 for bad input or config (an invalid config, a
missing or invalid model directory, a bad prompt file or reward function), an alert's own code for an alert that
stopped a role.
Guarantees: only the exception types in :data:`EXPECTED` are shortened, recognised by class name along the MRO
(so recognising them imports nothing heavy); anything else is a bug and keeps its traceback, and so does every
exception under ``stream-rl --debug`` or ``STREAM_RL_DEBUG=1``.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Callable

import typer

NO_BROKER_HINT = "start one with `stream-rl broker up` or pass --bootstrap HOST:PORT"
_debug = False


def set_debug(flag: bool) -> None:
    """``stream-rl --debug``: show the traceback of every failure."""
    global _debug
    _debug = flag


def debug_enabled() -> bool:
    return _debug or os.environ.get("STREAM_RL_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def no_broker_message(bootstrap: str, seconds: float | None, silent_s: float | None = None) -> str:
    """The line for a broker that did not answer: how long this process has heard nothing from any broker when it
    had before (``silent_s``, an outage), else how long the failing client tried (``seconds``, at start)."""
    if silent_s is not None and (seconds is None or silent_s > seconds):
        return (f"no Kafka broker at {bootstrap}: no answer for {silent_s:.0f} s (this process last heard from a "
                f"broker {silent_s:.0f} s ago): {NO_BROKER_HINT}")
    tried = f" (tried for {seconds:g} s)" if seconds is not None else ""
    return f"no Kafka broker at {bootstrap}{tried}: {NO_BROKER_HINT}"


def _silent_for(bootstrap: str) -> float | None:
    """:func:`stream_rl.transport.sink.silent_for`, when the transport was loaded (it is, if a client failed)."""
    sink = sys.modules.get("stream_rl.transport.sink")
    return sink.silent_for(bootstrap) if sink is not None else None


def _cfg():
    from stream_rl.cli.common import resolved_config

    return resolved_config()


def _bootstrap(cfg) -> str:
    return getattr(getattr(cfg, "kafka", None), "bootstrap_servers", None) or "the local broker"


def _with_broker(exc: BaseException) -> str:
    return f"{type(exc).__name__} (broker {_bootstrap(_cfg())}): {exc}"


def _kafka_timeout(exc: BaseException) -> str:
    found = re.search(r"Unable to bootstrap from \[(.*)\]", str(exc))
    if found is None:
        return _kafka_error(exc)
    bootstrap = ",".join(s.strip(" '\"") for s in found.group(1).split(","))
    kafka = getattr(_cfg(), "kafka", None)
    seconds = min(kafka.connect_timeout_s, kafka.broker_timeout_s) if kafka is not None else None
    return no_broker_message(bootstrap, seconds, _silent_for(bootstrap))


def _kafka_error(exc: BaseException) -> str:
    return (f"Kafka error from broker {_bootstrap(_cfg())}: {exc} (check the address and the kafka.* security "
            f"settings; `stream-rl broker status` tells whether it answers)")


def _model(exc: BaseException) -> str:
    return (f"{exc} (check producer.model_dir, trainer.model_dir and the scorer's model directories; "
            f"`stream-rl demo init DIR` builds the demo's)")


def _address_in_use(exc: OSError) -> str | None:
    """A bind that failed: name the address when the frame that bound it holds ``host``/``port``."""
    if exc.errno != errno.EADDRINUSE:
        return None
    tb, where = exc.__traceback__, ""
    while tb is not None:
        frame = tb.tb_frame
        if "port" in frame.f_locals and "stream_rl" in frame.f_code.co_filename:
            host, port = frame.f_locals.get("host", "127.0.0.1"), frame.f_locals["port"]
            module = frame.f_globals.get("__name__", "")
            what = "telemetry.http_port" if "telemetry" in module else "broker.port" if "broker" in module else "port"
            where = f" {host}:{port} ({what})"
        tb = tb.tb_next
    return (f"address already in use:{where or ' ' + str(exc)}: another process holds it; stop it or choose "
            f"another port (0 picks a free one)")


def _broker(exc: BaseException) -> str:
    """A broker that could not start on a port another process holds says so instead of quoting tansu's panic."""
    text = str(exc)
    port = getattr(getattr(_cfg(), "broker", None), "port", None)
    if "AddrInUse" in text or "Address in use" in text or "address already in use" in text.lower():
        where = f" 127.0.0.1:{port} (broker.port={port})" if port else ""
        return (f"the local broker could not listen on{where or ' its port'}: the address is already in use; stop "
                f"the process holding it or choose another port (broker.port unset picks a free one)")
    return text


def _alert(exc: BaseException) -> str:
    return f"stopped by alert: {exc}"


def _plain(exc: BaseException) -> str:
    return str(exc)


def _named(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


EXPECTED: dict[str, tuple[int, Callable[[BaseException], str]]] = {
    "stream_rl.config.ConfigError": (2, _plain),
    "stream_rl.broker.BrokerError": (1, _broker),
    "stream_rl.broker.object_store.StoreError": (1, lambda e: f"durable broker storage: {e}"),
    "stream_rl.transport.sink.BrokerUnreachable": (1, _plain),
    "stream_rl.transport.sink.DeliveryError": (1, _with_broker),
    "stream_rl.transport.membership.NoAssignment": (1, _with_broker),
    "stream_rl.transport.topics.TopicError": (1, _with_broker),
    "consumers.trainer.positions.OffsetLossError": (1, _with_broker),
    "consumers.trainer.versions.ForeignRunError": (2, _plain),
    "kafka.errors.KafkaTimeoutError": (1, _kafka_timeout),
    "kafka.errors.BrokerResponseError": (1, _kafka_error),  # the broker refused: authorization, SASL, ...
    "kafka.errors.KafkaConnectionError": (1, _kafka_error),
    "stream_rl.alerts.monitor.AlertStop": (3, _alert),
    "stream_rl.models.loading.ModelLoadError": (2, _model),
    "stream_rl.rewards.contract.RewardFnError": (2, _named),
    "stream_rl.rewards.jail.SandboxUnavailable": (1, lambda e: f"{e} (see `stream-rl doctor`, docs/reward-services.md)"),
    "stream_rl.prompts.schema.PromptFileError": (2, _plain),
    "stream_rl.weights.payload.WeightsError": (1, _named),
    "producers.engines.base.EngineError": (1, _named),
    "producers.environment.EnvironmentLoadError": (2, _plain),
    "stream_rl.storage.checkpoint.CheckpointError": (1, _named),
    "consumers.trainer.launch.RankDied": (1, _plain),
    "consumers.trainer.ranks.RankFailure": (1, _named),
    "stream_rl.operator_tools.status_read.StatusError": (1, _plain),
    "stream_rl.operator_tools.report.ReportError": (1, _plain),
    "stream_rl.operator_tools.trace_view.TraceViewError": (1, _plain),
}
"""Expected failures: ``module.Class`` -> (exit code, the one line). The first class along the MRO wins."""


def explain(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) for an expected failure, None for anything else (a bug: keep the traceback)."""
    if isinstance(exc, OSError):
        line = _address_in_use(exc)
        if line is not None:
            return 1, line
    for cls in type(exc).__mro__:
        known = EXPECTED.get(f"{cls.__module__}.{cls.__qualname__}")
        if known is not None:
            code, render = known
            return getattr(exc, "exit_code", code) if render is _alert else code, render(exc).strip()
    return None


def run_app(app: Callable[[], object]) -> None:
    """Run the CLI; an expected failure ends it with one line and its exit code, anything else propagates."""
    try:
        app()
    except Exception as exc:
        known = explain(exc)
        if known is None or debug_enabled():
            raise
        code, line = known
        typer.echo(f"error: {line}", err=True)
        sys.exit(code)
