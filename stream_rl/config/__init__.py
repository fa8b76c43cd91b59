"""Configuration machinery and the core's sections, loaded from defaults, then a file, then the environment, then
CLI flags. The roles' own sections live in their packages (``producers/config.py``, ...).

- :mod:`~stream_rl.config.base`: :class:`Section` (every section's base), :class:`ConfigError`, error rendering.
- :mod:`~stream_rl.config.sections`: Kafka, topics, tracing and local-broker sections.
- :mod:`~stream_rl.config.data`: the ``[data]`` section (reading prompt files, rendering conversational prompts).
- :mod:`~stream_rl.config.shared`: :class:`SharedConfig`, the sections every role reads; :class:`Agreements` and
  :func:`checkpoint_root`, what two roles must agree on, declared once.
- :mod:`~stream_rl.config.loading`: defaults < file < environment < flags, for any root model.
- :mod:`~stream_rl.config.doc`: docs/configuration.md, generated from the models.

The root model with every role's section is the CLI's (:mod:`stream_rl.cli.config`): the core never imports a role.
Importing this package loads pydantic only (not the telemetry, alerts or weights sections: import
:mod:`~stream_rl.config.shared` for those).
"""

from stream_rl.config.base import ConfigError, CrossFieldError, Section
from stream_rl.config.sections import BrokerConfig, KafkaConfig, TopicsConfig, TracingConfig, read_secret

__all__ = ["BrokerConfig", "ConfigError", "CrossFieldError", "KafkaConfig", "Section", "TopicsConfig",
           "TracingConfig", "read_secret"]
