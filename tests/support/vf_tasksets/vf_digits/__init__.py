"""A verifiers taskset a tiny policy can learn in a few steps, for the driver's run through `stream-rl run`: sums to
answer, rewarded by its own ``@vf.reward`` (the share of the reply's characters that are digits: a dense signal).
Loaded by id as ``vf_digits`` with tests/support/vf_tasksets on the path."""

import verifiers.v1 as vf


class DigitsTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def digits(self, trace) -> float:
        reply = trace.last_reply or ""
        return sum(c.isdigit() for c in reply) / len(reply) if reply else 0.0


class DigitsTaskset(vf.Taskset[DigitsTask, vf.TasksetConfig]):
    def load(self):
        for i in range(64):
            a, b = 1 + i % 9, 1 + (i * 7) % 9
            yield DigitsTask(vf.TaskData(prompt=f"What is {a}+{b}?", id=f"sum-{i}"))


__all__ = ["DigitsTaskset"]
