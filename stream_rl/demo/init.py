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

Progress: unless `progress=False`, one line per phase and the warm-start's steps done/total with an ETA go to
stderr (a bar redrawn in place on a terminal, periodic lines elsewhere; see `stream_rl.demo.progress`).

Guarantees: the directory appears complete or not at all: everything is built in `.DIR.tmp-XXXXXXXX` next to it
(held under an exclusive `flock` while the build runs), fsynced and renamed; an overwrite first renames the old
`DIR` to `.DIR.old-XXXXXXXX`, so no moment shows a half-deleted `DIR` that `stream-rl run` (which checks for
`DIR/policy/`) would take for a built demo. A build killed by Ctrl-C removes its temporary directory; one killed
by SIGTERM or SIGKILL leaves it, and the next `init_demo` for the same `DIR` removes every such leftover whose
lock no live process holds (a build still running elsewhere keeps its own). An existing `DIR` is refused unless
`overwrite=True`; the same seed on the same machine and thread count gives the same files. Every model
directory loads with `stream_rl.models` loaders.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path

import torch

from stream_rl.demo.model import HIDDEN_SIZE, NUM_HEADS, NUM_LAYERS, build_policy, count_parameters
from stream_rl.demo.progress import DemoProgress
from stream_rl.demo.reward_model import train_reward_model
from stream_rl.demo.sft import SFTConfig, supervised_warm_start
from stream_rl.demo.task import REWARD_FUNCTION, make_prompts, problems
from stream_rl.demo.tokenizer import build_tokenizer
from stream_rl.models.loading import save_model
from stream_rl.storage.fsync import fsync_path, fsync_tree

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
    progress: bool = True,
) -> dict:
    """Build the demo into `directory`; returns the contents of `demo.json`.

    `sft` overrides the warm-start settings (its seed is replaced by `seed`); `num_threads` sets
    `torch.set_num_threads` for the build when given; `progress=False` silences the stderr progress.
    """
    target = Path(directory).resolve()
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; rebuild it with --overwrite (overwrite=True) or choose another "
                              "directory")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    target.parent.mkdir(parents=True, exist_ok=True)
    report = DemoProgress() if progress else None
    removed = remove_leftovers(target)
    if removed and report is not None:
        report.phase(f"removed {len(removed)} leftover(s) of an earlier interrupted build: "
                     + ", ".join(p.name for p in removed))
    tmp, lock = _locked_build_dir(target)
    try:
        with _quiet_transformers():
            info = _build(tmp, seed, replace(sft or SFTConfig(), seed=seed), reward_model, report)
        fsync_tree(tmp)
        _publish(tmp, target, overwrite)
        if report is not None:
            report.phase(f"demo ready in {target}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
    return info


def remove_leftovers(target: Path) -> list[Path]:
    """Remove the `.NAME.tmp-*` and `.NAME.old-*` directories of earlier killed builds of `target`; returns them.

    A temporary directory whose lock is held belongs to a build still running and is kept."""
    removed = []
    for leftover in sorted(target.parent.glob(f".{target.name}.tmp-*")):
        try:
            fd = _lock_dir(leftover, blocking=False)
        except BlockingIOError:
            continue
        except FileNotFoundError:  # its own build just renamed or removed it
            continue
        try:
            shutil.rmtree(leftover, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(leftover)
    for leftover in sorted(target.parent.glob(f".{target.name}.old-*")):
        shutil.rmtree(leftover, ignore_errors=True)
        removed.append(leftover)
    return removed


def _locked_build_dir(target: Path) -> tuple[Path, int]:
    """A new `.NAME.tmp-XXXXXXXX` next to `target` and the fd of its lock.

    Between mkdir and flock another process's `remove_leftovers` may take it for a leftover and delete it: the
    inode check sees that and a fresh directory is made (a bounded number of times)."""
    for _ in range(5):
        tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        fd = _lock_dir(tmp)
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return tmp, fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise RuntimeError(f"could not create a build directory next to {target}: removed by another process 5 times")


def _lock_dir(path: Path, *, blocking: bool = True) -> int:
    """An fd holding an exclusive flock on the directory `path` (released when the fd closes or the process dies)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _quiet_transformers():
    """No "Writing model shards" bars from `save_pretrained` in the middle of our own progress lines."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _publish(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename the finished build onto `target`; an old `target` is renamed aside first, then removed."""
    old = None
    if target.exists():
        if not overwrite:
            raise FileExistsError(f"{target} appeared during the build; pass overwrite=True to replace it")
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
    os.rename(tmp, target)
    fsync_path(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _build(root: Path, seed: int, sft: SFTConfig, with_reward_model: bool, report: DemoProgress | None) -> dict:
    started = time.perf_counter()
    phase = report.phase if report is not None else (lambda text: None)
    phase(f"building in {root} (tokenizer, policy, prompts)")
    tokenizer = build_tokenizer()
    policy = build_policy(tokenizer, seed=seed)
    train_rows = make_prompts(len(problems("train")), seed, "train")
    eval_rows = make_prompts(len(problems("eval")), seed, "eval")
    phase(f"supervised warm-start: up to {sft.max_steps} steps of {sft.batch_size}, stops once the sampled "
          f"accuracy reaches {sft.target_accuracy:.2f}; then accuracy on {len(eval_rows)} held-out prompts")
    on_step = report.sft_step if report is not None else None
    result = supervised_warm_start(policy, tokenizer, train_rows, eval_rows, sft, on_step=on_step)
    phase(f"warm-start stopped ({result.stopped}) after {result.steps} steps: sampled accuracy "
          f"{result.sampled_accuracy:.3f}, greedy {result.greedy_accuracy:.3f}; saving policy and reference")
    save_model(policy, tokenizer, root / "policy")
    save_model(policy, tokenizer, root / "reference")
    _write_jsonl(root / "prompts.jsonl", train_rows)
    _write_jsonl(root / "eval_prompts.jsonl", eval_rows)
    reward_stats = None
    if with_reward_model:
        phase(f"fitting the reward model on {min(len(train_rows), REWARD_MODEL_TRAIN_SAMPLES)} sampled responses")
        reward_model, stats = train_reward_model(
            policy, tokenizer, train_rows[:REWARD_MODEL_TRAIN_SAMPLES], eval_rows, seed=seed
        )
        save_model(reward_model, tokenizer, root / "reward_model")
        reward_stats = asdict(stats)
    info = _describe(seed, policy, tokenizer, train_rows, eval_rows, sft, result, reward_stats)
    info["seconds_total"] = round(time.perf_counter() - started, 2)
    (root / "demo.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _describe(seed, policy, tokenizer, train_rows, eval_rows, sft: SFTConfig, result, reward_stats) -> dict:
    """The contents of `demo.json` (less `seconds_total`)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "task": "two-digit addition: 'a+b=' -> digits of a+b, then <eos>",
        "seed": seed,
        "policy": "policy",
        "reference": "reference",
        "reward_model": "reward_model" if reward_stats is not None else None,
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
    }


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
