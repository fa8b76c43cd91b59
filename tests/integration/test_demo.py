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


# --- demo init: progress on stderr, and builds that survive being killed (issue 13) ---------------------------

FAST_SFT = {"batch_size": 32, "max_steps": 30, "eval_every": 10, "eval_size": 16, "target_accuracy": 1.0}


@pytest.fixture
def fast_demo_init(monkeypatch):
    """`stream-rl demo init` with a 30-step warm-start (the CLI has no SFT flags): the CLI stays as a user types it."""
    import stream_rl.demo.init as demo_init

    monkeypatch.setattr(demo_init, "SFTConfig", lambda: SFTConfig(**FAST_SFT))


def _cli(args):
    from typer.testing import CliRunner

    from stream_rl.cli.main import app

    return CliRunner().invoke(app, args)


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".demo."))


def test_demo_init_cli_shows_warm_start_progress_with_eta_on_stderr(tmp_path, fast_demo_init):
    result = _cli(["demo", "init", str(tmp_path / "demo"), "--no-reward-model"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    steps = [line for line in lines if line.startswith("  warm-start step ")]
    assert steps[0].startswith("  warm-start step 1/30 ") and "ETA <= " in steps[0], lines
    assert [line.split()[2] for line in steps] == ["1/30", "10/30", "20/30", "30/30"], lines
    assert steps[-1].endswith("elapsed, done")
    assert any("supervised warm-start: up to 30 steps" in line for line in lines), lines
    assert lines[-1].startswith("demo init [") and lines[-1].endswith(f"demo ready in {tmp_path / 'demo'}")
    assert "Writing model shards" not in result.output
    info = json.loads(result.stdout)
    assert info["sft"]["steps"] == 30 and (tmp_path / "demo" / "policy").is_dir()
    assert _leftovers(tmp_path) == []


def test_demo_init_killed_mid_build_is_cleaned_up_by_the_next_init(tmp_path, fast_demo_init):
    import signal
    import subprocess
    import sys
    import time

    target = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "demo", "init", str(target), "--no-reward-model"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stderr:  # full settings: up to 1000 steps, so it is still training when killed
            if line.startswith("  warm-start step"):
                break
        else:
            pytest.fail(f"demo init ended before its warm-start (exit {proc.wait()})")
        assert len(_leftovers(tmp_path)) == 1 and not target.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert _leftovers(tmp_path)[0].startswith(".demo.tmp-") and not target.exists()  # nothing `run` could use
    result = _cli(["demo", "init", str(target), "--no-reward-model"])
    assert result.exit_code == 0, result.output
    assert "removed 1 leftover(s) of an earlier interrupted build: .demo.tmp-" in result.stderr
    assert _leftovers(tmp_path) == [] and (target / "demo.json").is_file()
    started = time.perf_counter()
    assert _cli(["demo", "init", str(target)]).exit_code == 2  # exists, no --overwrite: refused, untouched
    assert time.perf_counter() - started < 5 and (target / "demo.json").is_file()


def test_leftovers_of_a_running_build_are_kept(tmp_path):
    from stream_rl.demo.init import _lock_dir, remove_leftovers

    target = tmp_path / "demo"
    running, dead, old = (tmp_path / name for name in (".demo.tmp-aaaa", ".demo.tmp-bbbb", ".demo.old-cccc"))
    for path in (running, dead, old):
        path.mkdir()
        (path / "demo.json").write_text("{}")
    (tmp_path / ".other.tmp-dddd").mkdir()  # another target's build: not ours to remove
    fd = _lock_dir(running)  # held as a live build holds it; a killed build's lock died with it
    try:
        assert sorted(p.name for p in remove_leftovers(target)) == [".demo.old-cccc", ".demo.tmp-bbbb"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [".demo.tmp-aaaa", ".other.tmp-dddd"]
    finally:
        os.close(fd)
    assert [p.name for p in remove_leftovers(target)] == [".demo.tmp-aaaa"]


def test_overwrite_replaces_the_demo_without_a_half_deleted_moment(tmp_path):
    from stream_rl.demo.init import _publish

    target, build = tmp_path / "demo", tmp_path / ".demo.tmp-new"
    target.mkdir()
    (target / "demo.json").write_text('{"old": true}')
    build.mkdir()
    (build / "demo.json").write_text('{"new": true}')
    with pytest.raises(FileExistsError, match="appeared during the build"):
        _publish(build, target, overwrite=False)
    _publish(build, target, overwrite=True)
    assert json.loads((target / "demo.json").read_text()) == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_progress_bar_on_a_terminal_redraws_in_place_and_ends_the_line():
    import io

    from stream_rl.demo.progress import DemoProgress, SFTProgress, eta_seconds

    out = io.StringIO()
    report = DemoProgress(out, tty=True)
    report.sft_step(SFTProgress(1, 100, 2.5, 1.0, None, 0.2))
    report.sft_step(SFTProgress(50, 100, 1.0, 50.0, None, 0.2, accuracy=0.1))
    report.sft_step(SFTProgress(60, 100, 0.9, 60.0, None, 0.2, accuracy=0.25, last=True))
    report.phase("saving")
    text = out.getvalue()
    assert text.count("\r") == 3 and "\n" not in text.split("\r")[2]  # one bar, redrawn
    assert "[############............] step 50/100 loss 1.000 accuracy 0.10 (stops at 0.20) 50s elapsed, " \
           "ETA <= 50s" in text
    assert "[########################] step 60/100" in text and "done\x1b[K\ndemo init [" in text
    assert eta_seconds(SFTProgress(10, 1000, 1.0, 20.0, None, 0.2)) == pytest.approx(1980.0)
    assert eta_seconds(SFTProgress(10, 1000, 1.0, 20.0, 50.0, 0.2)) == pytest.approx(30.0)  # max_seconds caps it


def test_progress_callback_does_not_change_the_warm_start(tokenizer):
    config = SFTConfig(batch_size=16, max_steps=6, eval_every=3, eval_size=8, target_accuracy=1.0)
    train, held_out = make_prompts(200, 0), make_prompts(8, 0, "eval")
    seen = []
    with_cb = supervised_warm_start(build_policy(tokenizer, seed=0), tokenizer, train, held_out, config, seen.append)
    without = supervised_warm_start(build_policy(tokenizer, seed=0), tokenizer, train, held_out, config)
    assert with_cb.losses == without.losses and with_cb.evals == without.evals
    assert [p.step for p in seen] == [1, 2, 3, 4, 5, 6] and [p.last for p in seen] == [False] * 5 + [True]
    assert [p.accuracy is not None for p in seen] == [False, False, True, False, False, True]
