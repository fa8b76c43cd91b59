"""The memory planner: parameter counts, memory formulas, placement, trainer ranks, and the `stream-rl plan` command.

Hand computations are written out next to each assertion. Measured on CPU and compared with the planner's
formulas: a tiny Llama's weights, gradients, AdamW states and KV cache (fp32), the 16-bit weight copies autocast
keeps for backward (bf16 mixed precision, as the trainer runs it) and, where deepspeed is installed, the fp32
master copy ZeRO 1-3 keeps of an fp32 module.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from stream_rl.cli.main import app
from stream_rl.planner import ModelShape, PlanInputs, count_params, make_plan, render_table, shape_from_hf_config
from stream_rl.planner import memory as mem
from stream_rl.planner.plan import trainer_launch, trainer_memory

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
    # the trainer's bf16 mixed precision: fp32 parameters (the master weights) and fp32 gradients, 4P each, not the
    # ZeRO paper's 16-bit 2P + 2P; autocast's bf16 weight copies 2P; AdamW's two fp32 moments 8P
    assert mem.trained_param_dtype("bf16", master_weights=True) == "fp32"
    param_dtype = mem.trained_param_dtype("bf16", master_weights=True)
    assert mem.weights_bytes(p, param_dtype) == mem.gradients_bytes(p, param_dtype) == 4000
    assert mem.autocast_copy_bytes(p, "bf16", master_weights=True) == 2000
    assert mem.optimizer_bytes(p, "adamw") == 8000
    # pure bf16 (no master weights): 2P parameters, 2P gradients, no autocast copy; fp32: no autocast copy either
    assert mem.trained_param_dtype("bf16", master_weights=False) == "bf16"
    assert mem.gradients_bytes(p, "bf16") == 2000
    assert mem.autocast_copy_bytes(p, "bf16", master_weights=False) == 0
    assert mem.autocast_copy_bytes(p, "fp32", master_weights=False) == 0
    # SGD with momentum: one fp32 state, 4P
    assert mem.optimizer_bytes(p, "sgd") == 4000
    # DeepSpeed's fp32 copy of the parameters its ZeRO optimizer steps: 4P from stage 1, none at stage 0 (torch)
    assert [mem.zero_master_copy_bytes(p, stage) for stage in range(4)] == [0, 4000, 4000, 4000]
    # the torch engine's flat all-reduce buffer: one copy of the gradients at stage 0 over more than one rank
    assert mem.flat_allreduce_bytes(4000, 0, 2) == 4000
    assert mem.flat_allreduce_bytes(4000, 0, 1) == mem.flat_allreduce_bytes(4000, 2, 4) == 0
    assert mem.weights_bytes(p, "float32") == 4000
    with pytest.raises(ValueError, match="unknown dtype"):
        mem.dtype_bytes("int4")


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_zero_partitioning_invariants(gpus):
    params = 8 * 10**6  # divisible by every N used, so shares are exact
    # bf16 mixed precision + AdamW as the trainer keeps it
    full = {"weights": 4 * params, "gradients": 4 * params, "optimizer": 8 * params, "master_copy": 4 * params}
    sharded_from = {0: set(), 1: {"optimizer", "master_copy"}}
    sharded_from[2] = sharded_from[1] | {"gradients"}
    sharded_from[3] = sharded_from[2] | {"weights"}
    for stage, sharded in sharded_from.items():
        inputs = PlanInputs(params=params, zero_stage=stage, gpus=gpus)
        per_gpu = _components(trainer_memory(inputs, params, gpus))
        for kind, total in full.items():
            if kind == "master_copy" and stage == 0:
                total = 0  # the torch engine steps the fp32 parameters themselves
            assert per_gpu[kind] == (total // gpus if kind in sharded else total), (stage, kind)
        assert per_gpu["autocast_copy"] == 2 * params  # never sharded: each copy is of the full (gathered) weight
    # stage 3: (4P weights + 4P gradients + 8P moments + 4P master copy) / N + 2P autocast copies = 20P / N + 2P
    stage3 = _components(trainer_memory(PlanInputs(params=params, zero_stage=3, gpus=gpus), params, gpus))
    assert sum(stage3.values()) == 20 * params // gpus + 2 * params
    # stage 0: 4P + 2P + 4P + 8P = 18P on one rank; above one, the step's flat gradient copy (4P) outweighs the 2P
    # of autocast copies backward freed, so the peak is the step's 4P + 4P + 8P + 4P = 20P (the row adds 4P - 2P)
    stage0 = _components(trainer_memory(PlanInputs(params=params, zero_stage=0, gpus=gpus), params, gpus))
    assert stage0["allreduce"] == (0 if gpus == 1 else 2 * params)
    assert sum(stage0.values()) == (18 if gpus == 1 else 20) * params


def test_the_stage_0_step_buffer_counts_only_what_backward_did_not_free():
    # Llama-3-8B, ZeRO 0 over 2 ranks, bf16: the step's flat buffer is 4P = 32,121,044,992 B; by then backward
    # has freed the autocast copies 2P = 16,060,522,496 B, the checkpointed activations (32 layer inputs of
    # 2*s*h B + one layer's 41*s*h B = 105 * 1536 * 4096 = 660,602,880 B; s = 1536, h = 4096, b = 1) and the
    # logits 1536 * 128,256 * 4 = 788,004,864 B, so the step adds
    # 32,121,044,992 - 16,060,522,496 - 660,602,880 - 788,004,864 = 14,611,914,752 B on top of the backward peak
    shape = shape_from_hf_config(LLAMA3_8B)
    p = count_params(shape)
    parts = _components(trainer_memory(PlanInputs(model=shape, zero_stage=0, gpus=2), p, 2))
    assert parts["activations"] == 660_602_880 and parts["logits"] == 788_004_864
    assert parts["allreduce"] == 4 * p - 2 * p - 660_602_880 - 788_004_864 == 14_611_914_752
    # fp32: no autocast copies; activations at e = 4 are twice as large (1,321,205,760 B), logits the same
    parts = _components(trainer_memory(PlanInputs(model=shape, dtype="fp32", zero_stage=0, gpus=2), p, 2))
    assert parts["allreduce"] == 4 * p - 2 * 660_602_880 - 788_004_864


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
    # params only, 1 GPU, ZeRO 0: trainer 4P weights + 2P autocast copies + 4P gradients + 8P moments = 18P,
    # generator 2P, reference 2P: 22P; with headroom 26.4P. P = 5 * 2**28 -> 22P = 27.5 GiB, 33 GiB needed:
    # fits a 33 GiB GPU exactly, not a 32.99 GiB one
    params = 5 * 2**28
    plan = make_plan(PlanInputs(params=params, gpu_memory_gib=33.0))
    assert plan.colocated.per_gpu == 22 * params and plan.colocated.needed_per_gpu == 33 * GIB
    assert plan.recommendation == "colocated"
    assert not make_plan(PlanInputs(params=params, gpu_memory_gib=32.99)).colocated.fits


def test_recommendation_flips_from_colocated_to_separate_as_gpu_memory_shrinks():
    params = 2**30  # 1 GiB per byte-per-parameter
    # ZeRO 3 on 8 GPUs, colocated: trainer 20P/8 = 2.5 GiB + autocast copies 2 GiB, generator 2 GiB,
    # reference 2 GiB: 8.5 GiB, 10.2 with headroom
    roomy = make_plan(PlanInputs(params=params, zero_stage=3, gpus=8, gpu_memory_gib=80))
    assert roomy.recommendation == "colocated" and roomy.colocated.per_gpu == 8.5 * GIB
    # at 8 GiB: colocated 10.2 > 8; separate: the trainer needs (20/n + 2) * 1.2 <= 8 GiB -> 20/n <= 4.67 -> n = 5
    # (n = 4: 7 * 1.2 = 8.4 > 8; n = 5: 6 * 1.2 = 7.2), generator 2.4 GiB -> 1 GPU, scorer 2.4 GiB -> 1: 7 of 8
    tight = make_plan(PlanInputs(params=params, zero_stage=3, gpus=8, gpu_memory_gib=8))
    assert tight.recommendation == "separate"
    assert [(r.role, r.gpus) for r in tight.separate.roles] == [("trainer", 5), ("generator", 1), ("scorer", 1)]
    # shares round up: ceil(4P/5) = 4P/5 + 0.8 (weights, gradients, master copy), ceil(8P/5) = 8P/5 + 0.6 -> + 3 B
    assert tight.separate.per_gpu == 6 * GIB + 3
    assert "1 spare" in tight.message
    # only 6 GPUs: separate would need 7
    short = make_plan(PlanInputs(params=params, zero_stage=3, gpus=6, gpu_memory_gib=8))
    assert short.recommendation == "does-not-fit" and "need 7 GPU(s)" in short.message
    # ZeRO 0 never gains from more GPUs: 18 GiB on one (21.6 with headroom) fits nowhere at 16 GiB
    assert make_plan(PlanInputs(params=params, gpus=8, gpu_memory_gib=16)).separate.roles[0].gpus is None


def test_plan_from_config_has_every_component_and_renders():
    # Llama-3-8B, ZeRO 3, 8 x 80 GiB. Colocated: trainer 20P/8 + 2P + activations 0.62 + logits 0.73 = 35.00 GiB,
    # generator 26.96, reference 14.96: 76.92 GiB, 92.3 with headroom > 80. Separate: 20P = 149.60 GiB, so the
    # trainer needs (149.60 / n + 14.96 + 1.35) * 1.2 <= 80 -> n = 3 (79.4 GiB; n = 2: 109.3); 3 + 1 + 1 of 8
    plan = make_plan(PlanInputs(model=shape_from_hf_config(LLAMA3_8B), zero_stage=3, gpus=8, gpu_memory_gib=80))
    trainer, generator, scorer = plan.colocated.roles
    assert set(_components(trainer)) == {"weights", "autocast_copy", "gradients", "optimizer", "master_copy",
                                         "allreduce", "activations", "logits"}
    assert _components(generator)["kv_cache"] == 12 * GIB  # default 64 x (512 + 1024) tokens, as by hand above
    assert _components(scorer) == {"reference": 2 * plan.params, "reward_model": 0}
    assert not plan.colocated.fits and plan.recommendation == "separate"
    assert [r.gpus for r in plan.separate.roles] == [3, 1, 1]
    assert plan.trainer_launch.command == ("stream-rl train --nproc 3 --set trainer.engine=deepspeed "
                                           "--set trainer.zero_stage=3 --set trainer.dtype=bfloat16")
    text = render_table(plan)
    assert "8.03 B parameters" in text and "recommendation: separate" in text
    assert "ranks (GPUs)" in text and "trainer: 3 data-parallel rank(s)" in text
    assert "launch, on one machine: stream-rl train --nproc 3 " in text
    assert any("trainer.gradient_checkpointing=true" in n for n in plan.notes)  # the setting the plan assumes
    notes = make_plan(PlanInputs(params=10**9)).notes
    assert any("lower bounds" in n for n in notes)


# ---------------------------------------------------------------- trainer ranks


def test_zero2_over_4_ranks_of_a_7b_model_by_hand():
    p = 7 * 10**9  # bf16 mixed precision, AdamW, ZeRO 2, --trainer-ranks 4 of 8 GPUs
    inputs = PlanInputs(params=p, zero_stage=2, gpus=8, trainer_ranks=4, gpu_memory_gib=80)
    # weights: fp32 4P = 28,000,000,000 B, replicated (ZeRO shards weights only at stage 3)
    # autocast copies: bf16 2P = 14,000,000,000 B, replicated
    # gradients: fp32 4P / 4 = 7,000,000,000 B (sharded from stage 2)
    # AdamW moments: 8P / 4 = 14,000,000,000 B; DeepSpeed's fp32 master copy: 4P / 4 = 7,000,000,000 B
    # total 70,000,000,000 B = 65.19 GiB; with 20 % headroom 84,000,000,000 B = 78.23 GiB <= 80 GiB
    # (the ZeRO paper's layout, 2P + 2P/4 + 12P/4 = 38,500,000,000 B, would understate it by 31.5 GB)
    want = {"weights": 28 * 10**9, "autocast_copy": 14 * 10**9, "gradients": 7 * 10**9, "optimizer": 14 * 10**9,
            "master_copy": 7 * 10**9, "allreduce": 0}
    plan = make_plan(inputs)
    trainer = plan.separate.roles[0]
    assert trainer.gpus == 4 and _components(trainer) == want and trainer.total == 70 * 10**9
    assert round(trainer.total / GIB, 2) == 65.19
    assert mem.with_headroom(trainer.total) == 84 * 10**9
    # separate: trainer 4 + generator (2P = 14 GB: 1 GPU) + scorer (reference 2P: 1 GPU) = 6 of 8
    assert plan.recommendation == "separate" and plan.separate.gpus == 6 and plan.separate.fits
    assert plan.trainer_launch.command == ("stream-rl train --nproc 4 --set trainer.engine=deepspeed "
                                           "--set trainer.zero_stage=2 --set trainer.dtype=bfloat16")
    # colocation would need a trainer rank on all 8 GPUs: not applicable, and the reason names --trainer-ranks
    assert plan.colocated.reason is not None and "--trainer-ranks 4" in plan.colocated.reason
    assert not plan.colocated.fits and plan.colocated.roles == ()
    data = plan.to_dict()
    assert data["separate"]["trainer_ranks"] == 4 and data["colocated"]["trainer_ranks"] is None
    assert data["trainer_launch"]["ranks"] == 4 and data["trainer_launch"]["nnodes"] == 1
    assert data["separate"]["roles"][0]["components"] == want
    text = render_table(plan)
    assert "trainer ranks 4" in text and "colocated: not applicable: colocation puts a trainer rank" in text


def test_trainer_ranks_equal_to_gpus_colocates_and_shards_over_them():
    p = 2**30
    # ZeRO 3 over all 8: the same as leaving --trainer-ranks out (8.5 GiB per GPU, as in the flip test)
    fixed = make_plan(PlanInputs(params=p, zero_stage=3, gpus=8, trainer_ranks=8, gpu_memory_gib=80))
    free = make_plan(PlanInputs(params=p, zero_stage=3, gpus=8, gpu_memory_gib=80))
    assert fixed.colocated == free.colocated and fixed.colocated.per_gpu == 8.5 * GIB
    assert fixed.recommendation == "colocated" and fixed.trainer_launch.ranks == 8
    # separate with the ranks fixed at 8 (not the fewest that fit): 20P/8 + 2P = 4.5 GiB
    assert fixed.separate.roles[0].gpus == 8 and fixed.separate.roles[0].total == 4.5 * GIB


def test_fixed_trainer_ranks_that_do_not_fit_are_named():
    # ZeRO 2 over 2 ranks, P = 2**30: 4 + 2 + 4/2 + 8/2 + 4/2 = 14 GiB, 16.8 with headroom > 16 GiB
    plan = make_plan(PlanInputs(params=2**30, zero_stage=2, gpus=8, trainer_ranks=2, gpu_memory_gib=16))
    assert plan.separate.roles[0].total == 14 * GIB and not plan.separate.fits
    assert plan.recommendation == "does-not-fit" and plan.trainer_launch is None
    assert plan.message.startswith("the trainer on --trainer-ranks 2 needs 16.8 GiB per GPU of 16 GiB")


def test_more_trainer_ranks_than_gpus_is_refused():
    with pytest.raises(ValueError, match="--trainer-ranks 5 is more than --gpus 4"):
        PlanInputs(params=10**9, gpus=4, trainer_ranks=5)


@pytest.mark.parametrize(("ranks", "per_node", "nnodes", "nproc"), [
    (4, 8, 1, 4),    # fits one machine
    (8, 8, 1, 8),
    (16, 8, 2, 8),   # two full machines
    (12, 8, 2, 6),   # ceil(12 / 8) = 2 machines, 6 each (torchrun starts as many ranks on every machine)
    (24, 16, 2, 12),
    (11, 8, 11, 1),  # prime: no divisor of 11 between 2 and 10, so 11 machines of 1
])
def test_launch_lines_split_ranks_evenly_over_machines(ranks, per_node, nnodes, nproc):
    inputs = PlanInputs(params=10**9, zero_stage=3, gpus=64, gpus_per_node=per_node)
    launch = trainer_launch(inputs, ranks)
    assert (launch.nnodes, launch.nproc_per_node) == (nnodes, nproc) and nnodes * nproc == ranks
    nodes = f" --nnodes {nnodes} --rdzv-endpoint HOST:PORT" if nnodes > 1 else ""
    assert launch.command == (f"stream-rl train --nproc {nproc}{nodes} --set trainer.engine=deepspeed "
                              f"--set trainer.zero_stage=3 --set trainer.dtype=bfloat16")


def test_launch_line_engine_and_dtype_follow_the_plan():
    # stage 0 is the torch engine (DDP); fp32 is trainer.dtype=float32
    plan = make_plan(PlanInputs(params=10**8, dtype="fp32", zero_stage=0, gpus=2, gpu_memory_gib=80))
    assert plan.recommendation == "colocated"
    assert plan.trainer_launch.command == ("stream-rl train --nproc 2 --set trainer.engine=torch "
                                           "--set trainer.dtype=float32")
    # the trainer has no fp16: the launch line leaves trainer.dtype out and a note says why
    fp16 = make_plan(PlanInputs(params=10**8, dtype="fp16", zero_stage=1, gpus=2, gpu_memory_gib=80))
    assert fp16.trainer_launch.command == ("stream-rl train --nproc 2 --set trainer.engine=deepspeed "
                                           "--set trainer.zero_stage=1")
    assert any("has no trainer.dtype" in n for n in fp16.notes)
    # 16 ranks on machines of 8: the table says where to run it
    big = make_plan(PlanInputs(params=10**9, zero_stage=3, gpus=16, gpu_memory_gib=80))
    assert "launch, on each of 2 machines, 8 ranks each (--gpus-per-node 8): stream-rl train --nproc 8 --nnodes 2 " \
           "--rdzv-endpoint HOST:PORT" in render_table(big)


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


def test_measured_autocast_copies_match_the_planner():
    # bf16 mixed precision as the trainer runs it: an fp32 module under torch.autocast. The bf16 weight copies
    # autograd saves for backward are every Linear weight's: 2 bytes x (P - embeddings - norm weights)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, intermediate_size=256, vocab_size=15)
    model = LlamaForCausalLM(config).float()
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    shapes = {tuple(w.shape) for w in linears} | {tuple(w.shape)[::-1] for w in linears}
    copies: dict[int, int] = {}  # storage address -> bytes

    def pack(t):
        if t.dtype == torch.bfloat16 and t.dim() == 2 and tuple(t.shape) in shapes:  # a weight's copy (or its .T)
            copies[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 15, (3, 7))  # (B, T); 3 * 7 = 21 rows, no weight has 21 rows or columns
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
    # per layer q 128*128 + k, v 2 * 128*64 + o 128*128 = 49,152, MLP 3 * 128*256 = 98,304: 147,456; 4 layers
    # 589,824 + lm head 15*128 = 1,920 -> 591,744 Linear weights in 29 tensors, 1,183,488 bytes in bf16
    assert len(copies) == 29 and sum(copies.values()) == 2 * 591_744 == 1_183_488
    # the planner's 2P: P = 591,744 + embeddings 1,920 + norms 4 * 2 * 128 + 128 = 594,816 -> 1,189,632, an upper
    # bound by exactly 2 * (1,920 + 1,152) = 6,144 bytes (embeddings and norm weights are not cast)
    params = sum(p.numel() for p in model.parameters())
    assert params == 594_816
    planned = _components(trainer_memory(PlanInputs(params=params), params, 1))["autocast_copy"]
    assert planned == 1_189_632 and planned - sum(copies.values()) == 6_144


# ---------------------------------------------------------------- CLI


def test_cli_json_and_table(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "--config-json", str(path), "--gpus", "8", "--zero-stage", "3",
                                 "--gpu-memory-gib", "80", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["params"] == 8_030_261_248 and data["recommendation"] == "separate"
    assert data["colocated"]["roles"][1]["components"]["kv_cache"] == 12 * GIB
    assert data["separate"]["trainer_ranks"] == 3 and data["colocated"]["trainer_ranks"] == 8
    assert data["trainer_launch"]["command"].startswith("stream-rl train --nproc 3 --set trainer.engine=deepspeed")
    fixed = runner.invoke(app, ["plan", "--params", "7e9", "--gpus", "8", "--zero-stage", "2", "--trainer-ranks",
                                "4", "--json"])
    assert fixed.exit_code == 0, fixed.output
    data = json.loads(fixed.stdout)
    assert data["inputs"]["trainer_ranks"] == 4 and data["separate"]["roles"][0]["total_bytes"] == 70 * 10**9
    assert data["colocated"]["reason"].endswith("--trainer-ranks 4 is not --gpus 8")
    table = runner.invoke(app, ["plan", "--params", "7e9", "--no-reference", "--reward-model-params", "1e9"])
    assert table.exit_code == 0, table.output
    assert "7 B parameters" in table.stdout and "recommendation:" in table.stdout
    served = runner.invoke(app, ["plan", "--params", "7e9", "--gpus", "8", "--zero-stage", "3", "--servers", "2"])
    assert served.exit_code == 0, served.output
    assert "[run.servers]\n  count = 2\n" in served.stdout and 'engine = "server"' in served.stdout
    assert "colocated: not applicable: --servers 2: each inference server takes a GPU of its own" in served.stdout


@pytest.mark.parametrize(("args", "named"), [
    (["--params", "7e9", "--zero-stage", "4"], "--zero-stage"),
    (["--params", "7e9", "--gpus", "0"], "--gpus"),
    (["--params", "7e9", "--dtype", "int4"], "--dtype"),
    (["--params", "7e9", "--optimizer", "lion"], "--optimizer"),
    (["--params", "0"], "--params"),
    (["--params", "7e9", "--config-json", "x.json"], "--config-json"),
    (["--config-json", "/nonexistent/config.json"], "--config-json"),
    (["--params", "7e9", "--trainer-ranks", "0"], "--trainer-ranks"),
    (["--params", "7e9", "--gpus-per-node", "0"], "--gpus-per-node"),
    (["--params", "7e9", "--servers", "-1"], "--servers"),
])
def test_cli_bad_option_exits_2_naming_it(args, named):
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert named in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_more_trainer_ranks_than_gpus_exits_2_naming_both():
    result = CliRunner().invoke(app, ["plan", "--params", "7e9", "--gpus", "4", "--trainer-ranks", "5"])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "--trainer-ranks 5" in line and "--gpus 4" in line and len(line.splitlines()) == 1


# ---------------------------------------------------------------- issue 13: readable figures, reasons, real layouts


def test_figures_have_readable_units():
    from stream_rl.planner.units import human_bytes, human_count

    assert [human_count(n) for n in (12, 591_744, 1_234_567, 8_030_261_248, 7e9)] == [
        "12", "592 K", "1.23 M", "8.03 B", "7 B"]
    assert [human_bytes(n) for n in (0, 512, 1_572_864, 13_207_024_435, 80 * GIB, 1_024_000)] == [
        "0 B", "512 B", "1.5 MiB", "12.3 GiB", "80 GiB", "1000 KiB"]


def test_cli_small_model_shows_its_size_and_each_verdict_its_reason():
    # 1.2 M parameters, ZeRO 0 on 2 x 80 GiB: colocated trainer 20P (4 fp32 + 2 autocast + 4 grads + 8 moments
    # + 2 all-reduce buffer) = 24,000,000 B, generator 2P and reference 2P: 28,800,000 B; x 1.2 = 34,560,000 B
    # = 33.0 MiB. Separate needs 3 GPUs (trainer, generator, scorer) of 2.
    result = CliRunner().invoke(app, ["plan", "--params", "1.2e6", "--gpus", "2"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "1.2 M parameters" in out and "0.000 B" not in out and " 0.00 " not in out
    assert "colocated: fits: 33 MiB of 80 GiB per GPU (2 of 2 GPUs)" in out
    assert "separate: does not fit: needs 3 GPUs, has 2" in out
    assert "fits  " not in out and " yes" not in out  # no bare yes/no verdict row any more


def test_cli_does_not_fit_names_need_and_capacity():
    # P = 2**30, ZeRO 2 on --trainer-ranks 2 of 16 GiB GPUs: 14 GiB, 16.8 GiB with headroom (as above)
    result = CliRunner().invoke(app, ["plan", "--params", str(2**30), "--zero-stage", "2", "--gpus", "4",
                                      "--trainer-ranks", "2", "--gpu-memory-gib", "16"])
    assert result.exit_code == 0, result.output
    assert "separate: does not fit: needs 16.8 GiB per GPU, has 16 GiB (headroom included)" in result.stdout
    assert "recommendation: the trainer on --trainer-ranks 2 needs 16.8 GiB per GPU of 16 GiB" in result.stdout


def test_no_tensor_parallel_layouts_are_recommended():
    # P = 2**30 bf16: generator 2 GiB weights (2.4 with headroom) on 2 GiB GPUs fits no single GPU; the trainer
    # has data-parallel ranks only, and the generator and scorer have no tensor parallelism: no split of them
    plan = make_plan(PlanInputs(params=2**30, zero_stage=3, gpus=64, gpu_memory_gib=2))
    generator, scorer = plan.separate.roles[1:]
    assert (generator.gpus, scorer.gpus) == (None, None)
    assert plan.recommendation == "does-not-fit"
    why = plan.to_dict()["separate"]["verdict"]
    assert why.startswith("does not fit: the trainer needs 2.78 GiB per GPU even over 64 data-parallel ranks")
    assert "the generator needs 2.4 GiB on one GPU (no tensor parallelism)" in why and why.endswith("has 2 GiB")
    # a generator that fits one GPU gets exactly one, however many GPUs there are
    big = make_plan(PlanInputs(params=2**30, zero_stage=3, gpus=64, gpu_memory_gib=8))
    assert [r.gpus for r in big.separate.roles][1:] == [1, 1]
    launch = big.trainer_launch
    assert launch is not None and "deepspeed" in launch.command and "tensor" not in launch.command
