"""Alert rules, their engine and actions. Keep this file import-free: ``stream_rl.config`` imports
``stream_rl.alerts.config``."""
