"""reasoning-gym as a prompt source (``reasoning-gym:NAME?size=N&seed=S``) and its own verifier as the
``reasoning_gym`` reward, against the real installed reasoning-gym (stream-rl[envs])."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym", reason="the envs extra is not installed: pip install -e '.[envs]'")

from stream_rl.prompts import PromptFileError, check_prompt_file  # noqa: E402
from stream_rl.rewards import names  # noqa: E402
from stream_rl.rewards.contract import RewardValueError, call_reward_fn  # noqa: E402

SPEC = "reasoning-gym:basic_arithmetic?size=6&seed=3&max_terms=3"


def _score(row, response, metadata=None):
    return call_reward_fn(names.resolve("reasoning_gym"), prompt=row.text, response=response, answer=row.answer,
                          metadata=row.metadata if metadata is None else metadata, response_length=1).reward


def test_a_reasoning_gym_dataset_is_a_prompt_source_with_the_metadata_its_verifier_needs():
    import reasoning_gym

    report = check_prompt_file(SPEC)
    assert report.valid and report.format == "reasoning-gym" and len(report.rows) == 6
    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=6, seed=3, max_terms=3)
    for index, row in enumerate(report.rows):
        assert row.text.startswith(dataset[index]["question"]) and row.answer == str(dataset[index]["answer"])
        assert row.prompt_id == f"rg-basic_arithmetic-3-{index}"
        assert row.metadata["data_source"] == "reasoning_gym/basic_arithmetic"
        assert (row.metadata["rg_index"], row.metadata["rg_config"]) == (str(index), '{"max_terms": 3}')
    assert [r.prompt_id for r in check_prompt_file(SPEC).rows] == [r.prompt_id for r in report.rows]


def test_the_reward_is_reasoning_gyms_own_score_answer():
    assert "reasoning_gym" in names.BUILTIN_NAMES and names.check_name("reasoning_gym") == "reasoning_gym"
    row = check_prompt_file(SPEC).rows[0]
    assert _score(row, f"thinking... <answer>{row.answer}</answer>") == 1.0
    assert _score(row, f"<answer>x</answer> then <answer>{row.answer}</answer>") == 1.0  # the last one counts
    assert _score(row, row.answer) == 1.0  # no tags: the stripped response
    assert _score(row, "<answer>12345678</answer>") < 1.0  # a number, wrong: its partial credit (0.25)
    assert _score(row, "x" * 1_000_000) < 1.0  # a huge response is just wrong


def test_a_rollout_that_names_no_reasoning_gym_entry_fails_with_the_reason():
    row = check_prompt_file(SPEC).rows[1]
    with pytest.raises(RewardValueError, match="not a reasoning-gym prompt: metadata has no rg_dataset"):
        _score(row, "1", metadata={})
    with pytest.raises(RewardValueError, match="is not the question that was asked"):
        _score(row, "1", metadata={**row.metadata, "rg_question": "0" * 16})
    with pytest.raises(RewardValueError, match="outside a dataset"):
        _score(row, "1", metadata={**row.metadata, "rg_index": "99"})
    with pytest.raises(RewardValueError, match="has no dataset 'nosuch'"):
        _score(row, "1", metadata={**row.metadata, "rg_dataset": "nosuch"})


@pytest.mark.parametrize(("spec", "reason"), [
    ("reasoning-gym:nosuch_dataset?size=3", "has no dataset 'nosuch_dataset'"),
    ("reasoning-gym:basic_arithmetic?size=0", "size must be between 1"),
    ("reasoning-gym:basic_arithmetic?size=x", "size and seed must be integers"),
    ("reasoning-gym:basic_arithmetic?size=3&no_such_key=1", "refuses its config"),
    ("reasoning-gym:", "no dataset name"),
])
def test_a_bad_spec_is_refused_naming_the_problem(spec, reason):
    with pytest.raises(PromptFileError, match=reason):
        check_prompt_file(spec)


def test_the_reward_runs_in_an_isolated_worker_under_its_deadline():
    """scorer.reward_isolation = "process": the hub's verifier resolves by its short name in a worker process."""
    from stream_rl.rewards.isolated import IsolatedReward

    row = check_prompt_file(SPEC).rows[2]
    isolated = IsolatedReward("reasoning_gym", timeout_s=60.0)
    try:
        assert isolated(row.text, f"<answer>{row.answer}</answer>", row.answer, row.metadata) == 1.0
        assert isolated(row.text, "<answer>nope</answer>", row.answer, row.metadata) == 0.0
    finally:
        isolated.close()
