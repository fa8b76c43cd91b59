"""Sampling controls (issue 28, item 5): the truncated distribution by hand, stop strings, and bad input refused.

The logits are ``log p`` for p = (0.4, 0.3, 0.15, 0.1, 0.05), so every kept set and its renormalised values can be
read off by hand. No engine here: the engines are in ``tests/integration/test_sampling_hf.py`` (hf) and
``tests/integration/test_vllm_engine.py`` (vLLM).
"""

from __future__ import annotations

import math

import pytest
import torch

from producers.engines.base import EngineError, Sampling, check_stop_strings, cut_at_stop
from producers.engines.stops import StopStrings
from producers.engines.truncation import truncated_logprobs
from stream_rl.config.base import ConfigError
from stream_rl.demo.tokenizer import build_tokenizer

P = (0.4, 0.3, 0.15, 0.1, 0.05)
LOGITS = torch.tensor([[math.log(p) for p in P]])  # [1, 5]
NEG = -math.inf


def expected(kept: dict[int, float]) -> list[float]:
    """log of ``kept`` renormalised, -inf elsewhere (hand-written sets)."""
    total = sum(kept.values())
    return [math.log(kept[i] / total) if i in kept else NEG for i in range(len(P))]


def close(got: torch.Tensor, want: list[float]) -> None:
    row = got[0].tolist()
    assert [math.isinf(x) for x in row] == [math.isinf(x) for x in want], (row, want)
    for x, y in zip(row, want, strict=True):
        if not math.isinf(y):
            assert abs(x - y) < 1e-6, (row, want)


@pytest.mark.parametrize(("sampling", "kept"), [
    # top-k 2: {0.4, 0.3} -> 4/7, 3/7
    (Sampling(top_k=2), {0: 0.4, 1: 0.3}),
    # top-p 0.8: mass strictly before each token (descending) 0, .4, .7, .85, .95: keep while < 0.8 -> 3 tokens
    (Sampling(top_p=0.8), {0: 0.4, 1: 0.3, 2: 0.15}),
    # min-p 0.3: threshold 0.3 * 0.4 = 0.12 -> drop 0.1 and 0.05
    (Sampling(min_p=0.3), {0: 0.4, 1: 0.3, 2: 0.15}),
    # min-p 0.3 then top-p 0.8 on the renormalised {.4,.3,.15}/.85: mass before 0, .47, .82 -> the third goes.
    # (Hugging Face's order, top-p before min-p, would keep all three: the test tells the orders apart.)
    (Sampling(min_p=0.3, top_p=0.8), {0: 0.4, 1: 0.3}),
    # top-k 3 then top-p 0.8: the same renormalised set as above -> two tokens
    (Sampling(top_k=3, top_p=0.8), {0: 0.4, 1: 0.3}),
    # top-k 4, top-p 0.9, min-p 0.2 (threshold 0.08): min-p keeps 4 (.95), top-k keeps them, top-p on /.95:
    # mass before .421, .737, .895 -> all four < 0.9 are kept
    (Sampling(top_k=4, top_p=0.9, min_p=0.2), {0: 0.4, 1: 0.3, 2: 0.15, 3: 0.1}),
    # everything off (-1 is off too): the full softmax
    (Sampling(top_k=-1), dict(enumerate(P))),
])
def test_truncation_keeps_the_hand_computed_set_and_renormalises(sampling, kept):
    close(truncated_logprobs(LOGITS, sampling), expected(kept))


def test_temperature_comes_first():
    """T = 2: z = log(p) / 2, so the kept pair has probabilities proportional to sqrt(p)."""
    a, b = math.sqrt(0.4), math.sqrt(0.3)
    close(truncated_logprobs(LOGITS, Sampling(temperature=2.0, top_k=2)),
          [math.log(a / (a + b)), math.log(b / (a + b)), NEG, NEG, NEG])
    # min-p at T = 2 compares softmax(z) ~ sqrt(p): threshold 0.49 * sqrt(0.4) = 0.310 keeps sqrt(.1) = 0.316,
    # drops sqrt(.05) = 0.224 (at T = 1 the same min-p would keep only 0.4 and 0.3)
    kept = {i: math.sqrt(p) for i, p in enumerate(P) if math.sqrt(p) >= 0.49 * math.sqrt(0.4)}
    assert sorted(kept) == [0, 1, 2, 3]
    close(truncated_logprobs(LOGITS, Sampling(temperature=2.0, min_p=0.49)), expected(kept))


def test_ties_with_the_kth_value_are_kept_and_top_p_keeps_the_most_likely_token():
    tied = torch.tensor([[1.0, 1.0, 0.0]])
    close(truncated_logprobs(tied, Sampling(top_k=1)), [math.log(0.5), math.log(0.5), NEG])
    close(truncated_logprobs(LOGITS, Sampling(top_p=1e-6)), [0.0, NEG, NEG, NEG, NEG])


