"""Strict local loading: round trips, missing/unexpected/misshaped keys, sharding, tied weights, pickles refused."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from stream_rl.demo.model import build_policy, build_reward_model, demo_config
from stream_rl.demo.tokenizer import build_tokenizer
from stream_rl.models import (
    ModelLoadError,
    load_policy,
    load_reference,
    load_reward_model,
    load_state_dict_strict,
    save_model,
    state_dict_for_broadcast,
)

torch.set_num_threads(1)  # 2 shared cores: one thread avoids OpenMP stalls when the other core is busy


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def saved_policy(tmp_path_factory, tokenizer):
    model = build_policy(tokenizer, seed=1)
    path = save_model(model, tokenizer, tmp_path_factory.mktemp("m") / "policy")
    return model, path


def _rewrite_weights(path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _copy_dir(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_policy_round_trip_is_exact(saved_policy):
    original, path = saved_policy
    loaded, tokenizer = load_policy(path)
    assert loaded.training
    assert tokenizer.padding_side == "left"
    want, got = original.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_reference_is_frozen(saved_policy):
    _, path = saved_policy
    model, _ = load_reference(path)
    assert not model.training
    assert not any(param.requires_grad for param in model.parameters())


def test_reward_model_round_trip(tmp_path, tokenizer):
    model = build_reward_model(tokenizer, seed=2)
    path = save_model(model, tokenizer, tmp_path / "rm")
    loaded, rm_tokenizer = load_reward_model(path)
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == tokenizer.pad_token_id
    assert rm_tokenizer.padding_side == "right"
    assert not any(param.requires_grad for param in loaded.parameters())
    assert torch.equal(loaded.score.weight, model.score.weight)


def test_reward_loader_refuses_a_causal_lm(saved_policy):
    _, path = saved_policy
    with pytest.raises(ModelLoadError, match="num_labels=1"):
        load_reward_model(path)


def test_missing_key_is_named(tmp_path, saved_policy):
    path = _copy_dir(saved_policy[1], tmp_path / "p")
    _rewrite_weights(path, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"1 missing: model\.layers\.2\.mlp\.up_proj\.weight"):
        load_policy(path)


def test_unexpected_key_is_named(tmp_path, saved_policy):
    path = _copy_dir(saved_policy[1], tmp_path / "p")
    _rewrite_weights(path, lambda t: t.update({"model.extra_head.weight": torch.zeros(3)}))
    with pytest.raises(ModelLoadError, match=r"1 unexpected: model\.extra_head\.weight"):
        load_policy(path)


def test_shape_mismatch_is_named(tmp_path, saved_policy):
    path = _copy_dir(saved_policy[1], tmp_path / "p")
    _rewrite_weights(path, lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(ModelLoadError, match=r"shape mismatch: model\.norm\.weight"):
        load_policy(path)


def test_sharded_checkpoint_loads_and_is_checked(tmp_path, tokenizer):
    model = build_policy(tokenizer, seed=3)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    tokenizer.save_pretrained(tmp_path / "sharded")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded, _ = load_policy(tmp_path / "sharded")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)

    shard = tmp_path / "sharded" / index["weight_map"]["model.norm.weight"]
    tensors = load_file(shard)
    del tensors["model.norm.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight"):
        load_policy(tmp_path / "sharded")


def test_tied_weights_may_be_absent_from_the_file(tmp_path, tokenizer):
    from transformers import LlamaForCausalLM

    config = demo_config(tokenizer)
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config)
    path = save_model(model, tokenizer, tmp_path / "tied")
    loaded, _ = load_policy(path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)

    sent = state_dict_for_broadcast(loaded)
    assert "model.embed_tokens.weight" in sent and "lm_head.weight" not in sent
    fresh = LlamaForCausalLM(config)
    load_state_dict_strict(fresh, sent)
    assert torch.equal(fresh.lm_head.weight, model.model.embed_tokens.weight)


def test_pickled_weights_are_refused(tmp_path, saved_policy):
    path = _copy_dir(saved_policy[1], tmp_path / "p")
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"pickled weights \['pytorch_model\.bin'\]"):
        load_policy(path)


def test_missing_directory_and_config_name_the_path(tmp_path, saved_policy):
    with pytest.raises(ModelLoadError, match="nowhere"):
        load_policy(tmp_path / "nowhere")
    path = _copy_dir(saved_policy[1], tmp_path / "p")
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=rf"no config\.json in {path}"):
        load_policy(path)


def test_save_model_is_atomic_and_refuses_to_clobber(tmp_path, tokenizer, saved_policy):
    model = saved_policy[0]
    target = save_model(model, tokenizer, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directories left behind
    assert (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file()
    with pytest.raises(FileExistsError):
        save_model(model, tokenizer, target)
    other = build_policy(tokenizer, seed=9)
    save_model(other, tokenizer, target, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert torch.equal(load_file(target / "model.safetensors")["lm_head.weight"], other.lm_head.weight)


def test_broadcast_state_dict_is_a_contiguous_cpu_snapshot(saved_policy):
    model = saved_policy[0]
    sent = state_dict_for_broadcast(model)
    assert sent.keys() == model.state_dict().keys()  # untied demo model: nothing dropped
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in sent.values())
    before = sent["model.norm.weight"].clone()
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    try:
        assert torch.equal(sent["model.norm.weight"], before)
    finally:
        with torch.no_grad():
            model.model.norm.weight.sub_(1.0)


def test_load_state_dict_strict_round_trip_and_mismatches(tokenizer):
    source, target = build_policy(tokenizer, seed=4), build_policy(tokenizer, seed=5)
    sent = state_dict_for_broadcast(source)
    load_state_dict_strict(target, sent)
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))

    missing = {k: v for k, v in sent.items() if k != "model.norm.weight"}
    with pytest.raises(ModelLoadError, match=r"missing: model\.norm\.weight"):
        load_state_dict_strict(target, missing)
    with pytest.raises(ModelLoadError, match=r"unexpected: bogus"):
        load_state_dict_strict(target, {**sent, "bogus": torch.zeros(1)})
    with pytest.raises(ModelLoadError, match=r"shape mismatch: lm_head\.weight"):
        load_state_dict_strict(target, {**sent, "lm_head.weight": torch.zeros(2, 2)})
