"""Configuration of the driver (``cfg.driver``; the root config holds ``driver: DriverConfig | None``, and
``stream-rl run`` starts the driver, against its own gateway, when the section is set).

Consumes: nothing (a pydantic section, validated when the root config is loaded).
Produces: :class:`DriverConfig`, read by :func:`producers.driver.role.run_driver` and ``stream-rl drive``.
Guarantees: every field has a description and bounds; an environment that is not a ``verifiers:`` spec is refused
at load, naming the field; no heavy import happens here (verifiers loads the environment when the role starts).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from stream_rl.config.base import Section

DEFAULT_AGENT = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}


class DriverConfig(Section):
    """``stream-rl drive`` (and ``run`` with a ``[driver]`` section): verifiers environments played through the
    gateway, each episode ended with verifiers' own reward."""

    environment: str = Field(
        ..., min_length=1, description="the verifiers environment: verifiers:TASKSET_ID?size=N (an installed "
        "verifiers.v1 taskset package; its first size tasks, 100 by default)")
    agent: dict[str, Any] = Field(
        default_factory=lambda: {key: dict(value) for key, value in DEFAULT_AGENT.items()},
        description="verifiers' AgentConfig fields for the environment's agent seat: harness (the agent program; "
        "'null' is verifiers' chat loop, tools over MCP), runtime (where it runs: 'subprocess' on this machine, "
        "unsandboxed; 'docker' or 'prime' for isolation), max_turns, timeout, ...")
    gateway_url: str | None = Field(
        None, description="the gateway's base URL (http://HOST:PORT/v1); None: the run's own gateway "
        "([gateway] host and port, set by stream-rl run)")
    gateway_wait_s: float = Field(600.0, gt=0.0, le=86_400.0,
                                  description="how long to wait at start for the gateway to answer")
    epochs: int = Field(1, ge=1, le=10_000, description="passes over the environment's tasks")
    max_groups: int | None = Field(None, ge=1, description="stop after this many groups; None: every task of "
                                   "every epoch")
    episode_timeout_s: float = Field(300.0, gt=0.0, le=86_400.0,
                                     description="an episode still playing after this long is ended as failed")
    wait_for_version_s: float = Field(
        0.0, ge=0.0, le=3600.0, description="after each group, wait up to this long for the gateway's policy "
        "version to move before the next (on-policy pacing); 0: do not wait")
    refills: int = Field(
        1, ge=0, le=64, description="spare episodes per group, each played in place of a failed one (the failure "
        "is ended with refill, so the group is published whole); 0: a group is published from the episodes that "
        "did not fail")
    max_failed_in_a_row: int = Field(
        8, ge=1, le=100_000, description="stop with an error after this many episodes failed in a row (a harness "
        "that cannot start would otherwise dead-letter the whole taskset)")

    @field_validator("environment")
    @classmethod
    def _verifiers_spec(cls, value: str) -> str:
        if not value.startswith("verifiers:"):
            raise ValueError(f"driver.environment={value!r}: write verifiers:TASKSET_ID?size=N (the driver plays "
                             f"verifiers environments)")
        return value
