"""The core of stream-rl: what every role uses and no role owns, one folder per concern, and the CLI.

Core folders: ``transport`` (the Kafka edge), ``weights`` (versioned weight broadcast), ``telemetry`` and ``alerts``,
``algorithms`` (pure RL math), ``rewards``, ``evaluation`` (held-out metrics, ledger, keep-best), ``prompts``,
``hubs``, ``models``, ``storage``, ``config``, ``runtime``, ``broker``, ``launch`` (``stream-rl run``),
``operator_tools``, ``planner``, ``demo``. ``cli`` is the command-line layer above the roles (``producers``,
``consumers``, ``evaluator``), the only part of this package that imports them (docs/architecture.md, Layers).
"""
