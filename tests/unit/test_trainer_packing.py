"""Sequence packing (trainer.packing): the layout against hand-computed rows, position ids and mask blocks; the
round trip back to the padded layout; a tiny Llama gives the same logprobs, values, gradients and training step
packed as padded; the config refuses packing together with share_prompts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.trainer import assert_same_gradients, random_batch, scored, tiny_policy, trainer_cfg

from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.forward import response_logprobs
from consumers.trainer.packing import block_causal_mask, check_policy, first_fit, pack, row_width, unpack
from consumers.trainer.tensors import build_batch
from consumers.trainer.train_step import TrainState, train_step
from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError

torch.set_num_threads(1)


def _example():
    """The module docstring's batch: prompt + response lengths 3+2, 1+2, 2+1, 1+1 (P = 3, T = 2)."""
    rows = [([3, 4, 5], [6, 7]), ([8], [9, 10]), ([11, 12], [13]), ([14], [15])]
    return build_batch([scored(0, s, group_size=4, prompt_ids=p, response_ids=r) for s, (p, r) in enumerate(rows)])


def test_first_fit_decreasing_places_longest_first_into_the_first_row_with_room():
    assert first_fit([5, 3, 3, 2], 5) == [(0, 0), (1, 0), (2, 0), (1, 3)]  # the docstring's picture
    assert first_fit([5, 3, 3, 2], 8) == [(0, 0), (0, 5), (1, 0), (1, 3)]  # wider rows: 2 instead of 3
    assert first_fit([1, 1, 1], 2) == [(0, 0), (0, 1), (1, 0)]  # ties keep the batch order
    assert row_width([5, 3, 3, 2], None) == 5 and row_width([5, 3], 8) == 8 and row_width([5, 3], 4) == 5
    with pytest.raises(ValueError, match="sequence 1 has 6 tokens, more than the packed row width 5"):
        first_fit([2, 6], 5)


def test_pack_lays_out_ids_positions_segments_and_the_index_by_hand():
    batch = _example()
    packing = pack(batch.input_ids, batch.attention_mask, batch.position_ids)
    assert packing.input_ids.tolist() == [[3, 4, 5, 6, 7], [8, 9, 10, 14, 15], [11, 12, 13, 0, 0]]
    assert packing.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1], [0, 1, 2, 0, 0]]
    assert packing.segments.tolist() == [[0, 0, 0, 0, 0], [1, 1, 1, 3, 3], [2, 2, 2, -1, -1]]
    assert packing.token_index.tolist() == [[0, 1, 2, 3, 4], [-1, -1, 5, 6, 7], [-1, 10, 11, 12, -1],
                                            [-1, -1, 8, 9, -1]]
    # response token t of row b is predicted at padded column P - 1 + t: b2 and b3 have one response token
    assert packing.response_index(batch.response_width).tolist() == [[2, 3], [5, 6], [11, -1], [8, -1]]
    wide = pack(batch.input_ids, batch.attention_mask, batch.position_ids, pack_length=8)
    assert wide.input_ids.tolist() == [[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 0, 0, 0]]
    assert wide.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 0, 1, 0, 0, 0]]


