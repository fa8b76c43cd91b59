"""DAPO's sampling options of the trainer (``trainer.overlong``; ``trainer.dynamic_sampling`` is a flag beside it).

Consumes: values from the config file, ``STREAM_RL_TRAINER__OVERLONG__*`` variables and ``--set`` flags.
Produces: a validated :class:`OverlongConfig`.
Guarantees: the soft penalty's buffer fits in its length budget; ``max_len`` None takes
``producer.max_new_tokens`` (resolved by the root config, so ``--dry-run`` prints the number used).
Formulas: ``stream_rl.algorithms.shaping`` (DAPO, Yu et al. 2025, section 3.4).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from stream_rl.config.base import Section


class OverlongConfig(Section):
    """DAPO's overlong handling: mask truncated responses out of the loss and/or a soft length penalty."""

    filter: bool = Field(False, description="overlong filtering: a response cut at the length budget "
                                            "(finish_reason 'length') gets no loss; its reward still counts in its "
                                            "group's advantage statistics")
    buffer: int | None = Field(None, ge=1, description="soft overlong punishment: over the last `buffer` tokens of "
                               "`max_len` the reward falls linearly by up to `factor` (DAPO eq. 13), and by "
                               "`factor` beyond max_len; None: no penalty")
    max_len: int | None = Field(None, ge=1, description="the penalty's length budget L_max; None: "
                                                        "producer.max_new_tokens")
    factor: float = Field(1.0, gt=0.0, description="size of the full penalty (the reward falls by at most this)")

    @model_validator(mode="after")
    def _consistent(self) -> OverlongConfig:
        if self.buffer is not None and self.max_len is not None and self.buffer > self.max_len:
            raise ValueError(f"buffer={self.buffer} > max_len={self.max_len}: the penalty's ramp must fit in the "
                             f"length budget")
        return self
