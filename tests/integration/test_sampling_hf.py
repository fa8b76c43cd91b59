"""Sampling controls in the ``hf`` engine (issue 28, item 5) on the tiny real Llama, float32, no broker.

- the engine draws only inside the truncated set, with the truncated frequencies (a fixed-seed statistical test);
- its behaviour logprobs are :func:`producers.engines.truncation.truncated_logprobs` of a trainer-style
  recomputation of the logits, and :func:`producers.engines.hf.score_tokens` gives the same values;
- stop token ids and stop strings end samples (the completing token kept, ``finish_reason="stop"``);
- ``build_engine`` refuses a stop string the tokenizer cannot write and a stop id outside the vocabulary.
The same behaviour logprobs from vLLM, on the same tokens: ``tests/integration/test_vllm_engine.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support.producers import PROMPTS, build_tiny_model_dir, reference_model

from producers.config import ProducerConfig
from producers.engines import build_engine
from producers.engines.base import EngineError, Sampling
from producers.engines.hf import HFEngine, score_tokens
from producers.engines.truncation import truncated_logprobs

TRUNCATED = Sampling(temperature=0.8, top_k=6, top_p=0.8, min_p=0.05)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("sampling") / "policy")


@pytest.fixture(scope="module")
def engine(model_dir) -> HFEngine:
    return HFEngine.from_dir(model_dir)


def next_token_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1].float()  # [V]


def test_the_engine_draws_only_inside_the_truncated_set_with_its_frequencies(engine, model_dir):
    """2000 first tokens of one prompt under top-k 3: every draw is one of the three, and each token's frequency
    is within 4 standard errors of its truncated (renormalised) probability, which differs from its full one by
    more than that (so sampling the full softmax, or the wrong set, fails)."""
    prompt, n, sampling = PROMPTS[0], 2000, Sampling(temperature=1.0, top_k=3)
    logits = next_token_logits(reference_model(model_dir), prompt)  # [V]
    kept = torch.topk(logits, 3).indices.tolist()
    probs = torch.softmax(truncated_logprobs(logits[None], sampling)[0], -1)  # [V]
    full = torch.softmax(logits, -1)
    drawn = [g.token_ids[0] for g in engine.generate([prompt], n=n, sampling=sampling, max_new_tokens=1, seed=0)[0]]
    assert set(drawn) <= set(kept)
    for token in kept:
        freq, p = drawn.count(token) / n, float(probs[token])
        se = math.sqrt(p * (1 - p) / n)
        assert abs(freq - p) < 4 * se, (token, freq, p)
    assert max(abs(float(probs[t] - full[t])) for t in kept) > 4 * math.sqrt(0.25 / n)  # the test can tell


def test_behaviour_logprobs_are_the_truncated_distribution_of_a_recomputation(engine, model_dir):
    groups = engine.generate(PROMPTS, n=6, sampling=TRUNCATED, max_new_tokens=10, seed=3)
    model = reference_model(model_dir)
    checked = 0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for sample in group:
            ids = torch.tensor([prompt + sample.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # [R, V]
            want = truncated_logprobs(logits, TRUNCATED).gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            assert torch.isfinite(want).all(), "a token outside the truncated set was drawn"
            assert max(abs(a - b) for a, b in zip(sample.logprobs, want.tolist(), strict=True)) < 1e-5
            scored = score_tokens(model, prompt, sample.token_ids, TRUNCATED)
            assert max(abs(a - b) for a, b in zip(sample.logprobs, scored, strict=True)) < 1e-5
            checked += len(sample.token_ids)
    full = engine.generate(PROMPTS, n=6, sampling=Sampling(temperature=0.8), max_new_tokens=10, seed=3)
    assert checked > 60
    # truncation raises the logprob of what is kept: the engine does report the truncated, not the full, values
    flat_t = [lp for g in groups for s in g for lp in s.logprobs]
    flat_f = [lp for g in full for s in g for lp in s.logprobs]
    assert sum(flat_t) / len(flat_t) > sum(flat_f) / len(flat_f)


def _most_drawn(engine) -> int:
    groups = engine.generate(PROMPTS, n=8, sampling=Sampling(), max_new_tokens=8, seed=1)
    tokens = [t for g in groups for s in g for t in s.token_ids if t != engine.eos_token_id]
    return max(set(tokens), key=tokens.count)


def test_a_stop_token_id_ends_samples_and_stays_their_last_token(engine):
    stop = _most_drawn(engine)
    groups = engine.generate(PROMPTS, n=8, sampling=Sampling(stop_token_ids=(stop,)), max_new_tokens=8, seed=1)
    samples = [s for g in groups for s in g]
    stopped = [s for s in samples if s.token_ids[-1] == stop]
    assert len(stopped) >= 8  # the most drawn token: many samples meet it
    for s in samples:
        assert stop not in s.token_ids[:-1]
        assert s.finish_reason == ("stop" if s.token_ids[-1] in (stop, engine.eos_token_id) else "length")
    plain = engine.generate(PROMPTS, n=8, sampling=Sampling(), max_new_tokens=8, seed=1)
    for s, p in zip(samples, [s for g in plain for s in g], strict=True):  # same draws, cut earlier
        assert p.token_ids[:len(s.token_ids)] == s.token_ids


def test_a_stop_string_ends_samples_at_the_token_that_completes_it(engine):
    tok = engine.tokenizer
    digit = tok.decode([_most_drawn(engine)])
    stops = (digit + digit, "=")  # two tokens, and one
    sampling = Sampling(stop=stops)
    groups = engine.generate(PROMPTS, n=8, sampling=sampling, max_new_tokens=10, seed=2)
    plain = engine.generate(PROMPTS, n=8, sampling=Sampling(), max_new_tokens=10, seed=2)
    by_string = 0
    for s, p in zip([s for g in groups for s in g], [s for g in plain for s in g], strict=True):
        text, before = tok.decode(s.token_ids), tok.decode(s.token_ids[:-1])
        assert not any(x in before for x in stops)  # nothing ended it earlier
        assert p.token_ids[:len(s.token_ids)] == s.token_ids  # the same draws, cut at the stop
        if s.token_ids[-1] != engine.eos_token_id and any(text.endswith(x) for x in stops):
            assert s.finish_reason == "stop"
            by_string += 1
        elif s.finish_reason == "length":
            assert len(s.token_ids) == 10 and not any(x in text for x in stops)
    assert by_string >= 4


def test_build_engine_refuses_what_the_tokenizer_or_the_vocabulary_cannot_produce(model_dir):
    with pytest.raises(EngineError, match=r"^producer\.stop: the tokenizer cannot encode 'x'"):
        build_engine(ProducerConfig(model_dir=model_dir, stop=["=", "x"]))
    with pytest.raises(EngineError, match=r"^producer\.stop_token_ids: 15 is outside the vocabulary"):
        build_engine(ProducerConfig(model_dir=model_dir, stop_token_ids=[15]))
    engine = build_engine(ProducerConfig(model_dir=model_dir, stop=["="], stop_token_ids=[14], top_p=0.9))
    assert isinstance(engine, HFEngine)