def test_block_causal_mask_keeps_attention_inside_each_sequence():
    batch = _example()
    packing = pack(batch.input_ids, batch.attention_mask, batch.position_ids)
    mask = block_causal_mask(packing.segments)  # [R, 1, W, W]
    assert mask.shape == (3, 1, 5, 5) and mask.dtype == torch.bool
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0],
                                         [0, 0, 0, 1, 1]]
    assert mask[2, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0],
                                         [0, 0, 0, 1, 1]]  # the padding is one more segment
    assert torch.equal(mask[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())
    additive = block_causal_mask(packing.segments, torch.float32)
    assert torch.equal(additive == 0, mask) and float(additive.min()) == torch.finfo(torch.float32).min


@pytest.mark.parametrize("pack_length", [None, 12, 40])
def test_unpack_of_pack_is_the_padded_layout(pack_length):
    batch = random_batch(tiny_policy(seed=0), groups=4, seed=3)
    packing = pack(batch.input_ids, batch.attention_mask, batch.position_ids, pack_length=pack_length)
    valid = batch.attention_mask.bool()
    for packed, padded in ((packing.input_ids, batch.input_ids), (packing.position_ids, batch.position_ids)):
        back = unpack(packed, packing.token_index)  # [B, L]
        assert torch.equal(back, torch.where(valid, padded, 0))
    features = torch.randn(packing.rows, packing.width, 3)  # [R, W, F]: a trailing feature dimension
    back = unpack(features, packing.token_index)  # [B, L, F]
    assert torch.equal(back[valid], features.flatten(0, 1)[packing.token_index[valid]])
    assert not back[~valid].any()
    assert packing.width == max(pack_length or 0, int(valid.sum(1).max()))  # W: pack_length, or the longest
    assert int(valid.sum()) == int((packing.segments >= 0).sum())  # every valid token once, nothing else


def _outputs(batch, packing: bool, value_head: bool, attention: str = "sdpa"):
    """Logprobs, values and parameter gradients of one forward/backward of the same weights."""
    policy = tiny_policy(seed=0)
    policy.set_attn_implementation(attention)
    engine = TorchEngine(TrainModule(policy, value_head=value_head, packing=packing), trainer_cfg())
    if value_head:
        torch.nn.init.normal_(engine.module.value_head.weight, generator=torch.Generator().manual_seed(1))
    logp, ent, values = response_logprobs(engine, batch, entropy=True)
    mask = batch.response_mask
    loss = (logp * mask).sum() + ((values * mask).sum() if value_head else 0.0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
    return logp.detach(), ent, values, grads


@pytest.mark.parametrize("attention,value_head", [("sdpa", False), ("sdpa", True), ("eager", True)])
def test_packed_forward_gives_the_padded_logprobs_values_and_gradients(attention, value_head):
    batch = random_batch(tiny_policy(seed=0), temperature=0.7)  # each row scored under its own temperature
    lp, ep, vp, gp = _outputs(batch, False, value_head, attention)
    lk, ek, vk, gk = _outputs(batch, True, value_head, attention)
    mask = batch.response_mask
    assert lk.shape == lp.shape == mask.shape
    torch.testing.assert_close(lk[mask], lp[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ek[mask], ep[mask], rtol=1e-5, atol=1e-5)
    if value_head:
        torch.testing.assert_close(vk[mask], vp[mask], rtol=1e-5, atol=1e-5)
    assert_same_gradients(gk, gp)


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_a_packed_training_step_matches_the_padded_one(advantage):
    results = []
    for packing in (False, True):
        model = tiny_policy(seed=0)
        batch = random_batch(model, groups=2, group_size=3, seed=4)
        cfg = trainer_cfg(micro_batch_size=4, share_prompts=False, packing=packing, advantage=advantage)
        module = TrainModule(model, value_head=advantage == "gae", packing=packing)
        metrics = train_step(TorchEngine(module, cfg), batch, cfg, TrainState())
        results.append((metrics, {n: p.detach().clone() for n, p in module.named_parameters()}))
    (padded, w_padded), (packed, w_packed) = results
    for key in ("loss/total", "policy/entropy", "optim/grad_norm", "advantage/std"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-7), key
    # Adam's first step moves each weight by about lr * sign(g): where g is rounding-sized the two sums may
    # differ in sign, so the bulk is compared, not every element (as tests/unit/test_trainer_prefix.py does)
    diff = torch.cat([(w_packed[n] - w).abs().flatten() for n, w in w_padded.items()])
    start = TrainModule(tiny_policy(seed=0), value_head=advantage == "gae").state_dict()
    moved = torch.cat([(w - start[n]).abs().flatten() for n, w in w_padded.items()])
    assert float(moved.max()) > 1e-3  # the step really changed the weights (lr 1e-2)
    assert float(diff.median()) <= 1e-7 and float((diff > 1e-6).float().mean()) <= 0.01


def test_policies_packing_cannot_run_exactly_are_refused():
    def policy(**config):
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa", **config))

    assert check_policy(policy(), 16) is None
    assert check_policy(SimpleNamespace(config=SimpleNamespace(_attn_implementation="eager")), 16) == torch.float32
    with pytest.raises(ValueError, match="needs attention 'sdpa' or 'eager'.*'flash_attention_2'"):
        check_policy(SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2")), 16)
    sliding = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
    with pytest.raises(ValueError, match=r"sliding window \(8\) is narrower than a packed row \(16\)"):
        check_policy(policy(**sliding), 16)
    assert check_policy(policy(**sliding), 8) is None
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        check_policy(policy(final_logit_softcapping=30.0), 16)


def test_config_refuses_packing_with_shared_prompts():
    def load(**overrides):
        return load_config(None, env={}, overrides=overrides)

    with pytest.raises(ConfigError, match=r"trainer: packing=true with share_prompts=true.*set "
                                          r"share_prompts=false to pack.*\[from flag\]") as info:
        load(**{"trainer.packing": "true"})
    assert len(str(info.value).splitlines()) == 1
    cfg = load(**{"trainer.packing": "true", "trainer.share_prompts": "false", "trainer.pack_length": "256"})
    assert cfg.trainer.packing and cfg.trainer.pack_length == 256
    assert not load().trainer.packing and load().trainer.pack_length is None
    with pytest.raises(ValueError, match="alternative forward paths"):
        TrainModule(tiny_policy(seed=0), share_prompts=True, packing=True)


def test_the_packing_benchmark_runs_tiny_and_reports_every_figure(tmp_path):
    """bench/packing.py stays alive (tiny sizes: the figures mean nothing, only that they exist)."""
    from bench import packing as bench_packing
    from bench.common import BenchContext, bad_figures

    torch.set_num_threads(1)
    result = bench_packing.run(BenchContext(bootstrap="unused", mode="tiny", workdir=tmp_path))
    assert torch.get_num_threads() == 1
    names = {f"{n}_tokens{tag}_s" for n in bench_packing.VARIANTS for tag in ("", "_cpu")}
    names |= {f"{n}_vs_padded{tag}" for n in ("packed", "shared") for tag in ("", "_cpu")}
    assert set(result["figures"]) == names and bad_figures(result["figures"]) == []
    p = result["params"]
    assert p["grad_norm_rel_diff"] < 1e-4 and p["packed_slots"] <= p["padded_slots"]
    headers, rows = bench_packing.table(result)
    assert len(rows) == 3 and all(len(row) == len(headers) for row in rows)
    assert "packed rows" in bench_packing.headline(result)  # the reading is prose in docs/benchmarks.md
    assert f"relative difference {p['grad_norm_rel_diff']:.1e}" in bench_packing.more_tables(result)
