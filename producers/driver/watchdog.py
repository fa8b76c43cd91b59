"""A watchdog over the driver's event loop: environment code that blocks the loop cannot be cancelled, so the
process ends instead of hanging.

Consumes: the running event loop (a ticker coroutine on it) and a limit in seconds.
Produces: :func:`watched`, an async context manager: while it is entered, a thread checks that the loop ticked
within ``limit_s``, else calls ``on_blocked(seconds)`` (default :func:`exit_blocked`: one error line on stderr,
then ``os._exit(EXIT_BLOCKED)``).
Guarantees: ``asyncio.timeout`` ends an episode that awaits too long, but not one whose code blocks the thread (a
synchronous sleep or a busy loop in an ``async`` reward or tool): then no coroutine runs, no deadline fires and no
episode can end. The watchdog turns that into an exit within ``limit_s`` + 0.5 s, naming the cause; the gateway
keeps every call, and a restarted driver ends the episodes left open as failed (:mod:`producers.driver.role`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable

log = logging.getLogger(__name__)
EXIT_BLOCKED = 70
TICK_S = 0.25


def exit_blocked(seconds: float) -> None:
    message = (f"driver stopped: its event loop was blocked for {seconds:.0f}s by the environment's code (a "
               f"synchronous call inside an async reward, tool or hook); the episodes in play are left open and a "
               f"restarted driver ends them as failed")
    log.error(message)
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_BLOCKED)


@contextlib.asynccontextmanager
async def watched(limit_s: float, on_blocked: Callable[[float], None] = exit_blocked) -> AsyncIterator[None]:
    """Watch the running loop while the body runs (module docstring)."""
    last = [time.monotonic()]
    done = threading.Event()

    async def tick() -> None:
        while True:
            last[0] = time.monotonic()
            await asyncio.sleep(TICK_S)

    def watch() -> None:
        while not done.wait(TICK_S):
            stalled = time.monotonic() - last[0]
            if stalled > limit_s:
                on_blocked(stalled)
                return

    ticker = asyncio.create_task(tick())
    thread = threading.Thread(target=watch, name="driver-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
