"""Telemetry of a role process: metrics (OpenTelemetry), health endpoints, heartbeats, consumer lag, the alert
policy, and the experiment trackers (``trackers/``: wandb, MLflow, TensorBoard), composed for the role loop by
:class:`~stream_rl.telemetry.role.RoleTelemetry`. Keep this file import-free: ``stream_rl.config`` imports
``stream_rl.telemetry.config``."""
