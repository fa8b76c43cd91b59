"""The alert engine: keeps bounded sample windows per observation key and turns rule verdicts into transitions.

Consumes: ``observe(now, values)`` calls from one role process: ``now`` in seconds (Unix time or any clock that
only moves forward, the same one every call), ``values`` a mapping of observation keys to numbers
(``loss/total``, ``optim/grad_norm``, ``kl/ref_mean``, ``reward/mean``, ``mismatch/logp_abs_diff``, ``step``,
``lag/position_total``, ``process/rss_bytes``, ``gpu/allocated_bytes``, ``dlq/total``; unknown keys are ignored).
A key that is absent means "no data": its window keeps what it had. Per-step keys (loss, grad norm, KL, reward,
mismatch) belong in the one observation made after the step that produced them (each presence is one sample);
gauges and counters (step, memory, dlq) may be given at every observation, the lag once per new measurement.
Produces: a list of :class:`schemas.Alert` transitions: ``firing`` when a rule starts holding, ``resolved`` when
it stops; nothing while a state is unchanged or while a rule has no data. ``firing`` (names) and ``action``
(strongest action among firing alerts: ``none`` < ``log`` < ``pause`` < ``stop``) describe the current state.
Guarantees: memory is bounded (each key keeps only what its rules need); one transition per change; a rule
without data never fires and keeps its previous state; messages hold numbers and key names, never sample text.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping

from schemas import Alert
from stream_rl.alerts.config import AlertsConfig
from stream_rl.alerts.rules import Rule, Sample, Verdict, build_rules

ACTION_ORDER = ("none", "log", "pause", "stop")
"""Actions from weakest to strongest; ``log`` changes nothing in a loop's behaviour."""


def strongest(actions) -> str:
    """The strongest of ``actions`` by :data:`ACTION_ORDER` (``none`` for none)."""
    return max(actions, key=ACTION_ORDER.index, default="none")


class _Window:
    """Samples of one key, oldest first, trimmed to what the rules reading it need."""

    def __init__(self, horizon_s: float, keep: int) -> None:
        self.horizon_s, self.keep = horizon_s, max(1, keep)
        self.samples: deque[Sample] = deque()

    def add(self, now: float, value: float) -> None:
        self.samples.append((now, value))
        # drop the oldest while the next one is still at or before the horizon (the newest older sample stays as
        # the anchor of "held for T" rules) and more than `keep` samples remain
        while (len(self.samples) > self.keep and len(self.samples) >= 2
               and self.samples[1][0] <= now - self.horizon_s):
            self.samples.popleft()


class AlertEngine:
    """Evaluates the enabled rules of one role process and reports transitions."""

    def __init__(self, cfg: AlertsConfig, role: str, instance_id: str) -> None:
        self.cfg, self.role, self.instance_id = cfg, role, instance_id
        self.rules: list[Rule] = build_rules(cfg, role)
        self._windows: dict[str, _Window] = {}
        for rule in self.rules:
            for key in rule.keys:
                old = self._windows.get(key)
                horizon = max(rule.horizon_s, old.horizon_s if old else 0.0)
                keep = max(rule.keep, old.keep if old else 1)
                self._windows[key] = _Window(horizon, keep)
        self._firing: dict[str, Alert] = {}

    @property
    def firing(self) -> list[str]:
        """Names of the alerts firing now, in rule order."""
        return [r.name for r in self.rules if r.name in self._firing]

    @property
    def firing_alerts(self) -> list[Alert]:
        """The ``firing`` transitions of the alerts firing now."""
        return [self._firing[name] for name in self.firing]

    @property
    def action(self) -> str:
        """The strongest action among firing alerts: ``none`` | ``log`` | ``pause`` | ``stop``."""
        return strongest(a.action for a in self._firing.values())

    def observe(self, now: float, values: Mapping[str, float]) -> list[Alert]:
        """Add the present values as samples at ``now``, evaluate every rule, return the transitions."""
        for key, value in values.items():
            window = self._windows.get(key)
            if window is not None and value is not None:
                window.add(now, float(value))
        series = {key: list(w.samples) for key, w in self._windows.items()}
        out: list[Alert] = []
        for rule in self.rules:
            verdict = rule.evaluate(series, now)
            if verdict is None:
                continue
            was = rule.name in self._firing
            if verdict.holds and not was:
                self._firing[rule.name] = alert = self._alert(rule, verdict, "firing")
                out.append(alert)
            elif was and not verdict.holds:
                del self._firing[rule.name]
                out.append(self._alert(rule, verdict, "resolved"))
        return out

    def _alert(self, rule: Rule, verdict: Verdict, state: str) -> Alert:
        value = verdict.value if verdict.value is not None and math.isfinite(verdict.value) else None
        return Alert(name=rule.name, state=state, action=rule.action, role=self.role,
                     instance_id=self.instance_id, message=verdict.message, value=value,
                     threshold=verdict.threshold, created_at=time.time())
