"""``stream-rl drive``: the driver role, verifiers environments played by their own agent loop through the gateway.

Consumes: the ``driver`` section (the environment, verifiers' agent settings, the gateway's URL, epochs and
deadlines); the gateway's HTTP API (:mod:`producers.driver.gateway_client`: its group size, model name and policy
version, episode states, episode ends); verifiers (:mod:`stream_rl.hubs.vf_agents`), which runs the agent program
and its tools and scores each episode with the task's own rubric.
Produces: episodes on the gateway, one group per task and epoch: the agent program's model calls are recorded by
the gateway (so they are trained as any agent's), and each episode is ended with verifiers' reward and the task's
metadata (``data_source = verifiers/NAME``, ``vf_taskset``, ``vf_index``, ``vf_key``, ``vf_epoch``), or as failed
with the reason; a :class:`Summary`. It touches no topic itself: the gateway records, publishes and dead-letters.

One life::

    load the environment ─► ask the gateway its group size and model ─► per task and epoch (a group):
        each episode's state ─► end the ones a dead driver left open ─► play the new ones at once ─► end each
        ─► a spare episode in place of each failure, while spares last ─► end each ...
        ─► (wait up to wait_for_version_s for a newer policy) ─► when done, return (or wait for the stop, under run)

Guarantees:
- Ids are fixed by the task and the epoch (:func:`episode_ids`: ``vf-NAME-INDEX-eEPOCH/K``), so a restarted driver
  picks up where the last one stopped: it plays only episodes the gateway never saw, ends as failed the ones left
  open (their calls are the dead driver's), and skips ended, published and dead-lettered ones: no episode is
  played twice and every group completes.
- An episode that fails (:class:`stream_rl.hubs.vf_agents.Outcome` with a reason: the harness did not start, a
  tool or reward raised, a deadline passed) is ended as failed: the gateway dead-letters it with the reason,
  before or after its first call. One that scored a reward but made no model call is ended as failed too (nothing
  of it could be trained).
- Refills: a group has ``driver.refills`` spare ids (``/K``, ``K >= group size``). While spares last, a failure is
  ended with ``refill`` (the gateway does not count it in its group) and a spare is played in its place, so the
  group is published whole; once they are spent, a failure counts and the group is published from the others.
  A restarted driver plays the replacements the gateway's group still owes (``group size - members - new
  episodes``, from the gateway's book), so a refill promised before a crash is kept; one never played is counted
  by the gateway after ``gateway.episode_timeout_s`` (its group then publishes without it).
- ``driver.max_failed_in_a_row`` failures in a row stop the driver with :class:`DriverError` naming the last
  reason; the gateway being unreachable stops it with ``GatewayUnavailable``.
- On stop, episodes in play are cancelled and ended as failed ("the driver was stopped"); none is left open.
- Environment code that blocks the event loop (a synchronous sleep in an async reward) cannot be cancelled: the
  watchdog (:mod:`producers.driver.watchdog`) ends the process within ``episode_timeout_s`` + 5 s, naming the
  cause, rather than letting the driver hang.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from producers.driver.config import DriverConfig
from producers.driver.gateway_client import GatewayClient, GatewayUnavailable
from producers.driver.watchdog import watched
from stream_rl.hubs.vf import taskset_name

log = logging.getLogger(__name__)
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@-]+")
META_CHARS = 256


class DriverError(RuntimeError):
    """The driver cannot go on; ``str()`` says why."""


@dataclass
class Summary:
    """What one driver played: groups visited, episodes ended with a reward, ended as failed, skipped (already
    closed on the gateway), and left-open ones it ended as failed."""

    groups: int = 0
    rewarded: int = 0
    failed: int = 0
    skipped: int = 0
    abandoned: int = 0
    refilled: int = 0  # of the failed: replaced by a spare episode of their group
    timed_out: int = 0  # of the failed: on a deadline
    reward_sum: float = 0.0
    last_reason: str = ""


def episode_ids(taskset: str, index: int, epoch: int, size: int, refills: int = 0) -> list[str]:
    """The ``size`` episode ids of task ``index`` in ``epoch`` (``vf-NAME-INDEX-eEPOCH/K``), then its ``refills``
    spare ids (``K`` from ``size`` on), played in place of failed ones."""
    name = _UNSAFE.sub("-", taskset_name(taskset)).strip("-") or "taskset"
    return [f"vf-{name[:64]}-{index}-e{epoch}/{k}" for k in range(size + refills)]


def task_metadata(taskset: str, index: int, key: object, epoch: int) -> dict[str, str]:
    """The metadata an episode of task ``index`` ends with (its rollouts carry it); each value at most
    :data:`META_CHARS` characters (a task's key is the taskset's to choose)."""
    out = {"data_source": f"verifiers/{taskset_name(taskset)}", "vf_taskset": taskset, "vf_index": str(index),
           "vf_key": str(key), "vf_epoch": str(epoch)}
    return {name: value[:META_CHARS] for name, value in out.items()}


def run_driver(dcfg: DriverConfig, stop_event: threading.Event | None = None, *, stay: bool = False,
               report: Callable[[str, Summary], None] | None = None) -> Summary:
    """Play the environment's groups through the gateway (module docstring); ``stay``: once done, wait for
    ``stop_event`` (under ``stream-rl run``, where a role that exits ends the run); ``report(environment name,
    summary)`` after every group and once done (the heartbeat's, :mod:`producers.driver.health`)."""
    from stream_rl.hubs.vf_agents import load_env

    stop_event = stop_event or threading.Event()
    if dcfg.gateway_url is None:
        raise DriverError("driver.gateway_url is not set (stream-rl run sets it to its gateway's)")
    _uv_on_path()
    env = load_env(dcfg.environment, dcfg.agent)
    client, summary = GatewayClient(dcfg.gateway_url), Summary()
    name = f"verifiers:{taskset_name(env.taskset)}"

    def beat() -> None:
        if report is not None:
            report(name, summary)

    asyncio.run(_drive(env, dcfg, client, stop_event, summary, beat))
    log.info("driver done: %d group(s), %d episode(s) rewarded (mean %.3f), %d failed (%d refilled), %d skipped, "
             "%d abandoned", summary.groups, summary.rewarded, summary.reward_sum / max(summary.rewarded, 1),
             summary.failed, summary.refilled, summary.skipped, summary.abandoned)
    while stay and not stop_event.wait(1.0):
        beat()
    return summary


async def _drive(env, dcfg: DriverConfig, client: GatewayClient, stop_event: threading.Event, summary: Summary,
                 beat: Callable[[], None]) -> None:
    health = await asyncio.to_thread(client.wait_ready, dcfg.gateway_wait_s)
    size, model = health["group_size"], health["model"]
    log.info("driving %s (%d task(s)) through %s: groups of %d, model %r", dcfg.environment, len(env.tasks),
             dcfg.gateway_url, size, model)
    in_a_row = 0
    async with env.serving(), watched(max(dcfg.episode_timeout_s, 5.0) + 5.0):
        for epoch in range(dcfg.epochs):
            for index, task in enumerate(env.tasks):
                if stop_event.is_set() or (dcfg.max_groups is not None and summary.groups >= dcfg.max_groups):
                    return
                version = (await asyncio.to_thread(client.health))["version"]
                results = await _group(env, dcfg, client, task,
                                       episode_ids(env.taskset, index, epoch, size, dcfg.refills), size, model,
                                       task_metadata(env.taskset, index, task.key, epoch), stop_event, summary, beat)
                summary.groups += 1
                beat()
                for ok in results:
                    in_a_row = 0 if ok else in_a_row + 1
                    if in_a_row >= dcfg.max_failed_in_a_row:
                        raise DriverError(f"{in_a_row} episodes failed in a row "
                                          f"(driver.max_failed_in_a_row={dcfg.max_failed_in_a_row}); the last: "
                                          f"{summary.last_reason}")
                await _wait_for_version(client, version, dcfg.wait_for_version_s, stop_event)


async def _group(env, dcfg: DriverConfig, client: GatewayClient, task, ids: list[str], size: int, model: str,
                 meta: dict[str, str], stop_event: threading.Event, summary: Summary,
                 beat: Callable[[], None]) -> list[bool]:
    """Play one group: ``ids`` are its ``size`` episodes then its spare ids for refills. End the episodes a dead
    driver left open, play the new ones and the replacements the gateway's group still owes at once, end each, and
    play a spare in place of each failure while spares last (module docstring); whether each played episode got a
    reward."""
    base, spare = ids[:size], ids[size:]
    states = {e: (await asyncio.to_thread(client.state, e))["state"] for e in ids}
    fresh = [e for e in base if states[e] == "new"]
    spare = [e for e in spare if states[e] == "new"]
    summary.skipped += sum(states[e] not in ("new", "open") for e in base)
    promised = 0
    for episode in (e for e in ids if states[e] == "open"):  # a dead driver's: its calls cannot be continued
        refill = promised < len(spare)
        promised += await _end(client, episode, None, "the driver restarted while the episode was open", summary,
                               refill=refill) == "refilled"
        summary.abandoned += 1
    members = (await asyncio.to_thread(client.state, ids[0]))["members"]
    owed = min(max(size - members - len(fresh), 0), len(spare))  # replacements promised and not yet played
    play, spare = fresh + spare[:owed], spare[owed:]
    results = []
    while play:
        outcomes = await _play(env, dcfg, task, play, model, stop_event, beat)
        play = []
        for episode, outcome in outcomes.items():
            reward = outcome.reward if outcome is not None else None
            reason = "the driver was stopped" if outcome is None else outcome.reason
            summary.timed_out += outcome is not None and outcome.timed_out
            ended = await _end(client, episode, reward, reason, summary, meta,
                               refill=bool(spare) and not stop_event.is_set())
            results.append(ended == "rewarded")
            if ended == "refilled":
                play.append(spare.pop(0))
        if stop_event.is_set():  # the replacements promised are left to a restarted driver, or to the gateway
            break
    return results


async def _play(env, dcfg: DriverConfig, task, episodes: list[str], model: str, stop_event: threading.Event,
                beat: Callable[[], None]) -> dict[str, object | None]:
    """Play ``episodes`` of ``task`` at once (``beat()`` every half second meanwhile); each one's
    :class:`~stream_rl.hubs.vf_agents.Outcome`, None for one cancelled by the stop."""
    plays = {episode: asyncio.create_task(env.play(task, dcfg.gateway_url, model, episode, dcfg.episode_timeout_s))
             for episode in episodes}
    while not all(p.done() for p in plays.values()):
        await asyncio.wait(list(plays.values()), timeout=0.5)
        beat()
        if stop_event.is_set():
            for play in plays.values():
                play.cancel()
            break
    return {episode: None if play.cancelled() or not play.done() else play.result() for episode, play in plays.items()}


async def _end(client: GatewayClient, episode: str, reward: float | None, reason: str | None, summary: Summary,
               meta: dict[str, str] | None = None, refill: bool = False) -> str:
    """End ``episode`` with its reward, or as failed with ``reason`` (``refill``: another episode of its group
    takes its place); ``rewarded``, ``refilled`` or ``failed``."""
    closed = False  # by the gateway before the driver ended it (its episode_timeout_s): dead-lettered there
    if reward is not None:
        try:
            await asyncio.to_thread(client.end, episode, {"reward": reward, "metadata": meta or {}})
            summary.rewarded += 1
            summary.reward_sum += reward
            return "rewarded"
        except GatewayUnavailable as exc:
            if exc.status not in (404, 409):
                raise
            closed = exc.status == 409
            reason = (f"closed by the gateway before the driver ended it: {exc}" if closed else
                      "the episode scored a reward but made no model call (nothing of it can be trained)")
    summary.failed += 1
    summary.last_reason = reason or "failed"
    log.warning("episode %s failed%s: %s", episode, " (refilled)" if refill and not closed else "", reason)
    if closed:
        return "failed"
    try:
        await asyncio.to_thread(client.end, episode, {"failed": summary.last_reason, "refill": refill})
    except GatewayUnavailable as exc:
        if exc.status != 409:  # already closed by the gateway (timed out): it is dead-lettered there
            raise
        return "failed"
    summary.refilled += refill
    return "refilled" if refill else "failed"


async def _wait_for_version(client: GatewayClient, version: int, wait_s: float, stop_event: threading.Event) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not stop_event.is_set():
        if (await asyncio.to_thread(client.health))["version"] > version:
            return
        await asyncio.sleep(0.2)


def _uv_on_path() -> None:
    """verifiers prepares its agent programs with ``uv`` (the ``envs`` extra installs it beside this Python): put
    this environment's scripts first on PATH, so the one installed is the one found."""
    scripts = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != scripts:
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
