"""verifiers tasksets as a prompt source (``verifiers:TASKSET?size=N``) and the task's own rewards as the
``verifiers`` reward, against the real installed verifiers (stream-rl[envs]) and the tasksets of
tests/support/vf_tasksets."""

from __future__ import annotations

import pytest

pytest.importorskip("verifiers.v1", reason="the envs extra is not installed: pip install -e '.[envs]'")

from stream_rl.prompts import PromptFileError, check_prompt_file  # noqa: E402
from stream_rl.rewards import names  # noqa: E402
from stream_rl.rewards.contract import RewardValueError, call_reward_fn  # noqa: E402
from support.paths import VF_TASKSETS  # noqa: E402

SPEC = "verifiers:vf_reverse?size=4"


@pytest.fixture(autouse=True)
def tasksets_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(VF_TASKSETS))


def _score(row, response, metadata=None):
    return call_reward_fn(names.resolve("verifiers"), prompt=row.text, response=response, answer=row.answer,
                          metadata=row.metadata if metadata is None else metadata, response_length=1).reward


def test_a_verifiers_taskset_is_a_prompt_source_naming_each_task():
    report = check_prompt_file(SPEC)
    assert report.valid and report.format == "verifiers" and len(report.rows) == 4
    assert [row.text for row in report.rows] == ["Reverse: abc", "Reverse: hello", "Reverse: stream", "Reverse: kafka"]
    assert [row.prompt_id for row in report.rows] == [f"vf-vf_reverse-{i}" for i in range(4)]
    assert report.rows[1].metadata["data_source"] == "verifiers/vf_reverse"
    assert len(report.rows[1].metadata["vf_key"]) == 64


def test_the_reward_is_the_tasks_own_weighted_rewards():
    assert names.check_name("verifiers") == "verifiers"
    row = check_prompt_file(SPEC).rows[1]  # hello
    assert _score(row, "olleh") == 1.5  # reversed (1 x 1.0) and short (0.5 x 1.0)
    assert _score(row, "hello") == 0.5
    assert _score(row, "o" * 100_000) == 0.0  # a huge response is only wrong


def test_a_rollout_the_taskset_cannot_score_fails_with_the_reason():
    row = check_prompt_file(SPEC).rows[0]
    with pytest.raises(RewardValueError, match="not a verifiers prompt: metadata has no vf_taskset"):
        _score(row, "cba", metadata={})
    with pytest.raises(RewardValueError, match="is not the task that was asked"):
        _score(row, "cba", metadata={**row.metadata, "vf_key": "0" * 64})
    with pytest.raises(RewardValueError, match="outside a taskset"):
        _score(row, "cba", metadata={**row.metadata, "vf_index": "4"})
    broken = check_prompt_file("verifiers:vf_broken?size=2").rows
    with pytest.raises(RewardValueError, match="RuntimeError: the grader crashed"):
        _score(broken[0], "x")
    with pytest.raises(RewardValueError, match="no reward scored it offline"):
        _score(broken[1], "x")


@pytest.mark.parametrize(("spec", "reason"), [
    ("verifiers:no_such_taskset_here", "cannot load taskset 'no_such_taskset_here'"),
    ("verifiers:vf_reverse?size=0", "size must be between 1"),
    ("verifiers:vf_reverse?seed=1", "unknown option seed"),
    ("verifiers:", "no taskset id"),
])
def test_a_bad_spec_is_refused_naming_the_problem(spec, reason):
    with pytest.raises(PromptFileError, match=reason):
        check_prompt_file(spec)


def test_the_reward_runs_in_an_isolated_worker(monkeypatch):
    """scorer.reward_isolation = "process": the task's rewards resolve by the short name in a worker process (which
    imports the taskset from PYTHONPATH)."""
    import os

    from stream_rl.rewards.isolated import IsolatedReward

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(VF_TASKSETS), os.environ.get("PYTHONPATH")])))
    row = check_prompt_file(SPEC).rows[1]
    isolated = IsolatedReward("verifiers", timeout_s=60.0)
    try:
        assert isolated(row.text, "olleh", row.answer, row.metadata) == 1.5
    finally:
        isolated.close()
