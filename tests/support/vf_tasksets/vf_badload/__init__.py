"""A hostile verifiers taskset whose task listing raises after one task: the driver must refuse it with one line.
Loaded by id as ``vf_badload`` with tests/support/vf_tasksets on the path."""

import verifiers.v1 as vf


class BadTaskset(vf.Taskset[vf.Task[vf.TaskData, vf.State, vf.TaskConfig], vf.TasksetConfig]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="one", id="one"))
        raise OSError("the task database is gone")


__all__ = ["BadTaskset"]
