"""The repository's root, wherever a test file sits in the tiers (tests/unit, tests/integration, tests/e2e)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = REPO_ROOT / "tests"
