"""A GET that returns ``(status, body)`` for error statuses too (the telemetry endpoints' tests)."""

from __future__ import annotations

import urllib.error
import urllib.request


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
