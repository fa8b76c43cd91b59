"""TRL's ``GRPOTrainer`` on the built-in demo, in a process of its own: the peer that benchmark 9
(:mod:`bench.trl_peer`) runs against ``stream-rl run``.

``python -m bench.trl_worker --demo-dir D --out F.jsonl --steps N --max-new-tokens K [--threads 2] [--seed 0]
[--policy-dir P] [--reward-delay-s S] [--reward demo|tail] [--save-every K --save-dir S]``

Consumes: a built demo (``D/policy``: LlamaForCausalLM + character tokenizer, or the policy in ``P``;
``D/prompts.jsonl``: rows ``{"prompt_id", "text", "answer"}``) and ``trl`` (the optional extra:
``pip install -e .[trl]``).
Produces: ``F.jsonl``, one line per optimizer step ``{"step", "t", "reward_mean", "samples", "profile",
"step_time"}`` (``t``: ``time.time()`` at the step's end; ``profile``: seconds per TRL profiling timer in that step,
e.g. ``GRPOTrainer.transformers.generate``; ``step_time``: TRL's own timer around ``training_step``, i.e.
generation, scoring, forward and backward, without the optimizer step), then one final line ``{"final": true,
"setup_s", "train_s", "total_s", "steps", "threads", "versions"}``. With ``--save-every K``, the policy's weights
after every K-th optimizer step as ``S/v{step:08d}.safetensors`` (the name stream-rl's weights store gives a
version; benchmark 18 evaluates them on held-out prompts after the run).

Settings, chosen to match ``configs/demo.toml`` (see :data:`MATCHED`): 32 prompts x 8 generations = 256
completions per optimizer step (one generation batch, one update: ``per_device_train_batch_size=256``,
``gradient_accumulation_steps=1``, so ``steps_per_generation=1``), temperature 1, top-p 1, top-k 0, AdamW (plain
torch, betas 0.9/0.99, eps 1e-8, no weight decay) at a constant 1e-4 with no warm-up, gradient clip 1.0,
``beta=0`` (no reference model), ``loss_type="dapo"`` (token-mean over the batch), ``num_iterations=1``, fp32,
no gradient checkpointing, no evaluation, saving or reporting. Prompts are fed in the file's order (the demo build
already shuffled them; ``shuffle_dataset=False``), tokenised by the tokenizer's defaults (``<bos>`` prepended), as
the stream-rl producer tokenises them. The reward is :func:`stream_rl.demo.task.addition_reward` on the completion
decoded without special tokens, as the producer decodes ``response_text``.

Guarantees: one row per optimizer step, written and flushed when the step is logged; the profiling timers are
TRL's own (``trl.extras.profiling``), read by wrapping ``ProfilingContext._log_metrics``, which with
``report_to="none"`` records nothing else; a missing ``trl`` fails with the install command.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import snapshots
from stream_rl.demo.task import addition_reward

GROUP_SIZE = 8
PROMPTS_PER_STEP = 32
MATCHED = {  # GRPOConfig fields that mirror configs/demo.toml ([run], [producer], [trainer])
    "num_generations": GROUP_SIZE,  # run.group_size
    "per_device_train_batch_size": GROUP_SIZE * PROMPTS_PER_STEP,  # trainer.groups_per_step x group_size
    "gradient_accumulation_steps": 1,  # trainer.micro_batch_size 256: one forward/backward per step
    "temperature": 1.0, "top_p": 1.0, "top_k": 0,  # producer.temperature; the hf engine's neutral sampling
    "learning_rate": 1e-4, "adam_beta1": 0.9, "adam_beta2": 0.99, "adam_epsilon": 1e-8,  # trainer.lr, betas
    "weight_decay": 0.0, "max_grad_norm": 1.0,  # trainer.weight_decay (default), grad_clip
    "lr_scheduler_type": "constant", "warmup_steps": 0,  # trainer.schedule, warmup_steps (defaults)
    "beta": 0.0,  # trainer.kl.coef
    "loss_type": "dapo",  # trainer.loss.agg token-mean over the whole batch
    "epsilon": 0.2,  # trainer.loss.clip_low/high (inactive here: one update per batch, ratio 1)
    "num_iterations": 1,  # trainer.epochs x minibatches = 1
    "scale_rewards": "group",  # trainer.advantage "grpo": (r - mean_g) / std_g
}
UNMATCHED = {  # settings of TRL's own with no stream-rl counterpart, or defaults of TRL turned off
    "optim": "adamw_torch", "bf16": False, "fp16": False, "gradient_checkpointing": False, "use_vllm": False,
    "use_cpu": True, "shuffle_dataset": False, "logging_steps": 1, "report_to": "none", "save_strategy": "no",
    "eval_strategy": "no", "disable_tqdm": True, "dataloader_num_workers": 0, "log_completions": False,
}


def trl_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_: Any) -> list[float]:
    """The demo's verifier as a TRL reward function: one ``addition_reward`` per (prompt, completion, answer).

    TRL passes the dataset's other columns (here ``answer`` and ``prompt_id``) and its own keyword arguments
    (``completion_ids``, ``trainer_state``, ...), which the verifier does not use."""
    return [addition_reward(p, c, a, {}) for p, c, a in zip(prompts, completions, answer, strict=True)]


def trl_tail_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                    **_: Any) -> list[float]:
    """Benchmark 19's reward as a TRL reward function: :func:`bench.tail_policy.tail_reward` per completion."""
    from bench.tail_policy import tail_reward

    return [tail_reward(p, c, a, {}) for p, c, a in zip(prompts, completions, answer, strict=True)]


