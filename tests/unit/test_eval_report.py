"""The end-of-run line ``held-out accuracy before -> after`` (stream_rl.evaluation.report)."""

from __future__ import annotations

from stream_rl.evaluation.report import before_after_line, headline_metric


def _row(version, step, metrics, sets=("heldout",)):
    return {"version": version, "step": step, "sets": list(sets), "metrics": metrics}


def test_first_against_last_by_version_on_greedy_accuracy():
    rows = [_row(40, 40, {"heldout/greedy/accuracy": 0.5, "heldout/pass@1": 0.3}),
            _row(0, 0, {"heldout/greedy/accuracy": 0.125, "heldout/pass@1": 0.1}),
            _row(20, 20, {"heldout/greedy/accuracy": 0.25, "heldout/pass@1": 0.2})]
    assert before_after_line(rows) == ("held-out accuracy before -> after: 0.125 (v0) -> 0.500 (v40, step 40) "
                                       "[heldout/greedy/accuracy]")


def test_metric_falls_back_to_pass_at_1_then_mean_and_no_rows_says_so():
    assert headline_metric(_row(0, 0, {"h/pass@1": 0.1, "h/mean@4": 0.2}, sets=("h",))) == "h/pass@1"
    assert headline_metric(_row(0, 0, {"h/mean@4": 0.2}, sets=("h",))) == "h/mean@4"
    assert headline_metric(_row(0, 0, {}, sets=("h",))) is None
    assert before_after_line([]).startswith("held-out accuracy: no evaluation recorded")


def test_last_evaluation_is_the_highest_version_with_set_level_metrics():
    from stream_rl.evaluation.report import last_evaluation

    rows = [_row(20, 20, {"h/pass@1": 0.2}, sets=("h",)),
            _row(40, 41, {"h/pass@1": 0.4, "h/a/pass@1": 0.5, "h/greedy/accuracy": 0.3}, sets=("h",)),
            _row(0, 0, {"h/pass@1": 0.1}, sets=("h",))]
    assert last_evaluation(rows) == {"version": 40, "step": 41,
                                     "metrics": {"h/pass@1": 0.4, "h/greedy/accuracy": 0.3}}
    assert last_evaluation([]) is None


def test_evaluations_join_the_trainer_rows_at_their_step():
    from stream_rl.evaluation.report import with_evaluations

    rows = [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.2}]
    evals = [_row(0, 0, {"h/pass@1": 0.05}), _row(2, 2, {"h/pass@1": 0.3, "h/a/pass@1": 0.4})]
    assert with_evaluations(rows, evals) == [
        {"step": 0, "eval/h/pass@1": 0.05},
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": 0.2, "eval/h/pass@1": 0.3, "eval/h/a/pass@1": 0.4}]
    assert rows[1] == {"step": 2, "reward/mean": 0.2}  # the caller's rows are not changed


def test_report_draws_the_evaluation_panel_from_evals_jsonl(tmp_path):
    import json

    from stream_rl.operator_tools.report import build_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n"
                                               for s in range(1, 6)))
    text, out = build_report(run)
    assert not (out / "evaluation.png").exists()  # no evaluations, no panel
    (run / "evals.jsonl").write_text("".join(json.dumps(_row(v, v, {"heldout/greedy/accuracy": v / 8}, )) + "\n"
                                             for v in (0, 2, 4)))
    text2, out = build_report(run)
    assert (out / "evaluation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert text2 == text  # the summary still counts trainer steps only
