"""Multi-turn rollouts: the episode driver on a real tiny model, the wire fields, the trainer's loss mask, the demo's
retry task, and the configuration and loading errors."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from support.multiturn import Scripted, episode_prompt
from support.producers import build_tiny_model_dir, recompute_logprobs
from support.trainer import trainer_cfg

from consumers.trainer.admit import ModelLimits, check_scored
from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.targets import advantage_inputs
from consumers.trainer.tensors import build_batch
from consumers.trainer.train_step import TrainState, train_step
from producers.engines.base import Sampling
from producers.engines.hf import HFEngine
from producers.environment import EnvironmentLoadError, Observation, load_environment
from producers.step import Turns, produce_rollouts
from producers.multiturn import run_episodes, turn_seed
from schemas import Prompt, ScoredRollout, decode, encode
from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError
from stream_rl.demo.retry import RetryAddition, retry_reward

torch.set_num_threads(1)
TEMPERATURE = 0.8




@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny random policy, with its stop token made as likely as its most sampled token (a random model
    rarely stops, and a turn has to end for the next one to begin)."""
    engine = HFEngine.from_dir(build_tiny_model_dir(tmp_path_factory.mktemp("mt") / "policy"))
    groups = engine.generate([_ids(engine)], n=8, sampling=Sampling(TEMPERATURE), max_new_tokens=8, seed=0)
    counts = np.bincount([t for s in groups[0] for t in s.token_ids], minlength=len(engine.tokenizer))
    with torch.no_grad():
        head = engine.model.lm_head.weight  # [V, H]
        head[engine.eos_token_id] = head[int(counts.argmax())]
    return engine




def _ids(engine, text="12+34="):
    return list(engine.tokenizer(text)["input_ids"])


def _play(engine, replies, *, n=2, max_new_tokens=20, max_turns=3, seed=5):
    envs = []

    def make():
        envs.append(Scripted(replies))
        return envs[-1]

    out = run_episodes(engine, [episode_prompt()], [_ids(engine)], n, sampling=Sampling(TEMPERATURE),
                       max_new_tokens=max_new_tokens, seed=seed, make_env=make, max_turns=max_turns)
    return out[0], envs


def _runs(mask):
    """The (value, length) runs of a 0/1 list."""
    runs = []
    for v in mask:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return [tuple(r) for r in runs]


# -- the driver -----------------------------------------------------------------------------------------------------

def test_an_episode_interleaves_policy_turns_and_environment_replies(engine):
    episodes, envs = _play(engine, ["5=", "6="])
    assert len(episodes) == 2 and len(envs) == 2  # one environment per rollout
    for ep, env in zip(episodes, envs):
        reply = _ids(engine, "5=")[1:]  # without <bos>: replies are tokenised without special tokens
        runs = _runs(ep.policy_mask)
        assert [v for v, _ in runs] == [1, 0, 1, 0, 1][:len(runs)] and runs[-1][0] == 1
        assert [t["role"] for t in ep.turns] == ["policy" if v else "env" for v, _ in runs]
        start = runs[0][1]
        if len(runs) > 1:
            assert ep.token_ids[start:start + len(reply)] == reply and runs[1][1] == len(reply)
            assert ep.texts[1] == "5=" and env.seen[0] == ep.texts[0]
        masked = [lp for lp, m in zip(ep.logprobs, ep.policy_mask) if not m]
        assert masked == [0.0] * len(masked) and all(lp <= 0 for lp in ep.logprobs)
        assert len(ep.token_ids) == len(ep.logprobs) == len(ep.policy_mask) == len(ep.token_versions) <= 20
        assert ep.response_text == "\n".join(ep.texts) and env.prompt.answer == "46"