def counted(reward: Callable[..., list[float]], counts: list[int]) -> Callable[..., list[float]]:
    """``reward`` that also appends the number of completions it scored to ``counts`` (TRL names it by
    ``__name__``, which ``functools.wraps`` keeps)."""
    @functools.wraps(reward)
    def wrapper(prompts, completions, **kwargs):
        counts.append(len(completions))
        return reward(prompts=prompts, completions=completions, **kwargs)
    return wrapper


def delayed(reward: Callable[..., list[float]], delay_s: float) -> Callable[..., list[float]]:
    """``reward`` behind a slow service: each call (TRL makes one per generation batch, 256 completions here) waits
    ``delay_s`` first, as :func:`bench.delayed_reward.delayed_addition` does on stream-rl's side."""

    @functools.wraps(reward)
    def wrapper(*args, **kwargs):
        time.sleep(delay_s)
        return reward(*args, **kwargs)

    return wrapper


def demo_rows(demo_dir: Path) -> list[dict[str, str]]:
    """The demo's training prompts in file order, as TRL dataset rows ``{"prompt", "answer", "prompt_id"}``."""
    rows = [json.loads(line) for line in (demo_dir / "prompts.jsonl").read_text().splitlines() if line.strip()]
    return [{"prompt": r["text"], "answer": r["answer"], "prompt_id": r["prompt_id"]} for r in rows]


def grpo_config(output_dir: Path, steps: int, max_new_tokens: int, seed: int):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(output_dir), max_steps=steps, max_completion_length=max_new_tokens,
                      seed=seed, data_seed=seed, log_level="warning", **MATCHED, **UNMATCHED)


class StageTimes:
    """TRL's profiling timers, summed per name since the last :meth:`take` (installed by :meth:`install`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def install(self) -> None:
        from trl.extras import profiling

        original = profiling.ProfilingContext._log_metrics
        times = self

        def record(ctx, duration: float) -> None:
            times.seconds[ctx.name] += duration
            original(ctx, duration)

        profiling.ProfilingContext._log_metrics = record

    def take(self) -> dict[str, float]:
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken


def step_logger(out, stages: StageTimes, counts: list[int], save_every: int = 0, save_dir: Path | None = None):
    """A TrainerCallback writing one row per optimizer step to ``out`` (an open text file), and, when
    ``save_every`` > 0, the model's weights after every ``save_every``-th step to ``save_dir`` (after the step's
    end time is taken: the save, milliseconds for the demo's policy, falls in the next step's interval)."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def __init__(self) -> None:
            self.ended: dict[str, Any] | None = None

        def on_step_end(self, args, state, control, **kwargs):
            self.ended = {"step": state.global_step, "t": time.time(), "profile": stages.take(),
                          "samples": sum(counts)}
            counts.clear()
            if save_every and save_dir is not None and state.global_step % save_every == 0:
                save_snapshot(kwargs["model"], save_dir / snapshots.name(state.global_step))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.ended is None or not logs or "reward" not in logs:
                return
            row = {**self.ended, "reward_mean": float(logs["reward"]), "step_time": logs.get("step_time")}
            out.write(json.dumps(row) + "\n")
            out.flush()
            self.ended = None

    return StepLog()


