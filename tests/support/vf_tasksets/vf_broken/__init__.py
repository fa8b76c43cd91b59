"""A hostile verifiers taskset: task 0's reward raises, task 1's needs a sandbox (a runtime), so offline nothing
scores it. Loaded by id as ``vf_broken`` with tests/support/vf_tasksets on the path."""

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def judged(self, task, trace) -> float:
        if task.id == "raises":
            raise RuntimeError("the grader crashed")
        return 1.0


class SandboxTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def tests_pass(self, trace, runtime) -> float:
        return 1.0


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        yield BrokenTask(vf.TaskData(prompt="anything", id="raises"))
        yield SandboxTask(vf.TaskData(prompt="anything else", id="sandbox"))


__all__ = ["BrokenTaskset"]
