"""The memory planner: parameter counts, memory formulas, placement, and the `stream-rl plan` command.

Hand computations are written out next to each assertion; one case is measured on CPU (a tiny Llama's weights,
gradients, AdamW states and KV cache) and compared with the planner's formulas.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from stream_rl.cli.main import app
from stream_rl.planner import ModelShape, PlanInputs, count_params, make_plan, render_table, shape_from_hf_config
from stream_rl.planner import memory as mem
from stream_rl.planner.plan import trainer_memory

GIB = 2**30
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "tie_word_embeddings": False}


def _components(role) -> dict[str, int]:
    return dict(role.components)


# ---------------------------------------------------------------- parameter counts


def test_llama3_8b_parameter_count_by_hand():
    # embeddings 128256 * 4096 = 525,336,576 (and as much again for the untied lm head)
    # per layer: q, o 2 * 4096 * 4096 = 33,554,432; k, v 2 * 4096 * (8 * 128) = 8,388,608;
    #            MLP 3 * 4096 * 14336 = 176,160,768; norms 2 * 4096 = 8,192        -> 218,112,000
    # 32 layers 6,979,584,000 + 2 * 525,336,576 + final norm 4,096 = 8,030,261,248
    n = count_params(shape_from_hf_config(LLAMA3_8B))
    assert n == 8_030_261_248
    assert abs(n - 8.03e9) / 8.03e9 < 1e-3


def test_tiny_llama_parameter_count_by_hand():
    shape = ModelShape(vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=12)
    # per layer: q 8*8 = 64, k 8*4 = 32, v 32, o 64 -> 192; MLP 3*8*12 = 288; norms 2*8 = 16 -> 496
    # 2 layers 992 + embeddings 10*8 = 80 + lm head 80 + final norm 8 = 1160; tied: 1160 - 80 = 1080
    assert count_params(shape) == 1160
    assert count_params(ModelShape(**{**shape.__dict__, "tie_embeddings": True})) == 1080


TINY_CONFIGS = {
    "llama-gqa": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 37},
    "llama-tied-bias": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 1, "intermediate_size": 96, "vocab_size": 37,
                        "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    "mistral": {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 80, "vocab_size": 41},
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 50, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 24, "intermediate_size": 96, "vocab_size": 50},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32, "vocab_size": 45},
}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_parameter_count_equals_transformers(name, tmp_path):
    # the config.json that save_pretrained writes (defaults omitted) is what the planner reads
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_CONFIGS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    shape = shape_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert count_params(shape) == sum(p.numel() for p in model.parameters())


def test_unsupported_configs_are_rejected():
    with pytest.raises(ValueError, match="unsupported model_type 'mixtral'"):
        shape_from_hf_config({**LLAMA3_8B, "model_type": "mixtral"})
    with pytest.raises(ValueError, match="no 'intermediate_size'"):
        shape_from_hf_config({k: v for k, v in LLAMA3_8B.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        shape_from_hf_config({**LLAMA3_8B, "num_key_value_heads": 5})


# ---------------------------------------------------------------- memory formulas


def test_bytes_per_parameter_for_weights_gradients_and_optimizer():
    p = 1000
    # mixed-precision AdamW (ZeRO paper, K = 12): 2P weights + 2P gradients + (4P + 4P moments + 4P master) = 16P
    assert mem.weights_bytes(p, "bf16") + mem.gradients_bytes(p, "bf16") == 4000
    assert mem.optimizer_bytes(p, "adamw", master_weights=True) == 12_000
    # pure bf16 AdamW (no master copy): 8P; SGD with momentum + master: 4P + 4P
    assert mem.optimizer_bytes(p, "adamw", master_weights=False) == 8000
    assert mem.optimizer_bytes(p, "sgd", master_weights=True) == 8000
    assert mem.weights_bytes(p, "float32") == 4000
    with pytest.raises(ValueError, match="unknown dtype"):
        mem.dtype_bytes("int4")


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_zero_partitioning_invariants(gpus):
    params = 8 * 10**6  # divisible by every N used, so shares are exact
    full = {"weights": 2 * params, "gradients": 2 * params, "optimizer": 12 * params}  # bf16 + AdamW + master
    for stage, sharded in ((0, set()), (1, {"optimizer"}), (2, {"optimizer", "gradients"}),
                           (3, {"optimizer", "gradients", "weights"})):
        inputs = PlanInputs(params=params, zero_stage=stage, gpus=gpus)
        per_gpu = _components(trainer_memory(inputs, params, gpus))
        for kind, total in full.items():
            assert per_gpu[kind] == (total // gpus if kind in sharded else total), (stage, kind)
    # stage 3: params + grads + optimizer per GPU = 16P / N; stage 0: 16P whatever N
    stage3 = _components(trainer_memory(PlanInputs(params=params, zero_stage=3, gpus=gpus), params, gpus))
    assert sum(stage3.values()) == 16 * params // gpus
    stage0 = _components(trainer_memory(PlanInputs(params=params, zero_stage=0, gpus=gpus), params, gpus))
    assert sum(stage0.values()) == 16 * params


def test_zero_shards_round_up_and_cover_the_total():
    assert mem.zero_shard_bytes(10, "weights", 3, 4) == 3  # ceil(10 / 4): 4 GPUs hold 12 >= 10
    assert mem.zero_shard_bytes(10, "weights", 2, 4) == 10  # weights are sharded only from stage 3


def test_activations_reduce_to_korthikanti_for_gpt_layers():
    # GPT layer: q_dim = kv_dim = h, f = 4h, plain MLP, dropout, 16-bit -> s*b*h*(34 + 5*a*s/h)
    s, b, h, a = 2048, 4, 1024, 16
    unfused = mem.activation_bytes_per_layer(s, b, h, h, h, a, 4 * h, gated=False, flash_attention=False,
                                             dropout=True)
    assert unfused == mem.korthikanti_layer_bytes(s, b, h, a)
    fused = mem.activation_bytes_per_layer(s, b, h, h, h, a, 4 * h, gated=False, flash_attention=True, dropout=True)
    assert fused == 34 * s * b * h


def test_activations_by_hand():
    s, b, h, a, f = 4, 2, 8, 2, 32  # s*b*h = 64
    # norms 2 * 2*64 = 256; attention 2*s*b*(h + 2h + 2h) = 2*8*40 = 640 + scores a*s^2*b*2 = 2*16*2*2 = 128;
    # plain MLP 2*s*b*(h + 2f) = 16*72 = 1152 -> 256 + 768 + 1152 = 2176
    no_dropout = mem.activation_bytes_per_layer(s, b, h, h, h, a, f, gated=False, flash_attention=False)
    assert no_dropout == 2176
    # with dropout: + masks s*b*h (attention) + s*b*h (MLP) + a*s^2*b*(1 + 2) (score mask and copy) = +320;
    # Korthikanti: 64 * (34 + 5*2*4/8) = 64 * 39 = 2496 = 2176 + 320 (f = 4h here)
    assert mem.activation_bytes_per_layer(s, b, h, h, h, a, f, gated=False, flash_attention=False,
                                          dropout=True) == 2496
    # Llama-3-8B layer (GQA kv = h/4, SwiGLU f = 3.5h, flash, no dropout): 4 + 2*(1 + 2 + 0.5) + 2*(1 + 14) = 41 sbh
    s, b, h = 1024, 1, 4096
    llama = mem.activation_bytes_per_layer(s, b, h, h, h // 4, 32, 14336, gated=True, flash_attention=True)
    assert llama == 41 * s * b * h
    # full checkpointing over 32 layers: 32 * 2*s*b*h (layer inputs) + one layer's 41*s*b*h
    assert mem.activations_bytes(32, llama, 2 * s * b * h, checkpointing=True) == (64 + 41) * s * b * h
    assert mem.activations_bytes(32, llama, 2 * s * b * h, checkpointing=False) == 32 * 41 * s * b * h


def test_kv_cache_and_logits_by_hand():
    # Llama-3-8B, bf16: 2 (K, V) * 32 layers * 8 KV heads * 128 dims * 2 bytes = 131,072 B = 128 KiB per token;
    # 64 sequences * (512 + 1024) tokens = 98,304 tokens -> 12 GiB exactly
    assert mem.kv_cache_bytes(32, 8, 128, 2, 1) == 128 * 1024
    assert mem.kv_cache_bytes(32, 8, 128, 2, 64 * 1536) == 12 * GIB
    # logits: b * s * V * 4 = 2 * 10 * 7 * 4
    assert mem.logits_bytes(2, 10, 7) == 560


def test_headroom_is_twenty_percent_on_top():
    assert mem.with_headroom(100) == 120
    assert mem.with_headroom(100, 0.0) == 100
    # params only, 1 GPU: trainer 16P + generator 2P + reference 2P = 20P; with headroom 24P.
    # P = 2**30 -> 24 GiB needed: fits a 24 GiB GPU exactly, not a 23.99 GiB one
    params = 2**30
    plan = make_plan(PlanInputs(params=params, gpu_memory_gib=24.0))
    assert plan.colocated.per_gpu == 20 * params and plan.colocated.needed_per_gpu == 24 * params
    assert plan.recommendation == "colocated"
    assert not make_plan(PlanInputs(params=params, gpu_memory_gib=23.99)).colocated.fits


def test_recommendation_flips_from_colocated_to_separate_as_gpu_memory_shrinks():
    params = 2**30  # 1 GiB per byte-per-parameter
    # ZeRO 3 on 8 GPUs, colocated: trainer 16P/8 = 2 GiB + generator 2 GiB + reference 2 GiB = 6 GiB, 7.2 with headroom
    roomy = make_plan(PlanInputs(params=params, zero_stage=3, gpus=8, gpu_memory_gib=80))
    assert roomy.recommendation == "colocated" and roomy.colocated.per_gpu == 6 * GIB
    # at 6 GiB: colocated 7.2 > 6; separate: trainer needs 16 GiB * 1.2 / n <= 6 -> n = 4 (3.2 rounded up),
    # generator 2.4 GiB -> 1 GPU, scorer (reference) 2.4 GiB -> 1 GPU: 6 of 8 GPUs
    tight = make_plan(PlanInputs(params=params, zero_stage=3, gpus=8, gpu_memory_gib=6))
    assert tight.recommendation == "separate"
    assert [(r.role, r.gpus) for r in tight.separate.roles] == [("trainer", 4), ("generator", 1), ("scorer", 1)]
    assert "2 spare" in tight.message
    # only 4 GPUs: separate would need 6
    short = make_plan(PlanInputs(params=params, zero_stage=3, gpus=4, gpu_memory_gib=6))
    assert short.recommendation == "does-not-fit" and "need 6 GPU(s)" in short.message
    # ZeRO 0 never gains from more GPUs: a trainer above one GPU fits nowhere
    assert make_plan(PlanInputs(params=params, gpus=8, gpu_memory_gib=16)).separate.roles[0].gpus is None


def test_plan_from_config_has_every_component_and_renders():
    plan = make_plan(PlanInputs(model=shape_from_hf_config(LLAMA3_8B), zero_stage=3, gpus=8, gpu_memory_gib=40))
    trainer, generator, scorer = plan.colocated.roles
    assert set(_components(trainer)) == {"weights", "gradients", "optimizer", "activations", "logits"}
    assert _components(generator)["kv_cache"] == 12 * GIB  # default 64 x (512 + 1024) tokens, as by hand above
    assert _components(scorer) == {"reference": 2 * plan.params, "reward_model": 0}
    assert plan.recommendation == "separate"
    text = render_table(plan)
    assert "8.030 B parameters" in text and "recommendation: separate" in text
    notes = make_plan(PlanInputs(params=10**9)).notes
    assert any("lower bounds" in n for n in notes)


# ---------------------------------------------------------------- measured on CPU


def test_measured_tiny_llama_matches_the_planner(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, intermediate_size=256, vocab_size=15)
    config.save_pretrained(tmp_path)
    model = LlamaForCausalLM(config).float()
    shape = shape_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    params = sum(p.numel() for p in model.parameters())
    assert count_params(shape) == params

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 15, (3, 7))  # (B, T)
    out = model(input_ids=ids, labels=ids, use_cache=True)
    out.loss.backward()
    optimizer.step()

    planned = _components(trainer_memory(PlanInputs(model=shape, dtype="fp32"), params, 1))
    weights = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters())
    moments = sum(t.nbytes for st in optimizer.state.values() for k, t in st.items() if k != "step")
    steps = sum(t.nbytes for st in optimizer.state.values() for k, t in st.items() if k == "step")
    assert weights == planned["weights"] and grads == planned["gradients"]
    assert moments == planned["optimizer"]  # exp_avg + exp_avg_sq: 8P, exact
    # torch also keeps one fp32 scalar `step` per parameter tensor (4 bytes each), which the planner leaves out:
    # the stated tolerance is 4 bytes x number of parameter tensors (< 0.01 % here)
    n_tensors = len(list(model.parameters()))
    assert steps == 4 * n_tensors
    measured = weights + moments + steps
    estimate = planned["weights"] + planned["optimizer"]
    assert measured - estimate == 4 * n_tensors and (measured - estimate) / estimate < 1e-4

    # KV cache: 2 * 4 layers * 2 KV heads * 32 dims * 4 bytes * (3 * 7 tokens) = 43,008 bytes
    cache = out.past_key_values
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert kv == mem.kv_cache_bytes(4, 2, 32, 4, 3 * 7) == 43_008


# ---------------------------------------------------------------- CLI


def test_cli_json_and_table(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "--config-json", str(path), "--gpus", "8", "--zero-stage", "3",
                                 "--gpu-memory-gib", "40", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["params"] == 8_030_261_248 and data["recommendation"] == "separate"
    assert data["colocated"]["roles"][1]["components"]["kv_cache"] == 12 * GIB
    table = runner.invoke(app, ["plan", "--params", "7e9", "--no-reference", "--reward-model-params", "1e9"])
    assert table.exit_code == 0, table.output
    assert "7.000 B parameters" in table.stdout and "recommendation:" in table.stdout


@pytest.mark.parametrize(("args", "named"), [
    (["--params", "7e9", "--zero-stage", "4"], "--zero-stage"),
    (["--params", "7e9", "--gpus", "0"], "--gpus"),
    (["--params", "7e9", "--dtype", "int4"], "--dtype"),
    (["--params", "7e9", "--optimizer", "lion"], "--optimizer"),
    (["--params", "0"], "--params"),
    (["--params", "7e9", "--config-json", "x.json"], "--config-json"),
    (["--config-json", "/nonexistent/config.json"], "--config-json"),
])
def test_cli_bad_option_exits_2_naming_it(args, named):
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert named in result.stderr and len(result.stderr.strip().splitlines()) == 1
