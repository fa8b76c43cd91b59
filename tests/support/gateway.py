"""The agents' gateway on a thread of the test process (``run_gateway`` with a given engine), and the end-of-episode
call an agent's environment makes: shared by the gateway tests on the hf engine and on the server fleet."""

from __future__ import annotations

import json
import threading
import urllib.request
from dataclasses import dataclass, field


@dataclass
class GatewayThread:
    """A running gateway: ``url`` (the OpenAI base URL), its thread, the event that stops it, and ``error``, what
    ``run_gateway`` raised (None while it runs or when it ended cleanly)."""

    url: str
    thread: threading.Thread
    stop: threading.Event
    out: dict = field(default_factory=dict)

    @property
    def error(self) -> BaseException | None:
        return self.out.get("error")

    def finish(self, timeout_s: float = 30.0) -> None:
        """Stop it and wait for its thread."""
        self.stop.set()
        self.thread.join(timeout_s)


def start_gateway(cfg, engine, ready_s: float = 60.0) -> GatewayThread:
    """``run_gateway`` on ``cfg`` (its ``gateway`` and ``producer`` sections) with ``engine`` on a daemon thread;
    returns once it serves (AssertionError with the cause when it failed to start)."""
    from producers.gateway.role import GatewayDeps, run_gateway

    ready, stop, out = threading.Event(), threading.Event(), {}

    def target() -> None:
        try:
            run_gateway(cfg, cfg.gateway, cfg.producer, stop,
                        deps=GatewayDeps(engine=engine, on_ready=lambda s: (out.update(url=s.url), ready.set())))
        except BaseException as exc:  # surfaced by the caller (GatewayThread.error)
            out["error"] = exc
            ready.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    assert ready.wait(ready_s) and "error" not in out, out.get("error")
    return GatewayThread(out["url"], thread, stop, out)


def end_episode(url: str, episode: str, body: dict) -> dict:
    """``POST {url}/episodes/{episode}/end`` with ``body`` (``{"reward": r}`` or ``{}``): the gateway's answer."""
    request = urllib.request.Request(f"{url}/episodes/{episode}/end", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())
