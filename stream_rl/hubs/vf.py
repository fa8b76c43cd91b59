"""verifiers tasksets (PyPI ``verifiers``, ``verifiers.v1``) as a prompt source, scored by the task's own rewards.

Consumes: a source spec ``verifiers:TASKSET_ID?size=N`` (where a prompt file's path goes: ``run.prompts_file``,
``stream-rl prompts load/validate``); ``TASKSET_ID`` is what verifiers loads by id (``vf.load_taskset``): an
installed taskset package (``my_taskset``, or a hub id ``owner/my-taskset@1.0`` installed as ``my_taskset``) or
one that ships with verifiers (``verifiers.v1.tasksets.*``); ``size`` (default 100) takes its first ``size`` tasks.
Produces: per task, a plain-layout record::

    prompt_id  "vf-TASKSET-INDEX"
    text       the task's prompt (a string prompt without a system prompt), else
    messages   its system prompt and messages as chat messages (rendered with the policy's chat template)
    metadata   data_source "verifiers/TASKSET", vf_taskset, vf_size, vf_index, vf_key (the task's key)

and the ``verifiers`` reward (:func:`verifiers_reward`, a short name of :mod:`stream_rl.rewards.names`): it
rebuilds task ``vf_index`` of the same taskset, checks its key, builds a verifiers ``Trace`` of the prompt and the
response (one sampled assistant message) and returns ``trace.reward`` after ``task.score(trace)``: the weighted
sum of the task's ``@vf.reward`` functions and plugged judges, verifiers' own rubric.

Guarantees:
- A rebuilt task whose key differs from ``vf_key`` (the taskset changed under the run) fails that rollout with the
  reason; so does a rollout without the ``vf_*`` metadata, a task whose rewards all need a runtime (a sandbox: they
  are skipped offline, so nothing would be scored), and any error verifiers raises while scoring (its ``TaskError``
  names the task and the cause). The scorer dead-letters those rollouts with the reason.
- Tasksets are loaded once per (id, size) and kept (at most :data:`CACHED`).
- ``verifiers`` is imported only here, when a spec or the reward is used; without it, :class:`HubMissing`.
- The task's code runs in the scorer as any reward: under ``scorer.reward_timeout_s``, and in worker processes
  with ``scorer.reward_isolation = "process"`` (its import alone takes seconds: start workers once).
- Not adapted: verifiers' agent loop (``Env``/``Harness``: an agent program calling a model through an OpenAI
  endpoint, tools over MCP, sandboxes). The policy answers each task in one turn here; an agent harness can train
  through the gateway (docs/agents.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl

from stream_rl.hubs import HubMissing

PREFIX = "verifiers:"
CACHED = 8
MAX_SIZE = 100_000
_KEYS = ("vf_taskset", "vf_size", "vf_index", "vf_key")


class SpecError(ValueError):
    """A ``verifiers:`` spec that names no usable taskset; ``str()`` says why."""


def parse_spec(source: object) -> tuple[str, int]:
    """``(taskset_id, size)`` of a spec; :class:`SpecError` naming what is wrong."""
    body = str(source)[len(PREFIX):]
    taskset, _, query = body.partition("?")
    if not taskset:
        raise SpecError(f"{source}: no taskset id (write verifiers:TASKSET_ID?size=N)")
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - {"size"})
    if unknown:
        raise SpecError(f"{source}: unknown option {', '.join(unknown)} (a verifiers: source takes size)")
    try:
        size = int(options.get("size", 100))
    except ValueError:
        raise SpecError(f"{source}: size must be an integer") from None
    if not 1 <= size <= MAX_SIZE:
        raise SpecError(f"{source}: size must be between 1 and {MAX_SIZE}, got {size}")
    return taskset, size


def records(source: object) -> Iterator[tuple[int, dict]]:
    """``(row, record)`` for the spec's first ``size`` tasks, in the taskset's order (module docstring)."""
    taskset, size = parse_spec(source)
    name = taskset_name(taskset)
    for index, task in enumerate(_tasks(taskset, size)):
        record = {"prompt_id": f"vf-{name}-{index}", **_prompt(task),
                  "metadata": {"data_source": f"verifiers/{name}", "vf_taskset": taskset, "vf_size": str(size),
                               "vf_index": str(index), "vf_key": str(task.key)}}
        yield index + 1, record


def verifiers_reward(prompt: str, response: str, answer: str | None, metadata: dict[str, str]) -> float:
    """The task's own weighted reward for ``response`` (module docstring); ValueError with the reason when the
    metadata names no task or nothing can score it."""
    missing = [key for key in _KEYS if key not in metadata]
    if missing:
        raise ValueError(f"not a verifiers prompt: metadata has no {', '.join(missing)} (load the prompts from a "
                         f"verifiers:TASKSET source)")
    try:
        size, index = int(metadata["vf_size"]), int(metadata["vf_index"])
    except ValueError:
        raise ValueError("verifiers metadata vf_size and vf_index must be integers") from None
    if not 0 <= index < size <= MAX_SIZE:
        raise ValueError(f"verifiers metadata: vf_index {index} outside a taskset of {size}")
    tasks = _tasks(metadata["vf_taskset"], size)
    if index >= len(tasks):
        raise ValueError(f"verifiers taskset {metadata['vf_taskset']!r} has {len(tasks)} tasks, no task {index}")
    task = tasks[index]
    if str(task.key) != metadata["vf_key"]:
        raise ValueError(f"verifiers taskset {metadata['vf_taskset']!r} task {index} is not the task that was "
                         f"asked (its key changed)")
    trace = _trace(task, response)
    _run(task.score(trace))
    unscored = sorted(name for name, value in trace.rewards.items() if value is None)
    if not trace.rewards or unscored:
        raise ValueError(f"verifiers task {type(task).__name__}: no reward scored it offline"
                         + (f" ({', '.join(unscored)} unscored)" if unscored else
                            " (its rewards need a runtime, or it has none)"))
    return float(trace.reward)


def taskset_name(taskset: str) -> str:
    """A taskset id's name (``owner/name@1.0`` -> ``name``): the ``NAME`` of ``data_source = verifiers/NAME``."""
    return taskset.rsplit("/", 1)[-1].split("@", 1)[0]