def test_no_truncation_is_exactly_the_tempered_log_softmax_and_the_input_is_untouched():
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    assert torch.equal(truncated_logprobs(logits, Sampling(temperature=0.7)), torch.log_softmax(logits / 0.7, -1))
    truncated_logprobs(logits, Sampling(temperature=0.7, top_k=3, top_p=0.5, min_p=0.1))
    assert torch.equal(logits, before)


def test_rows_are_truncated_independently():
    rows = torch.cat([LOGITS, LOGITS.flip(-1)])  # [2, 5]
    out = truncated_logprobs(rows, Sampling(top_k=2))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False, False]
    assert torch.isfinite(out[1]).tolist() == [False, False, False, True, True]


# -- stops ----------------------------------------------------------------------------------------------------

def ids(text: str, tokenizer) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_stop_string_ends_at_the_token_that_completes_it_never_inside_the_prompt():
    tok = build_tokenizer()
    prompts = [[1] + ids("12+", tok), [1] + ids("3=", tok), [1] + ids("9=", tok), [1] + ids("1", tok)]
    stops = StopStrings(tok, ["12", "+"], prompts)  # prompt 0 holds both strings, prompt 3 ends with "1"
    columns = ["412", "12", "+", "212"]  # row r's response, one character per step (read while running)
    running, got = [True] * 4, []
    for step in range(3):
        tokens = [ids(col[step], tok)[0] if running[r] else 0 for r, col in enumerate(columns)]
        for row in stops.step(tokens, running):
            running[row] = False
            got.append((step, row))
    # step 0: row 2 writes "+"; step 1: row 1 reads "12"; step 2: rows 0 ("412") and 3 ("212": the prompt's "1"
    # followed by the first "2" at step 0 did not count)
    assert got == [(0, 2), (1, 1), (2, 0), (2, 3)]
    assert stops.ends == [3, 2, 1, 3]


def test_cut_at_stop_takes_the_earlier_of_a_stop_token_and_a_stop_string():
    assert cut_at_stop([5, 6, 7, 2], [-1.0] * 4, frozenset({2}), string_end=2).token_ids == [5, 6]
    assert cut_at_stop([5, 2, 7, 8], [-1.0] * 4, frozenset({2}), string_end=3).token_ids == [5, 2]
    by_string = cut_at_stop([5, 6, 0, 0], [-1.0] * 4, frozenset({2}), string_end=2)
    assert (by_string.token_ids, by_string.finish_reason) == ([5, 6], "stop")
    assert cut_at_stop([5, 6, 7], [-1.0] * 3, frozenset({2})).finish_reason == "length"
    assert cut_at_stop([5, 6, 9], [-1.0] * 3, frozenset({2, 9})).finish_reason == "stop"  # a stop token id


# -- bad input ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "value", "field"), [
    ("producer.top_p", 0.0, "producer.top_p"),
    ("producer.top_p", 1.5, "producer.top_p"),
    ("producer.top_k", -2, "producer.top_k"),
    ("producer.min_p", 1.0, "producer.min_p"),
    ("producer.min_p", -0.1, "producer.min_p"),
    ("producer.stop", ["12", ""], "producer.stop"),
    ("producer.stop_token_ids", [3, -1], "producer.stop_token_ids"),
])
def test_bad_sampling_settings_are_refused_at_config_time_naming_the_field(key, value, field):
    from stream_rl.cli.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides={key: value})
    message = str(info.value)
    assert len(message.splitlines()) == 1 and f"{field}:" in message, message


def test_good_sampling_settings_reach_the_engines_unchanged():
    from stream_rl.cli.config import load_config

    cfg = load_config(None, env={}, overrides={"producer.top_k": -1, "producer.top_p": 0.95, "producer.min_p": 0.05,
                                               "producer.stop": ["=", "12"], "producer.stop_token_ids": [14]})
    assert cfg.producer.sampling() == Sampling(1.0, -1, 0.95, 0.05, ("=", "12"), (14,))


def test_a_stop_string_the_tokenizer_cannot_write_is_refused_naming_the_field_and_the_string():
    tok = build_tokenizer()
    check_stop_strings(["=", "12", "+3"], tok)  # writable
    with pytest.raises(EngineError, match=r"^producer\.stop: the tokenizer cannot encode 'ab'"):
        check_stop_strings(["=", "ab"], tok)


def test_a_stop_token_id_outside_the_vocabulary_is_refused_naming_the_field():
    Sampling(stop_token_ids=(14,)).check(vocab_size=15)
    with pytest.raises(EngineError, match=r"^producer\.stop_token_ids: 15 is outside the vocabulary \[0, 15\)"):
        Sampling(stop_token_ids=(3, 15)).check(vocab_size=15)
    with pytest.raises(EngineError, match=r"producer\.top_p"):
        Sampling(top_p=0.0).check()
