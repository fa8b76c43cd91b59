"""Each role takes the shared sections plus its own section; what two roles must agree on is declared once
(:class:`stream_rl.config.shared.Agreements`, :func:`stream_rl.config.shared.checkpoint_root`) and handed over by
the CLI, the one layer that holds the whole root config."""

from __future__ import annotations

import typing

import pytest

from consumers.scorer.config import ScorerConfig
from consumers.trainer.config import TrainerConfig
from producers.config import ProducerConfig
from evaluator.config import EvalConfig
from stream_rl.cli.config import agreements, load_config
from stream_rl.config.shared import Agreements, SharedConfig, checkpoint_root


def test_checkpoint_root_defaults_under_the_run_dir_and_follows_the_setting(tmp_path):
    assert checkpoint_root(tmp_path / "run", None) == tmp_path / "run" / "checkpoints"
    assert checkpoint_root(str(tmp_path / "run"), str(tmp_path / "ck")) == tmp_path / "ck"


def test_agreements_follow_the_sections_they_come_from():
    assert agreements(load_config(None, env={})) == Agreements()  # the defaults are the sections' defaults
    assert Agreements().weights_dtype == ProducerConfig().dtype
    cfg = load_config(None, env={}, overrides={"producer.dtype": "bfloat16", "eval.every_versions": 3,
                                               "eval.before_train": False})
    assert agreements(cfg) == Agreements(weights_dtype="bfloat16", eval_every_versions=3, eval_before_train=False)
    with_eval = load_config(None, env={}, overrides={"eval.sets": {}})  # an [eval] section at its defaults
    assert agreements(with_eval).eval_every_versions == EvalConfig().every_versions == 20


def _entry_points():
    from consumers.scorer.scorer import run_scorer
    from consumers.trainer.trainer import Trainer, run_trainer
    from evaluator.role import evaluate_once, run_evaluator
    from producers.role import run_producer

    return [(run_producer, [SharedConfig, ProducerConfig]), (run_scorer, [SharedConfig, ScorerConfig]),
            (run_trainer, [SharedConfig, TrainerConfig]), (Trainer.__init__, [SharedConfig, TrainerConfig]),
            (run_evaluator, [SharedConfig, EvalConfig | None, ProducerConfig]),
            (evaluate_once, [SharedConfig, EvalConfig | None, ProducerConfig])]


@pytest.mark.parametrize("index", range(6))
def test_role_entry_points_take_the_shared_sections_and_their_own(index):
    """The first parameters are typed: the shared config, then the role's own section (the evaluator's engine
    settings are the producers' section, handed over by the CLI)."""
    fn, want = _entry_points()[index]
    hints = typing.get_type_hints(fn)
    names = [n for n in fn.__code__.co_varnames[:fn.__code__.co_argcount] if n != "self"][:len(want)]
    assert [hints[n] for n in names] == want, (fn.__qualname__, names)


def test_keep_best_follows_the_evaluators_cadence_from_the_agreements(tmp_path, make_config):
    from consumers.trainer.keep_best import KeepBest
    from consumers.trainer.ranks import SOLO
    from stream_rl.transport.client import Transport

    transport = Transport(make_config(), "test")
    tcfg = TrainerConfig(keep_best="eval/heldout/greedy/accuracy")
    hook = KeepBest.open(tcfg, Agreements(eval_every_versions=3, eval_before_train=False), transport,
                         tmp_path / "ck", None, SOLO)
    keeper = hook.keeper
    assert (keeper.every, keeper.before_train, keeper.root) == (3, False, tmp_path / "ck")
    assert keeper.feed.topic == transport.names.name("evals")  # the evals topic, not RUN_DIR/evals.jsonl
    hook.close()
    assert KeepBest.open(TrainerConfig(), Agreements(), transport, tmp_path / "ck", None, SOLO).keeper is None


def test_gc_and_doctor_take_the_checkpoint_dir_from_the_cli(tmp_path):
    from stream_rl.cli.diagnose_cmd import role_facts
    from stream_rl.operator_tools.doctor import RoleFacts, model_dirs
    from stream_rl.operator_tools.gc import paths_from_config

    cfg = load_config(None, env={}, overrides={"run_dir": str(tmp_path / "run"), "run.demo_dir": "none"})
    assert paths_from_config(cfg, None).checkpoint_dir == tmp_path / "run" / "checkpoints"
    assert paths_from_config(cfg, tmp_path / "ck").checkpoint_dir == tmp_path / "ck"
    moved = load_config(None, env={}, overrides={"trainer.checkpoint_dir": str(tmp_path / "ck"),
                                                 "producer.model_dir": str(tmp_path / "m"),
                                                 "trainer.model_dir": str(tmp_path / "m"),
                                                 "trainer.engine": "deepspeed", "run.start_broker": False})
    facts = role_facts(moved)
    assert (facts.checkpoint_dir, facts.trainer_engine, facts.start_broker) == (tmp_path / "ck", "deepspeed",
                                                                                False)
    assert model_dirs(facts, [tmp_path / "x"]) == {tmp_path / "m": ["producer.model_dir", "trainer.model_dir"],
                                                   tmp_path / "x": ["--model-dir"]}
    assert role_facts(load_config(None, env={}, overrides={"run.demo_dir": "none"})) == RoleFacts(
        model_dirs=(("producer.model_dir", ProducerConfig().model_dir), ("trainer.model_dir", None),
                    ("scorer.reference_model_dir", None), ("scorer.reward_model_dir", None)))
