"""Supervised warm-start for the demo policy: teacher-forced training on `<bos>a+b=` + answer + `<eos>`.

Consumes: a demo policy and tokenizer, train rows and eval rows (`{"text", "answer"}`, see `task.make_prompts`).
Produces: the policy trained in place and an `SFTResult` with the measured steps, time, losses and accuracies.

How: AdamW (lr 1e-3), batches of 128 rows drawn with a seeded generator; the loss is the mean cross-entropy over
the answer and `<eos>` tokens only (the prompt and the right padding are masked out). Every `eval_every` steps
the sampled accuracy (temperature 1, no top-k/top-p, `eval_size` held-out prompts) is measured and training
stops as soon as it reaches `target_accuracy`, or at `max_steps` / `max_seconds`. The goal is a policy that
succeeds sometimes but far from always, so RL has something to improve: accuracy jumps quickly once the model
"gets" carrying, so it is checked often.

Progress: `on_step` (optional) receives an `SFTProgress` after every step (steps done/total, loss, elapsed time,
the accuracy when the step was a check); `stream_rl.demo.progress` renders it.

Guarantees: a fixed seed gives the same run on the same machine and thread count (with or without `on_step`);
the model is left in eval mode; accuracies are measured with the task's verifier on decoded responses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stream_rl.demo.progress import SFTProgress
from stream_rl.demo.task import addition_reward

IGNORE_INDEX = -100


@dataclass
class SFTConfig:
    batch_size: int = 128
    lr: float = 1e-3
    target_accuracy: float = 0.2
    """Stop once the sampled accuracy on `eval_size` held-out prompts reaches this."""
    eval_every: int = 25
    eval_size: int = 256
    max_steps: int = 1000
    max_seconds: float | None = None
    max_new_tokens: int = 6
    seed: int = 0


@dataclass
class SFTResult:
    steps: int
    seconds: float
    stopped: str
    """'target', 'max_steps' or 'max_seconds'."""
    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    """(step, sampled accuracy on the eval subset) at each check."""
    sampled_accuracy: float = 0.0
    """On every eval row, temperature 1."""
    greedy_accuracy: float = 0.0
    """On every eval row, argmax decoding."""


def encode_examples(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `(input_ids, attention_mask, labels)`, each (B, T); labels are -100 off the answer + eos."""
    sequences, label_rows = [], []
    for row in rows:
        prompt_ids = tokenizer(row["text"])["input_ids"]  # <bos> a + b =
        answer_ids = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sequences.append(prompt_ids + answer_ids)
        label_rows.append([IGNORE_INDEX] * len(prompt_ids) + answer_ids)
    width = max(len(seq) for seq in sequences)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, (seq, lab) in enumerate(zip(sequences, label_rows)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention_mask[i, : len(seq)] = 1
    return input_ids, attention_mask, labels


def sft_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    shifted_logits = logits[:, :-1].reshape(-1, logits.size(-1))  # (B*(T-1), V)
    shifted_labels = labels[:, 1:].reshape(-1)  # (B*(T-1),)
    return torch.nn.functional.cross_entropy(shifted_logits, shifted_labels, ignore_index=IGNORE_INDEX)


@torch.no_grad()
def generate_responses(
    model, tokenizer, prompts: list[str], *, greedy: bool, max_new_tokens: int = 6, batch_size: int = 512
) -> list[str]:
    """Decoded responses (special tokens kept, e.g. `46<eos><pad>`) to left-padded prompts."""
    was_training = model.training
    model.eval()
    responses: list[str] = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start : start + batch_size], padding=True, return_tensors="pt")
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        out = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling)  # (B, T_prompt + T_new)
        new_tokens = out[:, batch["input_ids"].size(1) :]
        responses.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=False))
    model.train(was_training)
    return responses


def accuracy(model, tokenizer, rows: list[dict], *, greedy: bool, max_new_tokens: int = 6) -> float:
    """Fraction of rows whose generated response the verifier scores 1."""
    responses = generate_responses(
        model, tokenizer, [row["text"] for row in rows], greedy=greedy, max_new_tokens=max_new_tokens
    )
    rewards = [addition_reward(row["text"], resp, row["answer"], {}) for row, resp in zip(rows, responses)]
    return sum(rewards) / max(len(rewards), 1)


def supervised_warm_start(
    model,
    tokenizer,
    train_rows: list[dict],
    eval_rows: list[dict],
    config: SFTConfig | None = None,
    on_step: Callable[[SFTProgress], None] | None = None,
) -> SFTResult:
    """Train `model` in place until the sampled accuracy reaches the target (or a step/time cap).

    `on_step`, when given, is called after every step with an `SFTProgress` (e.g. `DemoProgress.sft_step`)."""
    config = config or SFTConfig()
    torch.manual_seed(config.seed)
    batches = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    check_rows = eval_rows[: config.eval_size]
    all_ids, all_mask, all_labels = encode_examples(tokenizer, train_rows)  # (N, T) each, encoded once
    result = SFTResult(steps=0, seconds=0.0, stopped="max_steps")
    start = time.perf_counter()
    model.train()
    for step in range(1, config.max_steps + 1):
        picks = torch.randint(len(train_rows), (config.batch_size,), generator=batches)  # (B,)
        input_ids, attention_mask, labels = all_ids[picks], all_mask[picks], all_labels[picks]
        loss = sft_loss(model, input_ids, attention_mask, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        result.losses.append(loss.item())
        result.steps = step
        sampled = None
        if step % config.eval_every == 0:
            sampled = accuracy(model, tokenizer, check_rows, greedy=False, max_new_tokens=config.max_new_tokens)
            result.evals.append((step, sampled))
            if sampled >= config.target_accuracy:
                result.stopped = "target"
        elapsed = time.perf_counter() - start
        if result.stopped != "target" and config.max_seconds is not None and elapsed > config.max_seconds:
            result.stopped = "max_seconds"
        last = result.stopped != "max_steps" or step == config.max_steps
        if on_step is not None:
            on_step(SFTProgress(step, config.max_steps, result.losses[-1], elapsed, config.max_seconds,
                                config.target_accuracy, sampled, last))
        if last:
            break
    result.seconds = time.perf_counter() - start
    model.eval()
    result.sampled_accuracy = accuracy(model, tokenizer, eval_rows, greedy=False, max_new_tokens=config.max_new_tokens)
    result.greedy_accuracy = accuracy(model, tokenizer, eval_rows, greedy=True, max_new_tokens=config.max_new_tokens)
    return result
