"""The algorithm catalogue is the one declaration of every choice: it loads without torch, each loss kind has exactly
one registered surrogate, the trainer's config offers exactly the catalogue's choices with the catalogue's defaults,
the loss spec is built from the config, and an unknown kind fails naming the known kinds."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest

from consumers.trainer.config import KLConfig, LossConfig, TrainerConfig
from stream_rl.algorithms import LossSpec, catalogue as cat
from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError


def load(**overrides):
    return load_config(None, env={}, overrides={k.replace("__", "."): v for k, v in overrides.items()})


def choices(model, field: str) -> tuple[str, ...]:
    """The strings of a config field's Literal (unwrapping ``Literal[...] | None``)."""
    annotation = model.model_fields[field].annotation
    literal = next((a for a in get_args(annotation) if get_args(a)), annotation)
    return get_args(literal)


def test_the_catalogue_and_the_trainer_config_load_without_torch():
    code = ("import sys; import consumers.trainer.config, stream_rl.algorithms.catalogue, stream_rl.algorithms.spec; "
            "from stream_rl.algorithms import LossSpec, AGG_MODES; LossSpec(kind='cispo'); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_every_row_is_complete():
    for rows in (cat.LOSS_KIND_ROWS, cat.ADVANTAGE_ROWS, cat.KL_ROWS, cat.AGG_ROWS, cat.IS_MODE_ROWS):
        names = [row.name for row in rows]
        assert len(set(names)) == len(names)
        for row in rows:
            assert row.level in cat.LEVELS and row.summary and row.citation, row
    for row in cat.LOSS_KIND_ROWS:
        assert row.agg in cat.AGG_MODES and set(row.options) <= set(cat.LOSS_OPTIONS), row
        LossSpec(kind=row.name)  # its defaults pass the spec's checks


def test_each_loss_kind_has_exactly_one_registered_surrogate_and_the_trainer_one_estimator_per_advantage():
    from consumers.trainer.targets import ADVANTAGE_ESTIMATORS
    from stream_rl.algorithms import SURROGATES

    assert tuple(SURROGATES) == cat.LOSS_KIND_NAMES == ("ppo", "gspo", "cispo")
    assert tuple(ADVANTAGE_ESTIMATORS) == cat.ADVANTAGE_NAMES


def test_the_trainer_config_offers_exactly_the_catalogue_choices():
    assert choices(LossConfig, "kind") == cat.LOSS_KIND_NAMES
    assert choices(LossConfig, "agg") == cat.AGG_MODES == ("token-mean", "seq-mean-token-mean",
                                                           "seq-mean-token-sum-norm")
    assert choices(LossConfig, "is_mode") == cat.IS_MODES == ("clamp", "mask")
    assert choices(KLConfig, "kind") == cat.KL_KINDS == ("k1", "k2", "k3")
    assert choices(TrainerConfig, "advantage") == cat.ADVANTAGE_NAMES == ("grpo", "dr_grpo", "rloo", "reinforce_pp",
                                                                         "gae")
    for row in cat.LOSS_KIND_ROWS:  # the per-kind defaults are the rows'
        loss = LossConfig(kind=row.name)
        assert (loss.clip_low, loss.clip_high, loss.agg) == (row.clip_low, row.clip_high, row.agg)
        assert row.summary in LossConfig.model_fields["kind"].description
    for row in cat.ADVANTAGE_ROWS:
        assert TrainerConfig(advantage=row.name).whiten_advantages is row.whiten


def test_cispo_is_selectable_in_the_config_and_its_spec_is_built_from_it():
    loss = load(trainer__loss__kind="cispo").trainer.loss
    assert (loss.kind, loss.clip_low, loss.clip_high, loss.agg) == ("cispo", 1.0, 0.2, "token-mean")
    assert LossSpec.from_config(loss) == LossSpec(kind="cispo", is_cap=5.0, max_len=loss.max_len)  # the budget
    tuned = load(trainer__loss__kind="cispo", trainer__loss__clip_high="3.0").trainer.loss  # ScaleRL-style cap 4
    assert LossSpec.from_config(tuned).clip_high == 3.0
    with pytest.raises(ConfigError, match=r"dual_clip=3\.0 does not apply to kind='cispo'"):
        load(trainer__loss__kind="cispo", trainer__loss__dual_clip="3.0")
    with pytest.raises(ConfigError, match="trainer.loss.kind"):
        load(trainer__loss__kind="trpo")


def test_the_spec_takes_no_is_cap_without_off_policy_correction():
    loss = load(trainer__loss__off_policy_correction="false").trainer.loss
    assert loss.is_cap == 5.0 and LossSpec.from_config(loss).is_cap is None
    spec = LossSpec.from_config(load(trainer__loss__kind="gspo", trainer__loss__dual_clip="3").trainer.loss)
    assert (spec.kind, spec.level, spec.clip_low, spec.clip_high, spec.dual_clip) == ("gspo", "sequence", 3e-4, 4e-4,
                                                                                      3.0)


def test_an_unknown_kind_names_itself_and_the_known_kinds():
    from stream_rl.algorithms import surrogate_for

    for fail in (lambda: LossSpec(kind="trpo"), lambda: surrogate_for("trpo"), lambda: cat.loss_kind("trpo")):
        with pytest.raises(ValueError, match=r"unknown loss kind 'trpo'; known kinds: ppo, gspo, cispo"):
            fail()


def test_a_surrogate_needs_a_catalogue_row_and_registers_once():
    from stream_rl.algorithms import SURROGATES, register_surrogate

    before = dict(SURROGATES)
    with pytest.raises(ValueError, match="unknown loss kind 'sapo'"):
        register_surrogate("sapo")
    with pytest.raises(ValueError, match="loss kind 'ppo' is registered twice"):
        register_surrogate("ppo")(lambda x, spec: None)
    assert SURROGATES == before
