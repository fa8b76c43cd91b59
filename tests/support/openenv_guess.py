"""A real OpenEnv environment (openenv-core's server-side Environment, run in-process) for the hub tests: guess a
digit in three tries; its rubric rewards a right guess with 1 and a guess that is a digit with 0.1; ``Hung``,
``Crashing`` and ``Flooding`` are its hostile variants."""

from __future__ import annotations

import threading

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics import Rubric

RELEASE = threading.Event()  # set by a test to let the hung environments' abandoned threads end


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str = ""


class GuessRubric(Rubric):
    def forward(self, action: GuessAction, observation: GuessObservation) -> float:
        if observation.metadata.get("right"):
            return 1.0
        return 0.1 if action.guess.strip()[:1].isdigit() else 0.0


class GuessDigit(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session is an instance of its own (served over /ws)

    def __init__(self):
        super().__init__(rubric=GuessRubric())
        self._state, self.secret = State(step_count=0), 7

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.secret = (seed or 0) % 10
        return GuessObservation(feedback="Guess a digit.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        right = action.guess.strip()[:1] == str(self.secret)
        done = right or self._state.step_count >= 3
        obs = GuessObservation(feedback="right" if right else "higher or lower?", done=done,
                               metadata={"right": right})
        obs.reward = self._apply_rubric(action, obs)
        return obs

    @property
    def state(self) -> State:
        return self._state


class Hung(GuessDigit):
    def step(self, action, timeout_s=None, **kwargs):
        RELEASE.wait(60)
        return super().step(action)


class Crashing(GuessDigit):
    def step(self, action, timeout_s=None, **kwargs):
        raise RuntimeError("the game server died")


class Flooding(GuessDigit):
    def step(self, action, timeout_s=None, **kwargs):
        return GuessObservation(feedback="x" * 5_000_000, reward=0.5)


class HugeFlood(GuessDigit):  # over the 16 MiB a served environment's message may take
    def step(self, action, timeout_s=None, **kwargs):
        return GuessObservation(feedback="x" * 20_000_000, reward=0.5)


class NotAnEnv:
    pass
