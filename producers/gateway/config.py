"""Configuration of the gateway for black-box agents (``cfg.gateway``; the root config holds
``gateway: GatewayConfig | None``, and ``stream-rl run`` starts the gateway when the section is set).

Consumes: nothing (a pydantic section, validated when the root config is loaded).
Produces: :class:`GatewayConfig`, read by :func:`producers.gateway.role.run_gateway` and ``stream-rl gateway``.
Guarantees: every field has a description and bounds; a sweep slower than the episode timeout is refused at load
naming both fields; no heavy import happens here. The policy engine, its sampling settings and its token budget
come from ``producer`` (engine, model_dir, temperature, max_new_tokens): the gateway is part of the producers role.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from stream_rl.config.base import CrossFieldError, Section


class GatewayConfig(Section):
    """``stream-rl gateway`` (and ``run`` with a ``[gateway]`` section): an OpenAI-compatible endpoint for agents."""

    host: str = Field("127.0.0.1", min_length=1, description="address to listen on (loopback by default)")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on; 0: a free one (logged at start)")
    model_name: str = Field("policy", min_length=1, max_length=200,
                            description="the model name agents must send; any other is refused (unknown model)")
    episode_timeout_s: float = Field(
        600.0, gt=0.0, le=86_400.0, description="an episode neither ended nor called for this long is "
        "dead-lettered with its reason (the agent crashed or hung), never trained")
    group_size: int = Field(
        1, ge=1, le=1024, description="episodes per group for episode ids GROUP/NAME: a group's rollouts are "
        "published once this many of its episodes ended or were dead-lettered (group-relative advantages need "
        "several); an id without '/' is a group of its own")
    max_calls_per_episode: int = Field(64, ge=1, le=4096, description="calls one episode may make")
    max_prompt_tokens: int = Field(4096, ge=1, le=1_048_576,
                                   description="longest rendered prompt a call may have, in tokens")
    max_body_bytes: int = Field(1_048_576, ge=1024, le=64 * 1_048_576,
                                description="largest request body, refused (413) before it is read")
    max_connections: int = Field(
        256, ge=1, le=100_000, description="connections handled at once (one thread each); one more is answered "
        "503 at once, without a thread, and closed: an agent fleet that opens connections by the thousand cannot "
        "exhaust the gateway's threads")
    connection_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0, description="seconds a client has to send its whole request, and again to read "
        "the whole answer; a slower one is cut off (the time a call takes to generate is not counted)")
    tool_format: Literal["auto", "hermes", "mistral"] = Field(
        "auto", description="how tool calls are read from a sampled answer when the call sends tools: hermes "
        "(<tool_call>{...}</tool_call>, Qwen2.5 and Hermes), mistral ([TOOL_CALLS][{...}], Mistral v0.3 and Nemo); "
        "auto: the format the chat template writes (mistral when it writes [TOOL_CALLS], else hermes)")
    sweep_interval_s: float = Field(1.0, gt=0.0, le=3600.0,
                                    description="how often timed-out episodes are looked for")
    weights_check_s: float = Field(2.0, gt=0.0, le=3600.0,
                                   description="how often newer policy weights are looked for")

    @model_validator(mode="after")
    def _sweep_within_timeout(self) -> GatewayConfig:
        if self.sweep_interval_s > self.episode_timeout_s:
            raise CrossFieldError(("gateway.sweep_interval_s", "gateway.episode_timeout_s"), (
                f"gateway.sweep_interval_s={self.sweep_interval_s:g} > gateway.episode_timeout_s="
                f"{self.episode_timeout_s:g}: timed-out episodes would wait a whole sweep; keep the sweep shorter"))
        return self
