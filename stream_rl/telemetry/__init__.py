"""Metrics (OpenTelemetry), health endpoints and heartbeats of a role process. Keep this file import-free:
``stream_rl.config`` imports ``stream_rl.telemetry.config``."""
