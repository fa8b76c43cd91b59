"""``stream-rl gateway``: the gateway role, an OpenAI-compatible HTTP endpoint in front of the current policy for
black-box agents (docs/agents.md).

Consumes: the shared sections (``kafka``, ``topics``, ``weights``, ``data``: the chat template), the ``gateway``
section and the ``producer`` section (engine, model, sampling, token budget, ``follow_weights``); the run's gateway
topic at start-up (its calls and episode states) and the weights topic (new policy versions).
Produces: the HTTP endpoints of :mod:`producers.gateway.server`; records on the gateway topic, rollouts on the
rollouts topic, dead letters on the dlq topic (:mod:`producers.gateway.service`); heartbeats of role ``gateway``
on the status topic (:class:`~stream_rl.telemetry.role.RoleTelemetry`: version = the policy's, step = calls
answered, metrics = :meth:`~producers.gateway.service.Gateway.metrics` and ``gateway/dropped_clients``, the
clients cut off or gone), which ``stream-rl status`` shows as its gateways table.

One life::

    ensure topics ─► engine (catch up with the newest weights) ─► replay the gateway topic (book rebuilt, complete
    groups published) ─► serve ─► every sweep_interval_s: dead-letter idle episodes, update the heartbeat's counters
                                 every weights_check_s:  newer verified weights loaded (between calls, under the lock)

Guarantees: the gateway serves only after the replay, so a restart re-opens every open episode before its agent's
next call; weights change between calls, never during one (a call's tokens carry the version that sampled them);
on stop, the server is shut down and every client closed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from producers.config import ProducerConfig
from producers.engines.base import GenerationEngine
from producers.gateway.config import GatewayConfig
from producers.gateway.service import Gateway, Topics
from producers.weights_follower import ProducerStats, make_follower
from stream_rl.config.shared import SharedConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayDeps:
    """What a caller hands :func:`run_gateway` instead of building it (tests do); None: the production one."""

    engine: GenerationEngine | None = None
    """A loaded engine to reuse, closed by its owner; None: one built from ``pcfg``, closed on return."""
    on_ready: Callable[[object], None] | None = None
    """Called with the :class:`~producers.gateway.server.GatewayServer` once it serves (its ``url``)."""


def run_gateway(shared: SharedConfig, gcfg: GatewayConfig, pcfg: ProducerConfig,
                stop_event: threading.Event | None = None, *, deps: GatewayDeps | None = None) -> Gateway:
    """Serve until ``stop_event`` is set; returns the gateway (its book, for the caller's summary)."""
    from producers.engines import build_engine
    from stream_rl.telemetry.role import RoleTelemetry
    from stream_rl.transport.client import Transport

    deps = deps or GatewayDeps()
    stop_event = stop_event or threading.Event()
    transport = Transport(shared, "gateway")
    topic = transport.names.gateway
    transport.ensure_topics()
    engine = deps.engine if deps.engine is not None else build_engine(pcfg)
    sink = transport.sink()
    follower = make_follower(transport, shared.weights, pcfg, engine, ProducerStats())
    telemetry = RoleTelemetry(shared, "gateway", transport)  # heartbeats (stream-rl status)
    server = None
    try:
        gateway = _gateway(engine, sink, transport, topic, shared, gcfg, pcfg)
        with transport.reader() as reader:
            read = gateway.replay(_records(reader, topic))
        log.info("gateway replayed %d record(s): %d open episode(s)", read, len(gateway.book.open))
        server = _serve(gateway, gcfg)
        if deps.on_ready is not None:
            deps.on_ready(server)
        telemetry.set_ready(model_loaded=True, version=engine.version)
        _loop(gateway, follower, gcfg, stop_event, lambda: _report(telemetry, gateway, server))
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        for closable in (follower.receiver if follower else None, sink, telemetry):
            if closable is not None:
                closable.close()
        if deps.engine is None:
            engine.close()
    return gateway


def _gateway(engine, sink, transport, topic: str, shared: SharedConfig, gcfg: GatewayConfig,
             pcfg: ProducerConfig) -> Gateway:
    from producers.chat_turns import ChatTurns
    from stream_rl.prompts.render import ChatRenderer
    from stream_rl.prompts.templates import template_override

    data = shared.data
    template, kwargs = template_override(data.chat_template), dict(data.chat_template_kwargs)
    renderer = None if data.chat_template == "none" else ChatRenderer(engine.tokenizer, template, kwargs)
    topics = Topics(gateway=topic, rollouts=transport.names.rollouts, dlq=transport.names.dlq)
    return Gateway(engine, sink, topics, gcfg, pcfg.sampling(), pcfg.max_new_tokens,
                   pcfg.producer_id or transport.instance_id, renderer, ChatTurns(engine.tokenizer, template, kwargs))


def _records(reader, topic: str):
    """Every record of the gateway topic, partition by partition, from its first offset."""
    for partition in reader.partitions(topic):
        yield from reader.read_range(partition, 0, None)


def _serve(gateway: Gateway, gcfg: GatewayConfig):
    from producers.gateway.server import GatewayServer

    server = GatewayServer(gateway, host=gcfg.host, port=gcfg.port, max_body_bytes=gcfg.max_body_bytes,
                           connection_timeout_s=gcfg.connection_timeout_s, max_connections=gcfg.max_connections)
    threading.Thread(target=server.serve_forever, name="gateway-http", daemon=True).start()
    log.info("gateway serving %r at %s", gcfg.model_name, server.url)
    return server


def _report(telemetry, gateway: Gateway, server) -> None:
    """The heartbeat's state: liveness, the policy version, calls answered, the gateway's counters."""
    metrics = {**gateway.metrics(), "gateway/dropped_clients": float(server.dropped),
               "gateway/refused_connections": float(server.refused)}
    telemetry.step_metrics = metrics
    telemetry.set_step(int(metrics["gateway/calls"]))
    telemetry.set_version(gateway.engine.version)
    telemetry.tick()


def _loop(gateway: Gateway, follower, gcfg: GatewayConfig, stop_event: threading.Event,
          report: Callable[[], None]) -> None:
    """Sweep idle episodes, follow the weights and ``report`` until ``stop_event`` is set."""
    next_weights = time.monotonic() + gcfg.weights_check_s
    report()
    while not stop_event.wait(gcfg.sweep_interval_s):
        gateway.sweep()
        report()
        if follower is not None and time.monotonic() >= next_weights:
            with gateway.lock:  # between calls: a call's tokens all come from one version
                follower.update()
            next_weights = time.monotonic() + gcfg.weights_check_s
