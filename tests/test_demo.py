"""The built-in demo: tokenizer, task and verifier, left padding, warm-start, and the full `init_demo`."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from stream_rl.demo.model import build_policy, count_parameters
from stream_rl.demo.sft import SFTConfig, supervised_warm_start
from stream_rl.demo.task import addition_reward, answer_for, make_prompts, problems
from stream_rl.demo.tokenizer import build_tokenizer

torch.set_num_threads(1)  # 2 shared cores: one thread avoids OpenMP stalls when the other core is busy


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_tokenizer_round_trip_and_ids(tokenizer):
    assert len(tokenizer) == 15
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = "0123456789+="
    ids = tokenizer(text)["input_ids"]
    assert ids == [1] + list(range(3, 15))  # <bos>, then one id per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids) == "<bos>" + text
    assert tokenizer("46<eos>", add_special_tokens=False)["input_ids"] == [7, 9, 2]


def test_tokenizer_pads_left_and_rejects_unknown_characters(tokenizer):
    batch = tokenizer(["1+2=", "12+34="], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0][:2] == [0, 0]
    with pytest.raises(Exception, match="UNK"):
        tokenizer("1-2=")


def test_tokenizer_reloads_offline_with_auto_tokenizer(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded.padding_side == "left"
    for text in ("12+34=", "99+99=198", "7"):
        assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.decode([7, 9, 2, 0, 0]) == "46<eos><pad><pad>"


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("46", 1.0),
        ("46<eos>", 1.0),
        ("46<eos><pad><pad>", 1.0),
        ("46\n", 1.0),
        ("47", 0.0),
        ("046", 0.0),
        ("467", 0.0),
        ("46<eos>7", 0.0),
        ("4<pad>6", 0.0),
        ("", 0.0),
        ("<eos>", 0.0),
    ],
)
def test_verifier_hand_cases(response, expected):
    assert addition_reward("12+34=", response, "46", {}) == expected


def test_verifier_computes_a_missing_answer_and_rejects_other_prompts():
    assert addition_reward("99+99=", "198<eos>", None, {}) == 1.0
    assert addition_reward("99+99=", "189<eos>", None, {}) == 0.0
    assert answer_for("10+90=") == "100"
    with pytest.raises(ValueError):
        answer_for("hello")


def test_prompts_are_deterministic_disjoint_and_correct():
    train, held_out = problems("train"), problems("eval")
    assert len(train) + len(held_out) == 90 * 90
    assert 0.07 < len(held_out) / 8100 < 0.13
    assert not set(train) & set(held_out)
    rows = make_prompts(50, seed=3)
    assert rows == make_prompts(50, seed=3) and rows != make_prompts(50, seed=4)
    assert len({row["prompt_id"] for row in rows}) == 50
    for row in rows:
        a, b = map(int, row["text"][:-1].split("+"))
        assert row["prompt_id"] == f"add-{a}-{b}" and row["answer"] == str(a + b) and (a, b) in set(train)
    assert all(tuple(map(int, r["text"][:-1].split("+"))) in set(held_out) for r in make_prompts(20, 0, "eval"))
    with pytest.raises(ValueError):
        make_prompts(len(held_out) + 1, 0, "eval")


def test_policy_shape(tokenizer):
    model = build_policy(tokenizer)
    assert model.config.head_dim == 32 and model.config.num_attention_heads == 4
    assert 1.0e6 < count_parameters(model) < 1.1e6


def _token_logprobs(model, input_ids, attention_mask):
    """log p(token_t | tokens_<t) for t >= 1, (B, T-1), with left-padding-aware positions."""
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, T)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logprobs = logits[:, :-1].float().log_softmax(dim=-1)  # (B, T-1, V)
    return logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)


@torch.no_grad()
def test_left_padded_logprobs_equal_unpadded(tokenizer):
    model = build_policy(tokenizer, seed=7).eval()
    texts = ["1+2=3<eos>", "12+34=46<eos>", "99+99=198<eos>", "5+5="]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    batched = _token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    width = batch["input_ids"].size(1)
    for i, text in enumerate(texts):
        alone = tokenizer([text], return_tensors="pt")
        single = _token_logprobs(model, alone["input_ids"], alone["attention_mask"])[0]
        length = alone["input_ids"].size(1)
        torch.testing.assert_close(batched[i, width - length :], single, atol=1e-5, rtol=0)


def test_sft_smoke_loss_decreases(tokenizer):
    model = build_policy(tokenizer, seed=0)
    train, held_out = make_prompts(2000, 0), make_prompts(64, 0, "eval")
    config = SFTConfig(batch_size=32, max_steps=25, eval_every=1000)
    result = supervised_warm_start(model, tokenizer, train, held_out, config)
    assert result.steps == 25 and result.stopped == "max_steps" and len(result.losses) == 25
    assert sum(result.losses[-5:]) / 5 < 0.8 * sum(result.losses[:5]) / 5
    assert 0.0 <= result.sampled_accuracy <= 1.0 and 0.0 <= result.greedy_accuracy <= 1.0


def test_sft_stops_at_the_target(tokenizer):
    model = build_policy(tokenizer, seed=0)
    config = SFTConfig(max_steps=50, eval_every=2, eval_size=16, target_accuracy=0.0)
    result = supervised_warm_start(model, tokenizer, make_prompts(500, 0), make_prompts(16, 0, "eval"), config)
    assert (result.steps, result.stopped, len(result.evals)) == (2, "target", 1)


@pytest.mark.slow
def test_init_demo_builds_a_policy_that_succeeds_sometimes(demo_build):
    from stream_rl.models import load_policy, load_reference, load_reward_model

    root, info = demo_build
    assert json.loads((root / "demo.json").read_text()) == info
    assert 0.05 < info["sft"]["sampled_accuracy"] < 0.9, info["sft"]
    assert info["sft"]["stopped"] == "target"
    policy, tok = load_policy(root / "policy")
    reference, _ = load_reference(root / "reference")
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), reference.state_dict().values()))
    reward_model, _ = load_reward_model(root / "reward_model")
    assert reward_model.config.num_labels == 1
    stats = info["reward_model_stats"]
    assert stats["eval_mean_score_correct"] > stats["eval_mean_score_wrong"]
    rows = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (root / "eval_prompts.jsonl").read_text().splitlines()]
    assert len(rows) == info["num_prompts"] and len(held_out) == info["num_eval_prompts"]
    assert not {r["prompt_id"] for r in rows} & {r["prompt_id"] for r in held_out}
    assert sorted(p.name for p in root.parent.iterdir()) == ["demo"]  # no temporary build directory left


def test_demo_prompt_ids_are_valid_schema_ids():
    from schemas import ID_PATTERN
    from stream_rl.demo.task import make_prompts

    assert all(ID_PATTERN.match(row["prompt_id"]) for row in make_prompts(200, seed=3))
