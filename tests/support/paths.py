"""The repository's root, wherever a test file sits in the tiers (tests/unit, tests/integration, tests/e2e)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = REPO_ROOT / "tests"
VF_TASKSETS = TESTS_DIR / "support" / "vf_tasksets"
"""Packages that verifiers loads as tasksets by id (``vf_reverse``, ``vf_broken``) once this folder is on the path."""
