"""A verifiers taskset (verifiers.v1) for the hub tests: reverse a word; rewarded by its own two @vf.reward
functions (exact reversal, weight 1; a short answer, weight 0.5). Loaded by id as ``vf_reverse`` with tests/support/vf_tasksets on the path (support.paths.VF_TASKSETS)."""

import verifiers.v1 as vf

WORDS = ("abc", "hello", "stream", "kafka", "topic", "group")


class ReverseData(vf.TaskData):
    target: str = ""


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def reversed_word(self, task, trace) -> float:
        return 1.0 if trace.last_reply == task.target else 0.0

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        return 1.0 if len(trace.last_reply) <= 8 else 0.0


class ReverseTaskset(vf.Taskset[ReverseTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS:
            yield ReverseTask(ReverseData(prompt=f"Reverse: {word}", target=word[::-1], id=word))


__all__ = ["ReverseTaskset"]
