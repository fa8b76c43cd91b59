"""Benchmark 18 (the staleness frontier against TRL, bench.trl_frontier): its reach times, summary, choice and report
from hand-made runs, the snapshots both sides keep and their held-out scoring. The benchmark's runs need TRL (the
optional extra) and are not run here (tests/integration/test_bench_trl.py runs its tiny mode where TRL is
installed); nothing here asserts a speed."""

from __future__ import annotations

import time

import pytest
import torch

from bench import snapshots, trl_peer
from bench import trl_frontier as tf
from bench.snapshots import name as snapshot_name
from bench.trl_worker import parse_args, save_snapshot


def test_trailing_means_need_a_full_window():
    assert tf.trailing_means([1.0, 2.0, 3.0, 6.0], 2) == [None, 1.5, 2.5, 4.5]
    assert tf.trailing_means([0.5, 0.25], 1) == [0.5, 0.25]


def test_reach_train_is_the_first_window_of_a_tenth_of_the_steps_at_the_level():
    times = [float(t) for t in range(20)]  # 20 steps: windows of 2
    rewards = [0.1] * 10 + [0.5, 0.1, 0.5, 0.5] + [0.2] * 6
    assert tf.reach_train_s(times, rewards, 0.3) == 10.0  # (0.1 + 0.5) / 2 = 0.3 at step index 10
    assert tf.reach_train_s(times, rewards, 0.5) == 13.0  # the first window of two 0.5s
    assert tf.reach_train_s(times, rewards, 0.51) is None
    assert tf.reach_train_s([0.0, 1.0], [0.9, 0.1], 0.5) == 0.0  # fewer than 10 steps: windows of one


def test_reach_heldout_is_the_first_scored_step_after_the_start_at_the_level():
    times = [0.0, 1.5, 3.0, 4.5]  # the ends of steps 1..4
    heldout = {0: 0.6, 2: 0.35, 4: 0.5}
    assert tf.reach_heldout_s(times, heldout, 0.4) == 4.5  # step 4 ended at times[3]
    assert tf.reach_heldout_s(times, heldout, 0.3) == 1.5  # step 2, not the warm start's 0.6 at step 0
    assert tf.reach_heldout_s(times, heldout, 0.9) is None


def test_median_counts_not_reached_as_never():
    assert tf.median_or_none([1.0, None, 3.0]) == 3.0
    assert tf.median_or_none([None, None, 1.0]) is None
    assert tf.median_or_none([2.0, 4.0]) == 3.0


def _run(span: float, rewards: list[float], heldout: dict[int, float]) -> dict:
    times = [span * i / (len(rewards) - 1) for i in range(len(rewards))]
    return {"times": times, "rewards": rewards, "span_s": span, "heldout": heldout}


RUNS = {  # ten steps, two seeds each, by hand
    "trl": [_run(100.0, [0.2] * 5 + [0.4] * 5, {0: 0.3, 5: 0.4, 10: 0.5}),
            _run(110.0, [0.2] * 5 + [0.4] * 5, {0: 0.3, 5: 0.45, 10: 0.5})],
    "va2": [_run(70.0, [0.2] * 6 + [0.36] * 4, {0: 0.3, 5: 0.45, 10: 0.52}),
            _run(74.0, [0.2] * 6 + [0.36] * 4, {0: 0.3, 5: 0.4, 10: 0.5})],
    "va0": [_run(120.0, [0.2] * 4 + [0.4] * 6, {0: 0.3, 5: 0.5, 10: 0.55}),
            _run(120.0, [0.2] * 4 + [0.4] * 6, {0: 0.3, 5: 0.5, 10: 0.55})],
}
PARAMS = {"steps": 10, "snapshot_every": 5, "rounds": 2, "seeds": [0, 1], "heldout_prompts": 800,
          "settings": {"va2": {"what": "the demo's defaults", "sets": {}},
                       "va0": {"what": "lock-step", "sets": {"producer.versions_ahead": 0}}}}


def test_summary_levels_ratios_and_reach_times_by_hand():
    s = tf.summarise(RUNS)
    f, g = s["figures"], s["gains"]
    assert f["trl.span_s"] == 105.0 and f["va2.span_ratio"] == pytest.approx(72.0 / 105.0)
    assert g["levels.train_reward"] == pytest.approx(0.4) and g["levels.heldout"] == 0.5
    assert g["trl.gain"] == pytest.approx(0.2) and g["va2.gain"] == pytest.approx(0.16)
    assert g["va2.gain_ratio"] == pytest.approx(0.8) and g["va0.gain_ratio"] == pytest.approx(1.0)
    assert g["va2.reach_train_s"] is None  # its reward never reaches TRL's final 0.4
    assert g["va0.reach_train_s"] == pytest.approx(120.0 * 4 / 9)  # the first 0.4 step, index 4, of 9 intervals
    assert g["trl.reach_train_s"] == pytest.approx((100.0 + 110.0) / 2 * 5 / 9)
    # held-out 0.5: va2 at step 10 in both seeds (70 and 74 s), va0 at step 5 (index 4 of 9 intervals of 120 s)
    assert g["va2.reach_heldout_s"] == pytest.approx(72.0) and g["trl.reach_heldout_s"] == pytest.approx(105.0)
    assert g["va0.reach_heldout_s"] == pytest.approx(120.0 * 4 / 9)
    assert g["va2.heldout_final"] == pytest.approx(0.51)
    assert s["heldout_curves"]["va0"][0] == {"step": [0, 5, 10], "heldout": [0.3, 0.5, 0.55]}


