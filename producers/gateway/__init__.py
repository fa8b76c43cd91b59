"""The gateway for black-box agents (``stream-rl gateway``): an OpenAI-compatible endpoint in front of the current
policy that records every call by episode and turns finished episodes into rollouts (docs/agents.md).

Modules: :mod:`~producers.gateway.config` (the ``gateway`` section), :mod:`~producers.gateway.calls` (the OpenAI
wire), :mod:`~producers.gateway.episodes` (prefix chains and rollout assembly, pure), :mod:`~producers.gateway.book`
(episode states, pure), :mod:`~producers.gateway.service` (sampling, recording, publishing),
:mod:`~producers.gateway.server` (HTTP) and :mod:`~producers.gateway.role` (the process).
"""
