"""A verifiers taskset bundling a two-agent environment (a solver and a critic seat): the driver refuses it at start,
naming the seats. Loaded by id as ``vf_duo`` with tests/support/vf_tasksets on the path."""

import verifiers.v1 as vf


class DuoConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    critic: vf.AgentConfig = vf.AgentConfig()


class DuoEnv(vf.Env[DuoConfig]):
    async def run(self, task, agents) -> None:
        await agents.solver.run(task)
        await agents.critic.run(task)


class DuoTaskset(vf.Taskset[vf.Task[vf.TaskData, vf.State, vf.TaskConfig], vf.TasksetConfig]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="solve", id="one"))


__all__ = ["DuoConfig", "DuoEnv", "DuoTaskset"]
