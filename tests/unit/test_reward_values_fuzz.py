"""Any value a reward can return is a number or that rollout's failure with a reason (stream_rl.rewards.contract,
.calls, .http, .server): ``10**400`` from a function, from a batch function, from a served function and as a
reward server's JSON integer fails that rollout alone; and hypothesis-generated values (huge integers, fractions,
NaN, numpy scalars, strings, nested lists and dicts, objects whose methods raise) never make the contract's check,
the server's encoder or the client's decoder raise anything but their own error."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.hostile_http import Scripted, reply, serving

from stream_rl.rewards.calls import CallPolicy, RewardCaller, RewardRequest, batched
from stream_rl.rewards.contract import RewardOutput, RewardValueError, check_reward_value
from stream_rl.rewards.http import HttpRewardClient, HttpRewardError, decode_answer
from stream_rl.rewards.openrlhf import openrlhf_answer
from stream_rl.rewards.server import RewardServer, encode_answer, per_rollout_scorer

POLICY = CallPolicy(timeout_s=5.0, concurrency=2, max_retries=0)
HUGE = 10**400


def requests(n: int) -> list[RewardRequest]:
    return [RewardRequest(f"p{i}", str(i), None, {}, response_length=2) for i in range(n)]


def test_a_huge_reward_from_a_function_fails_that_rollout_alone():
    def reward(prompt, response, answer, metadata):
        return {"0": HUGE, "1": 0.5, "2": {"reward": 1.0, "token_rewards": [HUGE, 0.0]}}[response]

    with RewardCaller(reward, POLICY) as caller:
        huge, fine, huge_tokens = caller.call(requests(3))
    assert fine.output.reward == 0.5
    assert huge.reason == f"{reward.__qualname__} returned a number too large for a float (int)"
    assert huge_tokens.reason.endswith("returned token_rewards that are not numbers: int too large to convert to "
                                       "float")
    assert huge.error_type == huge_tokens.error_type == "RewardValueError"


def test_a_huge_reward_from_a_batch_function_fails_that_rollout_alone():
    @batched
    def rewards(prompts, responses, answers, metadatas):
        return [HUGE, Fraction(HUGE, 3), 2]

    with RewardCaller(rewards, POLICY) as caller:
        outcomes = caller.call(requests(3))
    assert [o.ok for o in outcomes] == [False, False, True] and outcomes[2].output.reward == 2.0
    assert outcomes[1].reason.endswith("returned a number too large for a float (Fraction)")


def test_a_reward_servers_400_digit_json_integer_fails_that_rollout_alone():
    server = Scripted(lambda h, n: reply(h, 200, b'{"rewards": [1' + b"0" * 400 + b", 0.25]}"))
    with serving(server) as url, RewardCaller(HttpRewardClient(url, timeout_s=5.0), POLICY) as caller:
        huge, fine = caller.call(requests(2))
    assert fine.output.reward == 0.25
    assert huge.reason == f"reward server {url} returned a number too large for a float (int)"


def test_a_served_function_returning_a_huge_value_is_a_null_with_its_reason_not_a_500():
    def reward(prompt, response, answer, metadata):
        return {"0": HUGE, "1": {"reward": HUGE}, "2": 0.5, "3": {"reward": 1.0, "token_rewards": [1.0, HUGE]}}[
            response]

    served = RewardServer(per_rollout_scorer(reward, "huge"), name="huge")
    with serving(served) as url, RewardCaller(HttpRewardClient(url, timeout_s=5.0), POLICY) as caller:
        outcomes = caller.call(requests(4))
    assert [o.ok for o in outcomes] == [False, False, True, False] and outcomes[2].output.reward == 0.5
    assert outcomes[0].reason == f"reward server {url}: huge returned a number too large for a float (int)"
    assert outcomes[1].reason == f"reward server {url}: huge returned a number too large for a float (int)"
    assert outcomes[3].reason == (f"reward server {url}: huge returned token_rewards that are not numbers: int too "
                                  "large to convert to float")


# -- fuzz ----------------------------------------------------------------------------------------------------------

class Hostile(float):
    """A float whose conversion raises, as a plug-in's number type may."""

    def __float__(self) -> float:
        raise RuntimeError("no float for you")


class HostileMapping(Mapping):
    """A mapping whose iteration raises."""

    def __getitem__(self, key):
        raise KeyError(key)

    def __iter__(self):
        raise RuntimeError("cannot iterate")

    def __len__(self) -> int:
        return 1


