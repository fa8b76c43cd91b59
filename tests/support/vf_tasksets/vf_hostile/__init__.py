"""A hostile verifiers taskset for the driver's tests, one behaviour per task id: ``ok`` (reward 1), ``raises``
(its reward raises), ``hangs`` (its reward awaits forever), ``nan`` (its reward is NaN), ``blocks`` (its reward
blocks the event loop in a synchronous sleep of 600 s), ``flaky`` (its first grading raises, the later ones give
1: the first grader creates the file ``$VF_FLAKY_FILE``, atomically). Loaded by id as ``vf_hostile`` with
tests/support/vf_tasksets on the path; its tasks are those named in ``$VF_HOSTILE_TASKS`` (comma-separated, in that
order), by default ok, raises, hangs, nan, blocks (a driver takes the first ``size``)."""

import asyncio
import os
import time

import verifiers.v1 as vf


class HostileTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def graded(self, task, trace) -> float:
        if task.id == "raises":
            raise RuntimeError("the grader crashed")
        if task.id == "hangs":
            await asyncio.sleep(3600)
        if task.id == "nan":
            return float("nan")
        if task.id == "blocks":
            time.sleep(600)
        if task.id == "flaky":
            try:
                os.close(os.open(os.environ["VF_FLAKY_FILE"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return 1.0
            raise RuntimeError("the grader failed once")
        return 1.0


class HostileTaskset(vf.Taskset[HostileTask, vf.TasksetConfig]):
    def load(self):
        for name in os.environ.get("VF_HOSTILE_TASKS", "ok,raises,hangs,nan,blocks").split(","):
            yield HostileTask(vf.TaskData(prompt=f"task {name}", id=name))


__all__ = ["HostileTaskset"]