def test_the_goal_and_the_choice_follow_the_figures():
    result = {**tf.summarise(RUNS), "params": PARAMS}
    assert not tf.met(result, "va2")  # 0.69x the time but 0.8x the gain
    assert not tf.met(result, "va0")  # the gain but 1.14x the time
    assert tf.best(result) == "va0"  # 53.3 s to TRL's final held-out accuracy, va2 72 s
    result["gains"]["va2.gain_ratio"] = 0.96
    assert tf.met(result, "va2")
    for name in ("va2", "va0"):
        result["gains"][f"{name}.reach_heldout_s"] = result["gains"][f"{name}.reach_train_s"] = None
    assert tf.best(result) is None


def test_the_report_states_the_goal_the_levels_and_the_choice():
    result = {**tf.summarise(RUNS), "params": PARAMS}
    header, rows = tf.table(result)
    assert len(header) == len(rows[0]) == 9 and [r[0].split(":")[0] for r in rows] == [
        "TRL GRPOTrainer", "stream-rl `va2`", "stream-rl `va0`"]
    assert rows[1][2] == "**0.69×**" and rows[1][4] == "0.80×" and rows[1][6] == "not reached"
    assert rows[1][8] == "not met" and rows[0][8] == "–"
    assert tf.headline(result).startswith("demo defaults (va2): 0.69× TRL's time at 0.80× its reward gain")
    text = tf.reading(result)
    assert "TRL's final training reward 0.400" in text and "met by no setting in this run" in text
    assert "soonest is `va0`; the demo's default is `va2`" in text
    assert "At step 5 the held-out accuracy was TRL 0.425, va2 0.425, va0 0.500 (medians over seeds)." in text
    assert "the cause is not known" not in text  # va2 was not behind TRL at step 5
    for curve in result["heldout_curves"]["va2"] + result["heldout_curves"]["va0"]:
        curve["heldout"][1] = 0.3
    assert "lock-step `va0` (rollouts never stale) included" in tf.early(result, ["va2", "va0"])


def test_snapshots_are_every_kth_step_and_a_missing_one_is_named(tmp_path):
    for step in (3, 6):
        (tmp_path / snapshot_name(step)).write_bytes(b"x")
    assert snapshots.snapshots(tmp_path, 7, 3) == {3: tmp_path / "v00000003.safetensors",
                                                   6: tmp_path / "v00000006.safetensors"}
    (tmp_path / snapshot_name(6)).unlink()
    with pytest.raises(RuntimeError, match=r"no weights after steps \[6\]"):
        snapshots.snapshots(tmp_path, 7, 3)
    assert snapshots.snapshots(tmp_path, 7, 0) == {}


def test_the_keeper_links_each_wanted_version_before_garbage_collection_removes_it(tmp_path):
    store, dest = tmp_path / "weights", tmp_path / "kept"
    store.mkdir()
    with snapshots.keeping(store, dest, 6, 2):
        for version in range(7):  # a store that keeps only the newest version, as garbage collection with keep 1
            (store / f".tmp{version}").write_bytes(bytes([version]) * 8)
            (store / f".tmp{version}").rename(store / snapshot_name(version))
            time.sleep(4 * snapshots.POLL_S)
            if version:
                (store / snapshot_name(version - 1)).unlink()
    assert sorted(p.name for p in dest.iterdir()) == [snapshot_name(s) for s in (2, 4, 6)]
    assert (dest / snapshot_name(4)).read_bytes() == bytes([4]) * 8 and not (store / snapshot_name(4)).exists()
    assert sorted(p.name for p in store.iterdir()) == [snapshot_name(6)]


def test_stream_command_sets_the_seed_and_leaves_garbage_collection_as_the_demo_has_it(tmp_path):
    w = trl_peer.Workload("plain", 6, 180, False, "the demo", stream_sets=(("producer.versions_ahead", 0),),
                          seed=2, snapshot_every=20)

    class Ctx:
        workdir = tmp_path

    cmd = trl_peer.stream_command(Ctx(), tmp_path / "demo", w, "run-x", tmp_path / "run-x")
    sets = [cmd[i + 1] for i, part in enumerate(cmd) if part == "--set"]
    assert {"producer.seed=2", "trainer.seed=2", "producer.versions_ahead=0"} <= set(sets)
    assert not any(s.startswith("weights.") for s in sets)  # snapshots are linked out of the store, not kept in it
    plain = trl_peer.stream_command(Ctx(), tmp_path / "demo", trl_peer.Workload("short", 6, 180, False, "x"),
                                    "run-y", tmp_path / "run-y")
    assert not any(s.startswith(("producer.seed", "trainer.seed")) for s in plain)


def test_trl_worker_refuses_saving_without_a_folder(capsys):
    base = ["--demo-dir", "d", "--out", "o.jsonl", "--steps", "3", "--max-new-tokens", "6"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--save-every", "2"])
    assert "--save-every must be >= 0 and needs --save-dir" in capsys.readouterr().err
    assert parse_args([*base, "--save-every", "2", "--save-dir", "s"]).save_every == 2


def test_a_saved_snapshot_is_scored_with_its_own_weights(model_dir, tmp_path):
    from stream_rl.demo.sft import accuracy
    from stream_rl.models.loading import load_policy

    model, tokenizer = load_policy(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path / "snaps" / snapshot_name(4)
    save_snapshot(model, path)
    rows = [{"text": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((12, 34), (50, 7), (9, 90))]
    with torch.no_grad():
        direct = accuracy(model, tokenizer, rows, greedy=True)
    assert tf.heldout_accuracy(model_dir.parent, path, rows) == direct
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    state.pop(next(iter(state)))
    save_file(state, str(path))
    with pytest.raises(Exception, match="missing|Missing"):
        tf.heldout_accuracy(model_dir.parent, path, rows)  # a snapshot that is not the whole policy is refused
