"""The shared-prompt forward (trainer.share_prompts) against one forward of the whole rows: same logits, values,
gradients and training step, and each distinct prompt really runs once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.trainer import assert_same_gradients, random_group, scored, tiny_policy, trainer_cfg

from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.prefix import shared_prompt_forward
from consumers.trainer.tensors import build_batch
from consumers.trainer.train_step import TrainState, train_step

torch.set_num_threads(1)


def _batch(model, groups: int = 3, group_size: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    items = [s for p in range(groups) for s in random_group(model, p, group_size=group_size, rng=rng)]
    return build_batch(items)


def _both(module_kw: dict, batch, seed: int = 0):
    """(plain, shared) outputs and parameter gradients of the same weights on ``batch``."""
    out = []
    for share in (False, True):
        module = TrainModule(tiny_policy(seed=seed), share_prompts=share, **module_kw)
        if module.value_head is not None:
            torch.nn.init.normal_(module.value_head.weight, generator=torch.Generator().manual_seed(1))
        logits, values = module(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_width)
        mask = batch.response_mask
        loss = (torch.log_softmax(logits, -1)[..., 5] * mask).sum()  # touches every response position
        if values is not None:
            loss = loss + (values * mask).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        out.append((logits.detach(), None if values is None else values.detach(), grads))
    return out


@pytest.mark.parametrize("value_head", [False, True])
def test_shared_prompt_forward_gives_the_same_logits_values_and_gradients(value_head):
    batch = _batch(tiny_policy(seed=0))
    (lp, vp, gp), (ls, vs, gs) = _both({"value_head": value_head}, batch)
    mask = batch.response_mask
    assert lp.shape == ls.shape
    torch.testing.assert_close(ls[mask], lp[mask], rtol=1e-5, atol=1e-5)
    if value_head:
        torch.testing.assert_close(vs[mask], vp[mask], rtol=1e-5, atol=1e-5)
    assert_same_gradients(gs, gp)


def test_each_distinct_prompt_runs_once_and_one_token_responses_need_no_second_pass():
    """4 rows, 2 prompts (the second with a shorter, left-padded prompt), every response one token long."""
    items = [scored(0, s, group_size=2, prompt_ids=[3, 4, 5], response_ids=[6 + s]) for s in range(2)]
    items += [scored(1, s, group_size=2, prompt_ids=[7, 8], response_ids=[9 + s]) for s in range(2)]
    batch = build_batch(items)
    policy = tiny_policy(seed=2)
    calls = []
    policy.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs["input_ids"].shape),
                                     with_kwargs=True)
    logits, _ = shared_prompt_forward(policy, batch.input_ids, batch.attention_mask, batch.position_ids,
                                      batch.response_width)
    assert calls == [torch.Size([2, 3])]  # the two distinct prompts, once each; no response pass (T = 1)
    with torch.no_grad():
        whole = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits[:, -2:-1]  # [B, 1, V]: predicts the response token
    torch.testing.assert_close(logits.detach(), whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[2], logits[3])  # same prompt, same logits


def test_a_training_step_with_shared_prompts_matches_the_plain_one():
    results = []
    for share in (False, True):
        model = tiny_policy(seed=0)
        batch = _batch(model, groups=2, group_size=3, seed=4)
        cfg = trainer_cfg(micro_batch_size=4, share_prompts=share)
        metrics = train_step(TorchEngine(TrainModule(model, share_prompts=share), cfg), batch, cfg, TrainState())
        results.append((metrics, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (plain, w_plain), (shared, w_shared) = results
    for key in ("loss/total", "policy/entropy", "optim/grad_norm", "advantage/std"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-7), key
    # Adam's first step moves each weight by about lr * sign(g): where g is rounding-sized (a key projection's
    # gradient can be ~1e-7) the two sums may differ in sign, so the bulk is compared, not every element
    diff = torch.cat([(w_shared[n] - w).abs().flatten() for n, w in w_plain.items()])
    start = tiny_policy(seed=0).state_dict()
    moved = torch.cat([(w - start[n]).abs().flatten() for n, w in w_plain.items()])
    assert float(moved.max()) > 1e-3  # the step really changed the weights (lr 1e-2)
    assert float(diff.median()) <= 1e-7 and float((diff > 1e-6).float().mean()) <= 0.01
