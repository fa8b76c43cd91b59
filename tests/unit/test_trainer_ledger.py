"""The trainer's compacted dedup ledger (consumers.trainer.ledger): exact, and bounded by prompts, not history."""

from __future__ import annotations

import json
import random

from support.trainer import rec

from consumers.trainer.batcher import Batcher
from consumers.trainer.ledger import Ledger, split_rollout_id
from schemas import rollout_id_for


def test_floor_and_ahead_follow_the_drawing():
    ledger = Ledger()
    ledger.add("p7", 0)
    ledger.add("p7", 2)
    assert ledger.to_json() == {"p7": [1, [2]]}
    assert [ledger.trained("p7", e) for e in range(4)] == [True, False, True, False]
    ledger.add("p7", 1)
    assert ledger.to_json() == {"p7": [3, []]} and ledger.entries() == 1
    assert ledger.groups() == {("p7", 0), ("p7", 1), ("p7", 2)}


def test_prompt_ids_with_colons_split_at_the_last_two_parts():
    assert split_rollout_id(rollout_id_for("math:v2:17", 4, 3)) == ("math:v2:17", 4)


def test_a_million_rollout_history_keeps_the_ledger_at_one_entry_per_prompt():
    """1,000 prompts x 125 epochs x 8 samples = 1,000,000 rollouts, epochs trained out of order within a window:
    the ledger is exact (membership of every group) and ends at 1,000 entries, where the id list was 1,000,000."""
    prompts, epochs, samples = 1000, 125, 8
    rng = random.Random(0)
    order = [(p, e) for e in range(epochs) for p in range(prompts)]
    for i in range(0, len(order) - 1, 2):  # neighbours swap: epochs finish out of order across the run
        if rng.random() < 0.5:
            order[i], order[i + 1] = order[i + 1], order[i]
    ledger, peak = Ledger(), 0
    for n, (p, e) in enumerate(order):
        ledger.add(f"prompt-{p}", e)
        if n % 10_000 == 0:
            peak = max(peak, ledger.entries())
    assert prompts * epochs * samples == 1_000_000
    assert ledger.entries() == prompts and peak <= 2 * prompts
    assert all(ledger.trained(f"prompt-{p}", e) for p in (0, 517, 999) for e in range(epochs))
    assert not ledger.trained("prompt-3", epochs) and not ledger.trained("prompt-1000", 0)
    size = len(json.dumps(ledger.to_json()))
    old_size = len(json.dumps(sorted(rollout_id_for(f"prompt-{p}", e, s) for p in range(prompts)
                                     for e in range(2) for s in range(samples))))  # just 2 epochs of ids
    assert size < 25_000 < old_size, (size, old_size)


def test_a_checkpoint_in_the_earlier_form_is_read_and_compacted():
    old = {"trained": [rollout_id_for("p0", 0, s) for s in range(2)] + [rollout_id_for("p0", 1, 0)],
           "requeued": {"p1:0": 0}, "counters": {"trained": 3}}
    batcher = Batcher.from_state(2, old)
    assert batcher.ledger.to_json() == {"p0": [2, []]}
    assert batcher.add(rec(0, 0, 1), 0) == [] and batcher.counters["duplicates"] == 1  # p0 epoch 0 is trained


def test_training_a_group_forgets_its_requeue_entry_and_its_late_members_are_duplicates():
    b = Batcher(max_lag=0)
    b.add(rec(0, 0, 0, version=0), 1)  # lag 1 > 0: p0 dropped, re-queued as attempt 1
    assert b.requeued == {"p0:0": 0}
    b.add(rec(1, 0, 0, version=1, attempt=1), 1)
    b.add(rec(2, 0, 1, version=1, attempt=1), 1)
    b.mark_trained(b.take(1))
    assert b.requeued == {} and b.ledger_state()["groups"] == {"p0": [1, []]}
    assert b.add(rec(3, 0, 1, version=0, attempt=0), 1) == [] and b.counters["duplicates"] == 1
    b.note_requeued("p0:0", 0)  # a resume replaying the re-queue log keeps no entry for a trained group
    assert b.requeued == {}