def test_later_turns_logprobs_are_the_policys_given_the_whole_context(engine):
    episodes, _ = _play(engine, ["5=", "6="])
    prompt = _ids(engine)
    for ep in episodes:
        starts = [i for i, (a, b) in enumerate(zip([0] + ep.policy_mask, ep.policy_mask)) if b and not a]
        assert len(starts) >= 2, "the tiny model stopped after one turn: the test proves nothing"
        # every policy token's logprob is that of one forward over prompt + everything before it
        recomputed, sampled = recompute_logprobs(engine.model, [prompt], [[ep]], TEMPERATURE,
                                                 engine.tokenizer.pad_token_id)
        policy = np.asarray(ep.policy_mask, dtype=bool)
        np.testing.assert_allclose(recomputed[policy], sampled[policy], atol=2e-5)


def test_episodes_are_deterministic_and_each_turn_has_its_own_seed(engine):
    a, _ = _play(engine, ["5=", "6="], seed=9)
    b, _ = _play(engine, ["5=", "6="], seed=9)
    assert [e.token_ids for e in a] == [e.token_ids for e in b]
    assert turn_seed(9, 0) == 9 and len({turn_seed(9, t) for t in range(4)}) == 4


def test_the_episode_ends_at_done_at_max_turns_and_at_the_budget(engine):
    done, _ = _play(engine, [None])
    assert all(ep.policy_mask == [1] * len(ep.token_ids) and len(ep.turns) == 1 for ep in done)
    two, _ = _play(engine, ["5=", "6=", "7="], max_turns=2)
    assert all(sum(1 for t in ep.turns if t["role"] == "policy") <= 2 for ep in two)
    # a reply that leaves no room for a policy token ends the episode with "length" and is not appended
    long_reply = "1" * 30
    cut, _ = _play(engine, [long_reply], max_new_tokens=12)
    assert all(ep.finish_reason == "length" and set(ep.policy_mask) == {1} for ep in cut)
    assert all(len(ep.token_ids) <= 12 for ep in cut)


def test_a_failing_environment_rejects_its_prompt_only(engine):
    class Broken(Scripted):
        def step(self, policy_text):
            raise RuntimeError("no calculator today")

    prompts = [episode_prompt(), dataclasses.replace(episode_prompt("23+45=", "68"), prompt_id="add-23-45")]
    calls = iter([Broken([]), Broken([]), Scripted(["5="]), Scripted(["5="])])
    result = produce_rollouts(prompts, engine, producer_id="p-0", sampling=Sampling(TEMPERATURE), max_new_tokens=16,
                              seed=1, turns=Turns(lambda: next(calls), max_turns=2))
    assert [(r.index, r.reason) for r in result.rejected] == [
        (0, "environment failed: RuntimeError: no calculator today")]
    assert {r.prompt_id for r in result.rollouts} == {"add-23-45"} and len(result.rollouts) == 2
    for rollout in result.rollouts:  # valid on the wire, with the multi-turn fields
        assert decode(encode(rollout), "rollout") == rollout
        assert rollout.policy_mask.dtype == np.uint8 and len(rollout.turns) == len(_runs(rollout.policy_mask))


def test_an_environment_answer_is_an_observation_a_string_or_none(engine):
    episodes, _ = _play(engine, [Observation("5=", tags={"hint": "last digit"}), ""])
    env_turns = [t for ep in episodes for t in ep.turns if t["role"] == "env"]
    assert env_turns and all(t == {"hint": "last digit", "role": "env"} for t in env_turns)
    assert all(len(ep.turns) <= 3 for ep in episodes)  # "" after the second policy turn ends it


# -- the trainer --------------------------------------------------------------------------------------------------

def _multiturn_scored(engine, reward=1.0, sample=0):
    result = produce_rollouts([episode_prompt()], engine, producer_id="p-0", sampling=Sampling(TEMPERATURE),
                              max_new_tokens=20,
                              seed=3 + sample, turns=Turns(lambda: Scripted(["5=", "6="]), max_turns=3))
    rollout = result.rollouts[sample]
    assert 0 in rollout.policy_mask, "no environment turn was played: the test proves nothing"
    return ScoredRollout(rollout=rollout, reward=reward, scorer_id="s-0")


