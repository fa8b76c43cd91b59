"""A tiny learned reward model for the demo, to exercise the reward-model scoring path.

Consumes: the warm-started demo policy, its tokenizer and prompt rows. Produces: a
`LlamaForSequenceClassification` (one label) and `RewardModelStats`.

How it is trained (briefly, and honestly a probe): responses are sampled from the policy at temperature 1 and
labelled by the rule-based verifier. The classifier's transformer body is a copy of the policy's body and stays
frozen; only the linear score head is fitted, in closed form (ridge regression of the verifier's reward on the
final hidden state of the last non-padding token). Its raw output therefore estimates the verifier's reward
(about 0 for a wrong answer, about 1 for a right one) and needs no transform; it is a weak, noisy stand-in for
the verifier, there to show the path, not to beat the rule.

Input convention: the text `prompt + response` (e.g. `12+34=46<eos>`; trailing `<pad>` is harmless), tokenized
by the saved tokenizer (which prepends `<bos>`). Score with RIGHT padding (as `stream_rl.models.load_reward_model`
configures the tokenizer) or pass `position_ids = cumsum(attention_mask) - 1` with left padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stream_rl.demo.model import build_reward_model
from stream_rl.demo.sft import generate_responses
from stream_rl.demo.task import addition_reward

RIDGE = 1e-2


@dataclass
class RewardModelStats:
    train_samples: int
    train_positive_rate: float
    eval_samples: int
    eval_positive_rate: float
    eval_auc: float
    """Probability that a correct held-out sample scores above a wrong one (0.5 = no signal)."""
    eval_agreement: float
    """Fraction of held-out samples where (score > 0.5) equals (verifier reward == 1)."""
    eval_mean_score_correct: float
    eval_mean_score_wrong: float


def labelled_samples(policy, tokenizer, rows: list[dict]) -> tuple[list[str], torch.Tensor]:
    """`prompt + response` texts sampled from `policy` and their verifier rewards, shape (N,)."""
    responses = generate_responses(policy, tokenizer, [row["text"] for row in rows], greedy=False)
    responses = [response.replace(tokenizer.pad_token, "") for response in responses]
    rewards = [addition_reward(row["text"], resp, row["answer"], {}) for row, resp in zip(rows, responses)]
    return [row["text"] + resp for row, resp in zip(rows, responses)], torch.tensor(rewards)


@torch.no_grad()
def last_token_features(reward_model, tokenizer, texts: list[str], batch_size: int = 512) -> torch.Tensor:
    """Final hidden state at each text's last token, (N, H): what the score head reads."""
    features = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start : start + batch_size], padding=True, padding_side="right", return_tensors="pt")
        hidden = reward_model.model(**batch).last_hidden_state  # (B, T, H)
        last = batch["attention_mask"].sum(dim=1) - 1  # (B,)
        features.append(hidden[torch.arange(hidden.size(0)), last])  # (B, H)
    return torch.cat(features)


def fit_score_head(features: torch.Tensor, targets: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """Ridge-regression weights w, (H,), minimising |features @ w - targets|^2 + ridge * |w|^2."""
    gram = features.T @ features + ridge * torch.eye(features.size(1))  # (H, H)
    return torch.linalg.solve(gram.double(), (features.T @ targets).double()).float()  # (H,)


def auc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve: P(positive's score > negative's), ties counting half; NaN if a class is empty."""
    pos, neg = scores[positive], scores[~positive]  # (P,), (N,)
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).float() + 0.5 * (pos[:, None] == neg[None, :]).float()  # (P, N)
    return greater.mean().item()


def train_reward_model(
    policy, tokenizer, train_rows: list[dict], eval_rows: list[dict], *, seed: int = 0
) -> tuple[torch.nn.Module, RewardModelStats]:
    """A one-label classifier with the policy's frozen body and a fitted score head, plus held-out stats."""
    torch.manual_seed(seed)
    reward_model = build_reward_model(tokenizer, seed=seed)
    reward_model.model.load_state_dict(policy.model.state_dict())
    reward_model.eval()
    train_texts, train_rewards = labelled_samples(policy, tokenizer, train_rows)
    weights = fit_score_head(last_token_features(reward_model, tokenizer, train_texts), train_rewards)
    with torch.no_grad():
        reward_model.score.weight.copy_(weights.unsqueeze(0))  # (1, H)
    eval_texts, eval_rewards = labelled_samples(policy, tokenizer, eval_rows)
    scores = last_token_features(reward_model, tokenizer, eval_texts) @ weights  # (N,)
    correct = eval_rewards == 1.0
    stats = RewardModelStats(
        train_samples=len(train_texts),
        train_positive_rate=train_rewards.mean().item(),
        eval_samples=len(eval_texts),
        eval_positive_rate=correct.float().mean().item(),
        eval_auc=auc(scores, correct),
        eval_agreement=((scores > 0.5) == correct).float().mean().item(),
        eval_mean_score_correct=scores[correct].mean().item() if correct.any() else float("nan"),
        eval_mean_score_wrong=scores[~correct].mean().item() if (~correct).any() else float("nan"),
    )
    return reward_model, stats