def _prompt(task) -> dict:
    """``{"text": ...}`` for a plain string prompt, else ``{"messages": [...]}``."""
    from verifiers.v1.types import content_text

    data = task.data
    if isinstance(data.prompt, str) and not data.system_prompt:
        return {"text": data.prompt}
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages += [{"role": str(m.role), "content": content_text(m.content)} for m in data.prompt or []]
    return {"messages": messages}


def _trace(task, response: str):
    """A verifiers trace of one turn: the task's prompt, then ``response`` as the sampled assistant message."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode

    prompt = vf.UserMessage(content=task.data.prompt_text)
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig(), name="stream-rl", trainable=True),
                    nodes=[MessageNode(message=prompt),
                           MessageNode(parent=0, message=vf.AssistantMessage(content=response), sampled=True)],
                    root_reply=response, is_completed=True, ok=True)


def _run(coroutine) -> None:
    """Run ``coroutine`` to the end, from a thread with or without an event loop of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coroutine)
        return
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, coroutine).result()


@functools.lru_cache(maxsize=CACHED)
def _tasks(taskset: str, size: int) -> list:
    """The first ``size`` tasks of the taskset (loaded once); SpecError for an id verifiers cannot load."""
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise HubMissing("verifiers", "a verifiers: prompt source or the verifiers reward") from None
    try:
        loaded = vf.load_taskset(vf.taskset_config_type(taskset)(id=taskset))
    except (ImportError, TypeError, ValueError, AttributeError) as exc:
        raise SpecError(f"verifiers cannot load taskset {taskset!r}: {type(exc).__name__}: "
                        f"{str(exc)[:300]}") from None
    tasks: list[Any] = []
    for task in loaded:
        if len(tasks) == size:
            break
        tasks.append(task)
    return tasks