class HostileReal:
    """A registered ``numbers.Real`` whose ``__float__`` returns nonsense."""

    def __float__(self):
        return "not a float"


numbers.Real.register(HostileReal)

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=10**300, max_value=10**500).map(lambda i: i),
    st.integers(min_value=10**300, max_value=10**500).map(lambda i: -i), st.floats(), st.fractions(),
    st.decimals(), st.complex_numbers(), st.text(max_size=8), st.binary(max_size=8),
    st.sampled_from([np.float32(np.inf), np.float64(1e308), np.int64(-5), np.bool_(True), np.float16(65504),
                     np.longdouble(1e308) * 10, np.float64(np.nan), np.uint8(7), np.array(1.0), np.array([1.0])]),
    st.floats(width=32).map(np.float32), st.just(Hostile(1.0)), st.just(HostileMapping()), st.just(HostileReal()),
)
KEYS = st.one_of(st.sampled_from(["reward", "token_rewards", "rewards"]), st.text(max_size=4), st.integers())
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                                                       st.dictionaries(KEYS, inner, max_size=3)), max_leaves=12)
REWARD_DICTS = st.fixed_dictionaries({"reward": VALUES}, optional={"token_rewards": VALUES})
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid(output: RewardOutput, response_length: int) -> None:
    assert isinstance(output.reward, float) and math.isfinite(output.reward)
    if output.token_rewards is not None:
        assert output.token_rewards.dtype == np.float32 and output.token_rewards.shape == (response_length,)
        assert np.isfinite(output.token_rewards).all()


@FUZZ
@given(value=st.one_of(VALUES, REWARD_DICTS), response_length=st.integers(0, 4))
def test_the_contracts_check_returns_a_finite_reward_or_its_own_error(value, response_length):
    try:
        output = check_reward_value(value, response_length, "fuzzed")
    except RewardValueError as exc:
        assert str(exc).startswith("fuzzed ")
        return
    _valid(output, response_length)


@FUZZ
@given(values=st.lists(st.one_of(VALUES, REWARD_DICTS), min_size=1, max_size=4))
def test_the_servers_answers_are_strict_json_with_a_reason_for_every_null(values):
    ours = encode_answer(values, "fuzzed")
    openrlhf = openrlhf_answer(ours, -1.0)
    json.dumps([ours, openrlhf], allow_nan=False)  # no NaN or Infinity: any JSON parser reads them
    errors = ours.get("errors", [None] * len(values))
    for reward, error in zip(ours["rewards"], errors):
        assert (reward is None) == (error is not None)
        assert reward is None or (isinstance(reward, float) and math.isfinite(reward))
    assert openrlhf.get("errors", [None] * len(values)) == errors
    assert openrlhf["extra_logs"]["reward_failed"] == [float(e is not None) for e in errors]
    assert openrlhf["rewards"] == [-1.0 if r is None else r for r in ours["rewards"]]  # never a null


JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(min_value=-10**500, max_value=10**500),
                              st.floats(), st.text(max_size=6)),
                    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=3)),
                    max_leaves=10)
ANSWERS = st.one_of(JSON, st.fixed_dictionaries({"rewards": st.lists(JSON, min_size=2, max_size=2)},
                                                optional={"token_rewards": JSON, "errors": JSON}))


@FUZZ
@given(answer=ANSWERS)
def test_any_json_answer_decodes_to_rewards_or_reasons(answer):
    raw = json.dumps(answer).encode()
    try:
        values = decode_answer(raw, "application/json", 2, "http://rm/")
    except HttpRewardError as exc:
        assert not exc.retriable and str(exc).startswith("reward server http://rm/ ")
        return
    for value in values:
        if isinstance(value, HttpRewardError):
            continue
        try:
            _valid(check_reward_value(value, 2, "reward server"), 2)
        except RewardValueError:
            pass


@pytest.fixture(scope="module")
def fuzzed_caller():
    current: list = []

    @batched
    def reward(prompts, responses, answers, metadatas):
        return list(current)

    with RewardCaller(reward, POLICY) as caller:
        yield caller, current


@FUZZ
@given(values=st.lists(st.one_of(VALUES, REWARD_DICTS), min_size=1, max_size=4))
def test_a_batch_of_fuzzed_values_always_gives_one_outcome_per_rollout(fuzzed_caller, values):
    caller, current = fuzzed_caller
    current[:] = values
    outcomes = caller.call(requests(len(values)))
    assert len(outcomes) == len(values)
    for outcome in outcomes:
        if outcome.ok:
            _valid(outcome.output, 2)
        else:
            assert outcome.reason
