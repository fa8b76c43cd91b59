"""Alert rules (declared once in ``table.py``, pure in ``rules.py``), their engine over sample windows, the monitor
that turns transitions into alerts-topic records and loop actions, and the reader of the alerts topic. Keep this file
import-free: ``stream_rl.config`` imports ``stream_rl.alerts.config``."""
