"""The evaluation step on a real tiny model (no Kafka): metrics recomputed independently from the engine's own
samples, determinism across calls, a change of weights changes them, bad sets are refused naming the field."""

from __future__ import annotations

import math

import pytest
from support.evaluation import even_length, write_prompts
from support.producers import build_tiny_model_dir, perturbed_state_dict

from producers.engines.hf import HFEngine
from evaluator.config import EvalConfig
from producers.engines.base import Sampling
from evaluator.step import GREEDY, batch_seed, evaluate_sets, load_sets, tokenize_sets
from stream_rl.evaluation.scoring import load_reward


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def _cfg(path, **over) -> EvalConfig:
    return EvalConfig(**{"sets": {"heldout": path}, "n": 4, "k": [1, 2], "max_new_tokens": 4, "batch_size": 4,
                         "reward_fn": "support.evaluation:even_length", **over})


def test_metrics_match_an_independent_recomputation_from_the_engine_samples(model_dir, tmp_path):
    engine = HFEngine.from_dir(model_dir)
    ecfg = _cfg(write_prompts(tmp_path / "p.jsonl", count=6))
    sets = load_sets(ecfg)
    ids = tokenize_sets(sets, engine, ecfg.max_new_tokens)
    got = evaluate_sets(engine, sets, ids, ecfg, load_reward(ecfg.scoring_routes()), None)
    rewards, greedy, lengths, stops = [], [], [], 0
    for b, start in enumerate(range(0, 6, 4)):  # batches of 4: [0..3], [4, 5]
        batch, seed = ids[0][start:start + 4], batch_seed(0, "heldout", b)
        for group in engine.generate(batch, 4, Sampling(temperature=1.0), 4, seed):
            texts = [engine.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in group]
            rewards.append([even_length("", t, None, {}) for t in texts])
            lengths += [len(s.token_ids) for s in group]
            stops += sum(s.finish_reason == "stop" for s in group)
        for (g,) in engine.generate(batch, 1, GREEDY, 4, seed):
            greedy.append(even_length("", engine.tokenizer.decode(g.token_ids, skip_special_tokens=True), None, {}))
    correct = [int(sum(r)) for r in rewards]
    want = {
        "heldout/prompts": 6.0,
        "heldout/mean@4": sum(c / 4 for c in correct) / 6,
        "heldout/pass@1": sum(c / 4 for c in correct) / 6,
        "heldout/pass@2": sum(1 - math.comb(4 - c, 2) / math.comb(4, 2) for c in correct) / 6,
        "heldout/greedy/accuracy": sum(greedy) / 6, "heldout/greedy/reward": sum(greedy) / 6,
        "heldout/length/mean": sum(lengths) / 24, "heldout/reward_errors": 0.0,
    }
    if stops:
        want["heldout/finish/stop"] = stops / 24
    if stops < 24:
        want["heldout/finish/length"] = (24 - stops) / 24
    assert got == pytest.approx(want)
    assert 0 < sum(correct) < 24  # the reward discriminates: the check above is not vacuous


def test_same_weights_same_metrics_other_weights_other_samples(model_dir, tmp_path):
    engine = HFEngine.from_dir(model_dir)
    ecfg = _cfg(write_prompts(tmp_path / "p.jsonl", count=8))
    sets = load_sets(ecfg)
    ids = tokenize_sets(sets, engine, ecfg.max_new_tokens)
    reward = load_reward(ecfg.scoring_routes())
    first = evaluate_sets(engine, sets, ids, ecfg, reward, None)
    assert evaluate_sets(engine, sets, ids, ecfg, reward, None) == first
    engine.load_weights(perturbed_state_dict(model_dir, scale=2.0, seed=5), 1)
    assert evaluate_sets(engine, sets, ids, ecfg, reward, None) != first