def test_the_trainer_attends_to_environment_tokens_but_gives_them_no_loss(engine):
    scored = [_multiturn_scored(engine, 1.0, 0), _multiturn_scored(engine, 0.0, 1)]
    batch = build_batch(scored)
    for b, s in enumerate(scored):
        mask = s.rollout.policy_mask.astype(bool)
        n = len(mask)
        assert batch.response_mask[b, :n].tolist() == mask.tolist()
        assert batch.attention_mask[b, batch.prompt_width:batch.prompt_width + n].tolist() == [1] * n
        assert int(batch.response_lengths[b]) == n
    # the sequence reward lands on the last policy token
    x = advantage_inputs(batch, None, 0.0, trainer_cfg(advantage="grpo"), None)
    last = [int(np.flatnonzero(s.rollout.policy_mask)[-1]) for s in scored]
    assert float(x.token_rewards[0, last[0]]) == 1.0 and float(x.token_rewards[0].sum()) == 1.0
    # the trainer's own recomputation agrees with the sampler's logprobs on the policy tokens
    cfg = trainer_cfg(groups_per_step=1, micro_batch_size=2)
    policy = copy.deepcopy(engine.model).requires_grad_(True)  # the sampler's weights, trainable
    metrics = train_step(TorchEngine(TrainModule(policy), cfg), batch, cfg, TrainState())
    assert metrics["mismatch/logp_abs_diff"] < 1e-5
    assert metrics["batch/tokens"] == float(sum(int(s.rollout.policy_mask.sum()) for s in scored))


def test_admission_refuses_multiturn_rollouts_for_token_level_estimators(engine):
    scored = _multiturn_scored(engine)
    assert check_scored(scored, ModelLimits(vocab_size=15)) is None
    rejection = check_scored(scored, ModelLimits(vocab_size=15, prefix_masks=True))
    assert rejection is not None and "policy turn after environment tokens" in rejection.reason


# -- the demo's retry task, loading and configuration ---------------------------------------------------------------

def test_retry_addition_hints_after_a_wrong_answer_and_ends_at_a_correct_one():
    env = RetryAddition()
    env.reset(episode_prompt())
    assert env.step("45") == "6=" and env.step("46") is None
    assert retry_reward("12+34=", "46", "46", {}) == 1.0
    assert retry_reward("12+34=", "45\n6=\n46", "46", {}) == 0.5
    assert retry_reward("12+34=", "45\n6=\n47\n6=\n46", "46", {}) == 0.25
    assert retry_reward("12+34=", "45\n6=\n47", "46", {}) == 0.0
    assert retry_reward("12+34=", "45\n46=", None, {}) == 0.0  # an environment turn never counts


def test_environment_references_load_or_fail_naming_the_problem():
    assert load_environment("stream_rl.demo.retry:RetryAddition")() is not None
    tool = load_environment("stream_rl.demo.task:answer_for")()
    assert tool.step("12+34=") == Observation("46", done=False, tags={"tool": "answer_for"}, role="tool")
    for reference, words in [("nocolon", "exactly one ':'"), ("no.such.module:X", "module 'no.such.module' not found"),
                             ("stream_rl.demo.retry:Nope", "has no attribute 'Nope'"),
                             ("stream_rl.demo.retry:ENVIRONMENT", "neither an environment class nor a tool"),
                             ("stream_rl.demo.task:addition_reward", r"called as fn\(policy_text\)")]:
        with pytest.raises(EnvironmentLoadError, match=words):
            load_environment(reference)


def test_multiturn_is_refused_with_token_level_estimators():
    with pytest.raises(ConfigError, match=r"producer.environment \(multi-turn\) with trainer.advantage='gae'"):
        load_config(None, env={}, overrides={"producer.environment": "stream_rl.demo.retry:RetryAddition",
                                             "trainer.advantage": "gae"})


