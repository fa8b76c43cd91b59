"""The configuration reference is generated from the models and committed; shipped configs load."""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from support.paths import REPO_ROOT

from stream_rl.cli.config import StreamRLConfig, load_config
from stream_rl.config.doc import config_reference

ROOT = REPO_ROOT


def _fields(model: type[BaseModel], path: str = ""):
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _fields(ann, f"{path}{name}.")
        else:
            yield f"{path}{name}", field


def test_every_field_is_described():
    missing = [name for name, field in _fields(StreamRLConfig) if not (field.description or "").strip()]
    assert missing == []


def test_committed_reference_is_current():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_reference(StreamRLConfig), (
        "docs/configuration.md is stale: run `python -m stream_rl.cli.config > docs/configuration.md`")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")) + sorted((ROOT / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path, env={})
    assert isinstance(cfg, StreamRLConfig)
