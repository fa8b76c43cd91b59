"""`init_demo`: build everything the built-in demo needs into one directory, with no download.

Consumes: a target directory and a seed. Produces, inside `DIR`:

    DIR/policy/            warm-started LlamaForCausalLM + tokenizer (safetensors, `save_pretrained` layout)
    DIR/reference/         the same weights again: the frozen reference starts equal to the policy
    DIR/reward_model/      optional one-label LlamaForSequenceClassification + tokenizer: the policy's body,
                           frozen, with a score head FITTED (closed-form ridge) to the verifier's reward on
                           sampled responses; see `stream_rl.demo.reward_model`
    DIR/prompts.jsonl      every train-split problem, shuffled by the seed: {"prompt_id", "text", "answer"}
    DIR/eval_prompts.jsonl every held-out problem (disjoint from the train split)
    DIR/demo.json          what was built and measured: model shape, SFT steps/seconds/accuracies (sampled at
                           temperature 1 and greedy, on the held-out prompts), reward-model stats, the reward
                           function reference and the generation settings the demo expects

Guarantees: the directory appears complete or not at all (everything is built in a temporary directory next to
it, fsynced and renamed); an existing `DIR` is refused unless `overwrite=True`; the same seed on the same
machine and thread count gives the same files. Every model directory loads with `stream_rl.models` loaders.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path

import torch

from stream_rl.demo.model import HIDDEN_SIZE, NUM_HEADS, NUM_LAYERS, build_policy, count_parameters
from stream_rl.demo.reward_model import train_reward_model
from stream_rl.demo.sft import SFTConfig, supervised_warm_start
from stream_rl.demo.task import REWARD_FUNCTION, make_prompts, problems
from stream_rl.demo.tokenizer import build_tokenizer
from stream_rl.fsutil import fsync_path, fsync_tree
from stream_rl.models.loading import save_model

SCHEMA_VERSION = 1
MAX_NEW_TOKENS = 6
REWARD_MODEL_TRAIN_SAMPLES = 2048


def init_demo(
    directory: str | os.PathLike,
    seed: int = 0,
    *,
    sft: SFTConfig | None = None,
    reward_model: bool = True,
    overwrite: bool = False,
    num_threads: int | None = None,
) -> dict:
    """Build the demo into `directory`; returns the contents of `demo.json`.

    `sft` overrides the warm-start settings (its seed is replaced by `seed`); `num_threads` sets
    `torch.set_num_threads` for the build when given.
    """
    target = Path(directory).resolve()
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to rebuild the demo there")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        info = _build(tmp, seed, replace(sft or SFTConfig(), seed=seed), reward_model)
        fsync_tree(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
        fsync_path(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return info


def _build(root: Path, seed: int, sft: SFTConfig, with_reward_model: bool) -> dict:
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    policy = build_policy(tokenizer, seed=seed)
    train_rows = make_prompts(len(problems("train")), seed, "train")
    eval_rows = make_prompts(len(problems("eval")), seed, "eval")
    result = supervised_warm_start(policy, tokenizer, train_rows, eval_rows, sft)
    save_model(policy, tokenizer, root / "policy")
    save_model(policy, tokenizer, root / "reference")
    _write_jsonl(root / "prompts.jsonl", train_rows)
    _write_jsonl(root / "eval_prompts.jsonl", eval_rows)
    reward_stats = None
    if with_reward_model:
        reward_model, stats = train_reward_model(
            policy, tokenizer, train_rows[:REWARD_MODEL_TRAIN_SAMPLES], eval_rows, seed=seed
        )
        save_model(reward_model, tokenizer, root / "reward_model")
        reward_stats = asdict(stats)
    info = {
        "schema_version": SCHEMA_VERSION,
        "task": "two-digit addition: 'a+b=' -> digits of a+b, then <eos>",
        "seed": seed,
        "policy": "policy",
        "reference": "reference",
        "reward_model": "reward_model" if with_reward_model else None,
        "reward_function": REWARD_FUNCTION,
        "prompts": "prompts.jsonl",
        "eval_prompts": "eval_prompts.jsonl",
        "num_prompts": len(train_rows),
        "num_eval_prompts": len(eval_rows),
        "generation": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
        "model": {
            "architecture": "LlamaForCausalLM",
            "parameters": count_parameters(policy),
            "hidden_size": HIDDEN_SIZE,
            "num_layers": NUM_LAYERS,
            "num_heads": NUM_HEADS,
            "vocab_size": len(tokenizer),
        },
        "sft": _sft_summary(sft, result),
        "reward_model_stats": reward_stats,
        "torch_threads": torch.get_num_threads(),
        "seconds_total": round(time.perf_counter() - started, 2),
    }
    (root / "demo.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _sft_summary(config: SFTConfig, result) -> dict:
    return {
        "config": asdict(config),
        "steps": result.steps,
        "seconds": round(result.seconds, 2),
        "stopped": result.stopped,
        "final_loss": result.losses[-1] if result.losses else None,
        "checks": [{"step": step, "sampled_accuracy": acc} for step, acc in result.evals],
        "sampled_accuracy": result.sampled_accuracy,
        "greedy_accuracy": result.greedy_accuracy,
    }


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