# -- the producer loop on the real broker ----------------------------------------------------------------------------

def _producer_loop_on_a_good_and_a_bad_prompt(make_config, engine, environment: str, wait_s: float, **settings):
    """The producer loop on the real broker with ``environment``, fed the addition prompt and one that is not
    (``"1="``) until both are handled: ``(transport, rollouts, dead letters, stats)``."""
    from support.producers import collect, send_prompts, start_producer, stop_producer
    from support.topics import read_values
    from support.waiting import wait_for

    from producers.config import ProducerConfig
    from stream_rl.transport.client import Transport

    cfg = make_config()
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    pcfg = ProducerConfig(follow_weights=False, prompts_per_batch=4, max_new_tokens=14, poll_timeout_s=0.5,
                          temperature=TEMPERATURE, environment=environment, max_turns=2, **settings)
    bad = Prompt(prompt_id="not-addition", epoch=0, text="1=", answer=None, group_size=2)
    send_prompts(transport, [episode_prompt(), bad])
    thread, stop, stats, out = start_producer(cfg, pcfg, engine)
    rollouts = [c.value for c in collect(transport, transport.names.rollouts, want=2)]
    wait_for(lambda: stats.prompts + stats.rejected_prompts == 2,
             'stats.prompts + stats.rejected_prompts == 2', wait_s, watch=[out])
    stop_producer(thread, stop, out)
    return transport, rollouts, read_values(transport, transport.names.dlq, "dead_letter"), stats


@pytest.mark.broker
def test_the_producer_loop_plays_episodes_and_dead_letters_a_prompt_its_environment_fails_on(make_config, engine):
    transport, rollouts, letters, stats = _producer_loop_on_a_good_and_a_bad_prompt(  # the bad one: reset raises
        make_config, engine, "stream_rl.demo.retry:RetryAddition", 30.0)
    assert sorted(r.rollout_id for r in rollouts) == ["add-12-34:0:0", "add-12-34:0:1"]
    for r in rollouts:
        roles = [t["role"] for t in r.turns]
        assert roles in (["policy"], ["policy", "env", "policy"])  # a hint after a wrong answer, at most 2 tries
        if len(roles) == 3:
            assert r.response_text.split("\n")[1] == "6=" and int(r.policy_mask.sum()) < r.response_length
    failed = "environment failed: ValueError: not an addition prompt: '1='"
    assert [(d.error_type, d.reason) for d in letters] == [  # the refilled play's episodes, then the prompt
        ("EnvironmentFailed", f"{failed}; its group is played again (refill 1 of 1)"), ("PromptRejected", failed)]
    assert {(d.source_topic, d.source_offset) for d in letters} == {(transport.names.prompts, 1)}
    assert stats.rejected_prompts == 1


@pytest.mark.broker
def test_with_process_isolation_an_environment_that_kills_its_process_fails_its_prompt_not_the_producer(
        make_config, engine):
    """producer.env_isolation = "process" in the producer loop: the environment exits the process it runs in on the
    bad prompt; that prompt's group is played again, then dead-lettered, naming the exit; the good group is
    published and the producer goes on."""
    _, rollouts, letters, stats = _producer_loop_on_a_good_and_a_bad_prompt(
        make_config, engine, "support.hostile_envs:CrashesOnNonAddition", 60.0, env_isolation="process")
    assert sorted(r.rollout_id for r in rollouts) == ["add-12-34:0:0", "add-12-34:0:1"]
    died = ("environment failed: EnvironmentDied: environment CrashesOnNonAddition reset: its process died "
            "(exit code 7)")
    assert [(d.error_type, d.reason) for d in letters] == [
        ("EnvironmentFailed", f"{died}; its group is played again (refill 1 of 1)"), ("PromptRejected", died)]
    assert stats.rejected_prompts == 1
