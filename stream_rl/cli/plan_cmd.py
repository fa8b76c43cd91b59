"""``stream-rl plan``: estimate per-GPU memory of every role, recommend colocated or separate placement, and print
the ``stream-rl train`` line for the trainer's data-parallel ranks, and the ``stream-rl run`` GPU layout
(``run.gpus``, role counts, vLLM's ``gpu_memory_utilization``; :mod:`stream_rl.planner.layout`).

The model comes from a Hugging Face ``config.json`` (``--config-json``) or a parameter count (``--params 7e9``;
activations, logits and KV cache then stay out of the totals). ``--trainer-ranks N`` fixes the trainer's ranks
(its ZeRO shards are then over N; colocation needs N equal to ``--gpus``); without it the trainer takes every GPU
colocated and the fewest that fit separate. ``--servers N`` plans generation on N inference servers, one GPU each
(``[run.servers]``, ``producer.engine = "server"``). Invalid options exit 2 with one line naming the option; ``--dry-run``
prints the validated planner inputs (it takes no stream-rl config) and exits 0. The planner
is pure Python: no torch import, no GPU needed. Formulas: ``docs/planner.md``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from stream_rl.cli.common import fail

# PlanInputs fields whose option name is not "--" + field.replace("_", "-").
_OPTION_OF_FIELD = {"model": "--config-json", "master_weights": "--master-weights"}


def _option_error(exc: ValidationError) -> str:
    """The first validation error as one line, led by the option it concerns."""
    err = exc.errors()[0]
    message = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:
        return message
    field = str(err["loc"][0])
    return f"{_OPTION_OF_FIELD.get(field, '--' + field.replace('_', '-'))}: {message}"


def _load_shape(path: Path):
    from stream_rl.planner import shape_from_hf_config

    try:
        return shape_from_hf_config(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        fail(f"--config-json: {path}: {exc}", 2)


def _model_shape(config_json: Path | None, params: float | None, reward_model_params: float):
    """The model's shape from ``--config-json`` (None with ``--params``), after checking that exactly one of the two
    is given and that the parameter counts are finite; exits 2 naming the option otherwise."""
    if (config_json is None) == (params is None):
        fail("give exactly one of --config-json and --params", 2)
    for option, value in (("--params", params), ("--reward-model-params", reward_model_params)):
        if value is not None and not math.isfinite(value):
            fail(f"{option}: must be a finite number, got {value}", 2)
    return _load_shape(config_json) if config_json is not None else None


def _plan_inputs(**fields):
    """The validated ``PlanInputs``; an invalid value exits 2 with one line naming its option."""
    from stream_rl.planner import PlanInputs

    try:
        return PlanInputs(**fields)
    except ValidationError as exc:
        fail(_option_error(exc), 2)


def _print_plan(inputs, as_json: bool) -> None:
    """The plan as a table, or with ``as_json`` as JSON with the proposed ``stream-rl run`` layout."""
    from stream_rl.planner import make_plan, render_table
    from stream_rl.planner.layout import propose_layout

    result = make_plan(inputs)
    typer.echo(json.dumps({**result.to_dict(), "layout": propose_layout(result)}, indent=2) if as_json
               else render_table(result))


def plan(
    config_json: Annotated[Path | None, typer.Option("--config-json", help="the model's Hugging Face config.json "
                                                     "(Llama, Mistral, Qwen2/3, GPT-2)")] = None,
    params: Annotated[float | None, typer.Option(help="parameter count instead of a config, e.g. 7e9")] = None,
    dtype: Annotated[str, typer.Option(help="training and inference dtype: fp32, bf16, fp16")] = "bf16",
    optimizer: Annotated[str, typer.Option(help="adamw or sgd (with momentum)")] = "adamw",
    master_weights: Annotated[bool | None, typer.Option(
        "--master-weights/--no-master-weights", help="fp32 parameters, gradients and optimizer state with 16-bit "
        "autocast compute, as the trainer does (default: on for 16-bit dtypes); off: pure 16-bit")] = None,
    zero_stage: Annotated[int, typer.Option(help="ZeRO stage 0-3 (0: plain data parallel, trainer.engine=torch; "
                                                 "1-3: trainer.engine=deepspeed)")] = 0,
    gpus: Annotated[int, typer.Option(help="GPUs available")] = 1,
    trainer_ranks: Annotated[int | None, typer.Option(
        help="data-parallel trainer ranks, one GPU each (stream-rl train --nproc); default: every GPU colocated, "
             "the fewest that fit separate")] = None,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per machine: more trainer ranks than this launch on "
                                                    "several machines (--nnodes)")] = 8,
    gpu_memory_gib: Annotated[float, typer.Option(help="memory of one GPU in GiB")] = 80.0,
    micro_batch: Annotated[int, typer.Option(help="trainer sequences per forward/backward per GPU")] = 1,
    micro_batch_tokens: Annotated[int | None, typer.Option(
        help="trainer.max_tokens_per_micro_batch: micro batches filled by token count (default: by "
             "sequences)")] = None,
    seq_len: Annotated[int | None, typer.Option(help="trainer sequence length (default: prompt + new)")] = None,
    gen_batch: Annotated[int, typer.Option(help="sequences one generator holds at once")] = 64,
    prompt_len: Annotated[int, typer.Option(help="prompt tokens")] = 512,
    max_new_tokens: Annotated[int, typer.Option(help="response token budget")] = 1024,
    grad_checkpointing: Annotated[bool, typer.Option(help="full activation recomputation")] = True,
    flash_attention: Annotated[bool, typer.Option(help="fused attention (no s^2 scores kept)")] = True,
    reference: Annotated[bool, typer.Option(help="a frozen reference model for the KL term")] = True,
    reward_model_params: Annotated[float, typer.Option(help="parameters of a reward model (0: rule-based)")] = 0,
    servers: Annotated[int, typer.Option(help="generate on N inference servers (producer.engine = server), one "
                                              "GPU each beside the trainer's and the scorer's; 0: in-process")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the resolved planner inputs as JSON and "
                                          "exit")] = False,
) -> None:
    """Estimate per-GPU memory (weights, gradients, optimizer, activations, KV cache, reference/reward models) with
    20% headroom, recommend colocated or separate placement of trainer, generator and scorer, and print the
    trainer's launch line."""
    shape = _model_shape(config_json, params, reward_model_params)
    inputs = _plan_inputs(
        model=shape, params=None if params is None else round(params), dtype=dtype, optimizer=optimizer,
        master_weights=master_weights, zero_stage=zero_stage, gpus=gpus, trainer_ranks=trainer_ranks,
        gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib,
        micro_batch=micro_batch, micro_batch_tokens=micro_batch_tokens, seq_len=seq_len, gen_batch=gen_batch,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens, grad_checkpointing=grad_checkpointing, flash_attention=flash_attention,
        reference=reference, reward_model_params=round(reward_model_params), servers=servers)
    if dry_run:
        typer.echo(inputs.model_dump_json(indent=2))
        raise typer.Exit(0)
    _print_plan(inputs, as_json)