def test_metrics_per_data_source_and_maj_with_an_extractor(model_dir, tmp_path):
    from stream_rl.evaluation.scoring import load_extractor

    engine = HFEngine.from_dir(model_dir)
    ecfg = _cfg(write_prompts(tmp_path / "p.jsonl", count=6, sources=("a", "b")), extractor="last_number")
    sets = load_sets(ecfg)
    ids = tokenize_sets(sets, engine, 4)
    got = evaluate_sets(engine, sets, ids, ecfg, load_reward(ecfg.scoring_routes()), load_extractor("last_number"))
    assert got["heldout/a/prompts"] == 3.0 and got["heldout/b/prompts"] == 3.0
    assert got["heldout/pass@1"] == pytest.approx((got["heldout/a/pass@1"] + got["heldout/b/pass@1"]) / 2)
    # routed by data source in the scorer's shape: source b gets a broken function, the default keeps even_length
    rcfg = _cfg(ecfg.sets["heldout"], extractor="last_number", reward_fn=None,
                rewards={"routes": {"b": [{"fn": "support.evaluation:text_reward"}]},
                         "default": [{"fn": "support.evaluation:even_length"}]})
    routed = evaluate_sets(engine, sets, ids, rcfg, load_reward(rcfg.scoring_routes()), load_extractor("last_number"))
    assert routed["heldout/reward_errors"] == 3 * (4 + 1)
    assert routed["heldout/a/mean@4"] == got["heldout/a/mean@4"] and routed["heldout/b/mean@4"] == 0.0


def test_a_failing_reward_counts_as_zero_and_is_reported(model_dir, tmp_path):
    engine = HFEngine.from_dir(model_dir)
    ecfg = _cfg(write_prompts(tmp_path / "p.jsonl", count=2), reward_fn="support.evaluation:text_reward")
    sets = load_sets(ecfg)
    got = evaluate_sets(engine, sets, tokenize_sets(sets, engine, 4), ecfg, load_reward(ecfg.scoring_routes()), None)
    assert got["heldout/reward_errors"] == 2 * (4 + 1)  # a str, not a number: every response, greedy too
    assert got["heldout/mean@4"] == 0.0


def test_bad_config_and_sets_are_refused_naming_the_field(model_dir, tmp_path):
    from pydantic import ValidationError

    from stream_rl.prompts import PromptFileError

    path = write_prompts(tmp_path / "p.jsonl", count=2)
    with pytest.raises(ValidationError, match=r"eval\.k"):
        _cfg(path, k=[1, 5])
    with pytest.raises(ValueError, match=r"eval\.sets"):
        load_sets(EvalConfig(sets={}))
    with pytest.raises(ValidationError, match=r"eval\.reward_fn"):
        _cfg(path, reward_fn="no_colon")
    with pytest.raises(ValidationError, match=r"rewards\.routes\.b\.0\.fn"):
        _cfg(path, reward_fn=None, rewards={"routes": {"b": [{"fn": "not a function"}]}})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "1+1="}\n{"prompt_id": 3}\n')
    with pytest.raises(PromptFileError, match="bad.jsonl"):
        load_sets(_cfg(bad))
    engine = HFEngine.from_dir(model_dir)
    with pytest.raises(ValueError, match=r"eval\.sets\.heldout .*'e1'.*max_model_len"):
        tokenize_sets(load_sets(_cfg(path)), engine, 64)


def test_eval_routes_rewards_in_the_scorers_one_shape_and_refuses_the_old_one(tmp_path):
    """Issue 44 §1: one routing shape. The same table is ``scorer.rewards`` and ``eval.rewards`` and gives the same
    routes; the old ``eval.reward_routes`` is refused naming its replacement; routes and a single reward_fn are
    not both set; an unrouted response's reason names eval.rewards."""
    from pydantic import ValidationError

    from stream_rl.cli.config import load_config
    from stream_rl.evaluation.scoring import EvalRewardError

    table = {"by": "source", "routes": {"math": [{"fn": "math_boxed", "weight": 2.0}, {"fn": "gsm8k"}]}}
    cfg = load_config(None, env={}, overrides={"scorer.rewards": table, "eval.rewards": table})
    assert cfg.eval.scoring_routes() == cfg.scorer.rewards.to_routes()
    assert cfg.eval.reward_fn is None and cfg.eval.scoring_routes().where == "eval.rewards"
    path = write_prompts(tmp_path / "p.jsonl", count=2)
    with pytest.raises(ValidationError, match=r"eval\.reward_routes was replaced by eval\.rewards"):
        EvalConfig(sets={"heldout": path}, reward_routes={"math": "math_boxed"})
    with pytest.raises(ValidationError, match=r"set eval\.rewards or eval\.reward_fn, not both"):
        _cfg(path, rewards=table)
    with pytest.raises(ValidationError, match=r"eval needs a reward: set eval\.reward_fn or eval\.rewards"):
        _cfg(path, reward_fn=None)
    reward = load_reward(_cfg(path, reward_fn=None, rewards=table).scoring_routes())
    with pytest.raises(EvalRewardError, match=r"no reward route for source='poetry' \(eval\.rewards\.by = 'source'"):
        reward("1+1=", "2", "2", {"source": "poetry"}, 1)
