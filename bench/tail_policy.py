"""The long-tail workload of benchmark 19 (:mod:`bench.trl_tail`): the demo's policy taught to follow some of its
answers with a long run of ``=``, and the reward both systems score it with.

Consumes: a built demo (``policy/``, ``prompts.jsonl``, ``eval_prompts.jsonl``).
Produces: :func:`build`, the policy saved to a folder: the demo's warm-started policy fine-tuned on its own sampled
answers (so its skill at the task stays where the warm start left it), each followed, with probability
:data:`TAIL_SHARE`, by :data:`TAIL_MIN`-:data:`TAIL_MAX` ``=`` characters before ``<eos>``: most responses stay
2-4 tokens, about one in ten is ten times longer (:func:`lengths` measures the policy it built);
:func:`tail_reward`, the demo's verifier on the response with its trailing ``=`` run removed (a per-rollout
``scorer.reward_fn`` of stream-rl, and TRL's reward through ``bench.trl_worker --reward tail``), so the tail costs
generation and training tokens and changes no reward.
Guarantees: seeded (the same demo and seed give the same policy on the same machine and thread count); the
fine-tune never sees a held-out prompt; the reward is the demo verifier's on every response without a tail.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from stream_rl.demo.task import addition_reward

TAIL_SHARE = 0.1
TAIL_MIN, TAIL_MAX = 30, 44  # '=' characters: a 7-token prompt + 3-digit answer + 44 + <eos> fits 64 positions
MAX_NEW_TOKENS = 50  # both systems' cap: above every tail the policy was taught
TAIL_REWARD = "bench.tail_policy:tail_reward"
_TRAILING = re.compile(r"(?:<eos>|<pad>|\s|=)+$")


def tail_reward(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    """The demo's verifier (:func:`stream_rl.demo.task.addition_reward`) on ``response`` without its trailing run
    of ``=`` (and special tokens, whitespace)."""
    return addition_reward(prompt, _TRAILING.sub("", response), answer, metadata)


def tail_targets(rows: list[dict], responses: list[str], draw) -> list[dict]:
    """The fine-tune's rows ``{"text", "answer"}``: each prompt's own sampled response cut at its first ``<eos>``
    or ``<pad>``, followed with probability :data:`TAIL_SHARE` by :data:`TAIL_MIN`-:data:`TAIL_MAX` ``=``
    (``draw``: a seeded ``torch.Generator``)."""
    import torch

    targets = []
    for row, response in zip(rows, responses, strict=True):
        core = re.sub(r"(?:<eos>|<pad>)[\s\S]*$", "", response)  # the answer as sampled, before its <eos>
        long = torch.rand((), generator=draw).item() < TAIL_SHARE
        run = int(torch.randint(TAIL_MIN, TAIL_MAX + 1, (), generator=draw)) if long else 0
        targets.append({"text": row["text"], "answer": core + "=" * run})
    return targets


def build(demo: Path, dest: Path, *, steps: int = 300, samples: int = 4096, seed: int = 0) -> Path:
    """Fine-tune the demo's policy into the long-tail policy (module docstring), save it to ``dest`` (once: an
    existing ``dest/config.json`` is reused) and return ``dest``."""
    if (dest / "config.json").is_file():
        return dest
    import torch

    from bench.inproc import read_rows
    from stream_rl.demo.sft import encode_examples, generate_responses, sft_loss
    from stream_rl.models.loading import load_policy, save_model

    torch.manual_seed(seed)
    model, tokenizer = load_policy(demo / "policy")
    rows = read_rows(demo / "prompts.jsonl")[:samples]
    with torch.no_grad():
        own = generate_responses(model, tokenizer, [r["text"] for r in rows], greedy=False)
    draw = torch.Generator().manual_seed(seed)
    targets = tail_targets(rows, own, draw)
    ids, mask, labels = encode_examples(tokenizer, targets)  # (N, T) each
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        picks = torch.randint(len(targets), (128,), generator=draw)  # (B,)
        loss = sft_loss(model, ids[picks], mask[picks], labels[picks])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    save_model(model, tokenizer, dest)
    return dest


def lengths(policy: Path, demo: Path, *, prompts: int = 256, group: int = 8, seed: int = 0) -> dict[str, float]:
    """The policy's response lengths in tokens (``<eos>`` included when sampled) over ``prompts`` training prompts
    x ``group`` samples at temperature 1 with the benchmark's cap, and its accuracy under :func:`tail_reward`:
    ``mean``, ``p50``, ``p90``, ``p99``, ``max``, ``long_share`` (responses over 10 tokens) and ``accuracy``."""
    import torch

    from bench.inproc import read_rows
    from stream_rl.models.loading import load_policy

    torch.manual_seed(seed)
    model, tokenizer = load_policy(policy)
    model.eval()
    rows = [r for r in read_rows(demo / "prompts.jsonl")[:prompts] for _ in range(group)]
    batch = tokenizer([r["text"] for r in rows], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0)
    new = out[:, batch["input_ids"].size(1):]  # (B, T_new)
    sizes = []
    for row in new.tolist():
        ends = [i for i, t in enumerate(row) if t == tokenizer.eos_token_id]
        sizes.append(ends[0] + 1 if ends else len(row))
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    ranked = sorted(sizes)

    def pct(q: float) -> float:
        return float(ranked[min(len(ranked) - 1, int(q * len(ranked)))])

    return {"mean": statistics.fmean(sizes), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
            "max": float(ranked[-1]), "long_share": sum(s > 10 for s in sizes) / len(sizes),
            "accuracy": statistics.fmean(tail_reward(r["text"], t, r["answer"], {}) for r, t in zip(rows, texts))}