def save_snapshot(model, path: Path) -> None:
    """The model's state dict as a safetensors file at ``path``, written whole then renamed into place."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}, str(tmp))
    tmp.replace(path)


def build_trainer(args: argparse.Namespace, scratch: Path, out, stages: StageTimes):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, ProgressCallback
    from trl import GRPOTrainer

    import torch

    policy = args.policy_dir or args.demo_dir / "policy"
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    counts: list[int] = []
    base = {"demo": trl_reward, "tail": trl_tail_reward}[args.reward]
    reward = delayed(base, args.reward_delay_s) if args.reward_delay_s else base
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[counted(reward, counts)],
                          args=grpo_config(scratch, args.steps, args.max_new_tokens, args.seed),
                          train_dataset=Dataset.from_list(demo_rows(args.demo_dir)))
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    trainer.add_callback(step_logger(out, stages, counts, args.save_every, args.save_dir))
    return trainer


def stage_medians(steps: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per-step medians of this worker's step rows, by TRL's own timers: generate (``transformers.generate``),
    forward + backward (``training_step`` less ``_prepare_inputs``) and the rest of the interval between step ends
    (optimizer step, clip, logging)."""
    def med(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    prof = [s["profile"] for s in steps]
    fwd_bwd = [s["step_time"] - p.get("GRPOTrainer._prepare_inputs", 0.0) for s, p in zip(steps, prof)]
    rest = [b["t"] - a["t"] - b["step_time"] for a, b in zip(steps, steps[1:])]
    return {"generate_s": med([p.get("GRPOTrainer.transformers.generate", 0.0) for p in prof]),
            "reward_s": med([p.get("GRPOTrainer._calculate_rewards", 0.0) for p in prof]),
            "fwd_bwd_s": med(fwd_bwd), "rest_s": med(rest)}


def versions() -> dict[str, str]:
    import importlib.metadata as md

    return {name: md.version(name) for name in ("trl", "transformers", "torch", "accelerate")}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.trl_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--demo-dir", type=Path, required=True, help="a built demo (stream-rl demo init)")
    parser.add_argument("--out", type=Path, required=True, help="JSONL file: one row per optimizer step")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--max-new-tokens", type=int, required=True, help="max_completion_length")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy-dir", type=Path, default=None, help="another policy (default: DEMO_DIR/policy)")
    parser.add_argument("--reward-delay-s", type=float, default=0.0,
                        help="a slow reward service: every reward call waits this long first (bench.delayed_reward)")
    parser.add_argument("--reward", choices=("demo", "tail"), default="demo",
                        help="demo: the demo's verifier; tail: benchmark 19's (bench.tail_policy.tail_reward)")
    parser.add_argument("--save-every", type=int, default=0,
                        help="save the policy's weights after every K-th optimizer step (0: never)")
    parser.add_argument("--save-dir", type=Path, default=None,
                        help="where --save-every writes: v{step:08d}.safetensors")
    args = parser.parse_args(list(argv))
    if args.save_every < 0 or (args.save_every and args.save_dir is None):
        parser.error("--save-every must be >= 0 and needs --save-dir")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import trl  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"bench.trl_worker needs trl ({exc}): pip install -e '.[trl]'") from exc
    import torch

    torch.set_num_threads(args.threads)
    stages = StageTimes()
    stages.install()
    with tempfile.TemporaryDirectory(prefix="trl-worker-") as scratch, args.out.open("w") as out:
        trainer = build_trainer(args, Path(scratch), out, stages)
        stages.take()  # nothing timed during set-up belongs to step 1
        setup_s = time.monotonic() - started
        t0 = time.monotonic()
        trainer.train()
        train_s = time.monotonic() - t0
        out.write(json.dumps({"final": True, "setup_s": setup_s, "train_s": train_s,
                              "total_s": time.monotonic() - started, "steps": trainer.state.global_step,
                              "threads": torch.get_num_threads(), "versions": versions()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
