"""The catalogue of algorithm choices: every loss kind, advantage estimator, KL estimator, aggregation and IS mode.

Consumes: nothing (a table of constants; imports no torch, so loading a config stays torch-free).
Produces: one frozen row per choice (name, level, one-line summary, paper citation, and its defaults), and the
name tuples the trainer's config builds its ``Literal`` choices from.
Guarantees: each choice and each per-kind default is declared here and nowhere else: the trainer's config
(``consumers/trainer/config.py``) takes its choices and defaults from these rows, :class:`~.spec.LossSpec` resolves
a loss's defaults from them, and the surrogate registry (``surrogates.py``) refuses a kind without a row here.
``tests/unit/test_catalogue.py`` checks that every row has a registered function and the config offers every row.

Levels: ``"token"`` (one value per token: a per-token ratio, a per-token advantage) or ``"sequence"`` (one value per
sequence, spread over its tokens: GSPO's sequence ratio, GRPO's group-relative advantage). A loss kind's level is
also the level of its off-policy importance weight (:func:`~stream_rl.algorithms.offpolicy.importance_weights`).

Adding a loss kind: one row in ``LOSS_KIND_ROWS``, one function registered with ``@register_surrogate("name")`` in
``surrogates.py`` (formula in its docstring), and a test against hand-computed values (docs/algorithms.md,
"Algorithm catalogue").
"""

from __future__ import annotations

from dataclasses import dataclass

LEVELS: tuple[str, ...] = ("token", "sequence")
LOSS_OPTIONS: tuple[str, ...] = ("clip_low", "clip_high", "dual_clip")  # per-kind knobs a row may use


@dataclass(frozen=True)
class Choice:
    """One named choice: its level ("token" or "sequence"), a one-line summary and the paper it comes from."""

    name: str
    level: str
    summary: str
    citation: str


@dataclass(frozen=True)
class LossKind(Choice):
    """A policy-loss kind and its defaults: clip range (lower 1 - clip_low, upper 1 + clip_high) and ``agg``;
    ``options`` are the loss knobs the kind reads (a spec that sets another one is refused)."""

    clip_low: float
    clip_high: float
    agg: str
    options: tuple[str, ...]


@dataclass(frozen=True)
class Advantage(Choice):
    """An advantage estimator; ``whiten`` is its default for ``trainer.whiten_advantages``; ``critic``: it trains a
    value head."""

    whiten: bool
    critic: bool


@dataclass(frozen=True)
class KLKind(Choice):
    """A per-token KL estimator; ``in_loss``: usable as a loss term (its expected gradient is not 0)."""

    in_loss: bool


LOSS_KIND_ROWS: tuple[LossKind, ...] = (
    LossKind("ppo", "token", "clipped surrogate on the per-token ratio pi/pi_prox (clip-higher, dual clip)",
             "Schulman et al. 2017, Proximal Policy Optimization Algorithms; Yu et al. 2025, DAPO (clip-higher); "
             "Ye et al. 2020 (dual clip)",
             clip_low=0.2, clip_high=0.2, agg="token-mean", options=("clip_low", "clip_high", "dual_clip")),
    LossKind("gspo", "sequence", "clipped surrogate on the length-normalised sequence ratio",
             "Zheng et al. 2025, Group Sequence Policy Optimization (clip 3e-4 / 4e-4)",
             clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean", options=("clip_low", "clip_high", "dual_clip")),
    LossKind("cispo", "token", "REINFORCE weighted by the detached, clipped per-token ratio: no token loses its "
                               "gradient",
             "MiniMax et al. 2025, MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention, "
             "section 3.1, eq. 4-5 (CISPO); no lower bound (clip_low 1), upper 1 + clip_high as verl's CISPO example",
             clip_low=1.0, clip_high=0.2, agg="token-mean", options=("clip_low", "clip_high")),
)

ADVANTAGE_ROWS: tuple[Advantage, ...] = (
    Advantage("grpo", "sequence", "group-relative: (r - group mean) / (group std + eps)",
              "Shao et al. 2024, DeepSeekMath (GRPO)", whiten=False, critic=False),
    Advantage("dr_grpo", "sequence", "group-relative without the std: r - group mean",
              "Liu et al. 2025, Understanding R1-Zero-Like Training (Dr. GRPO)", whiten=False, critic=False),
    Advantage("rloo", "sequence", "leave-one-out baseline: r - mean of the group's other rewards",
              "Ahmadian et al. 2024, Back to Basics (RLOO); Kool et al. 2019", whiten=False, critic=False),
    Advantage("reinforce_pp", "token", "discounted token returns whitened over the batch",
              "Hu 2025, REINFORCE++", whiten=False, critic=False),
    Advantage("gae", "token", "generalised advantage estimation with a value head",
              "Schulman et al. 2016, High-Dimensional Continuous Control Using GAE", whiten=True, critic=True),
)

KL_ROWS: tuple[KLKind, ...] = (
    KLKind("k1", "token", "logp - ref_logp: unbiased value, zero expected gradient as a loss",
           "Schulman 2020, Approximating KL Divergence", in_loss=False),
    KLKind("k2", "token", "0.5 (logp - ref_logp)^2: its expected gradient is grad KL(pi || ref)",
           "Schulman 2020, Approximating KL Divergence", in_loss=True),
    KLKind("k3", "token", "exp(x) - x - 1, x = ref_logp - logp: unbiased, >= 0; as a loss grad KL(ref || pi)",
           "Schulman 2020; Shao et al. 2024 (GRPO's KL term, eq. 4)", in_loss=True),
)

AGG_ROWS: tuple[Choice, ...] = (
    Choice("token-mean", "token", "sum over valid tokens / their count (every token weighs the same)",
           "Yu et al. 2025, DAPO"),
    Choice("seq-mean-token-mean", "sequence", "mean over sequences of each sequence's token mean",
           "Shao et al. 2024, GRPO"),
    Choice("seq-mean-token-sum-norm", "sequence", "mean over sequences of token sum / max_len (a constant budget)",
           "Liu et al. 2025, Dr. GRPO"),
)

IS_MODE_ROWS: tuple[Choice, ...] = (
    Choice("clamp", "token", "w <- min(w, is_cap): truncated importance sampling",
           "Espeholt et al. 2018 (IMPALA); Fu et al. 2025 (AReaL)"),
    Choice("mask", "token", "w <- 0 where w > is_cap: drop tokens whose mismatch is too large",
           "Fu et al. 2025 (AReaL); ICEPOP"),
)

LOSS_KINDS: dict[str, LossKind] = {row.name: row for row in LOSS_KIND_ROWS}
ADVANTAGES: dict[str, Advantage] = {row.name: row for row in ADVANTAGE_ROWS}
KL_KIND_TABLE: dict[str, KLKind] = {row.name: row for row in KL_ROWS}

LOSS_KIND_NAMES: tuple[str, ...] = tuple(LOSS_KINDS)
LOSS_DEFAULTS: dict[str, dict[str, float | str]] = {
    row.name: {"clip_low": row.clip_low, "clip_high": row.clip_high, "agg": row.agg} for row in LOSS_KIND_ROWS}
ADVANTAGE_NAMES: tuple[str, ...] = tuple(ADVANTAGES)
TOKEN_LEVEL_ADVANTAGES: tuple[str, ...] = tuple(r.name for r in ADVANTAGE_ROWS if r.level == "token")
KL_KINDS: tuple[str, ...] = tuple(KL_KIND_TABLE)
KL_LOSS_KINDS: tuple[str, ...] = tuple(r.name for r in KL_ROWS if r.in_loss)
KL_IN_LOSS_DEFAULT = "k2"  # expected gradient grad KL(pi || ref): stream_rl.algorithms.kl
KL_IN_REWARD_DEFAULT = "k3"  # an unbiased, low-variance value of KL(pi || ref) on sampled tokens
AGG_MODES: tuple[str, ...] = tuple(r.name for r in AGG_ROWS)
IS_MODES: tuple[str, ...] = tuple(r.name for r in IS_MODE_ROWS)
PPO_RANGE_CLIP = 0.01  # a GSPO clip at or above this is PPO-sized (the paper's are 3e-4 / 4e-4): warned about


def loss_kind(name: str) -> LossKind:
    """The catalogue row of loss kind ``name``; ValueError naming the kind and the known kinds otherwise."""
    try:
        return LOSS_KINDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown loss kind {name!r}; known kinds: {', '.join(LOSS_KIND_NAMES)}") from None


def choices_text(rows: tuple[Choice, ...]) -> str:
    """``'a' (summary); 'b' (summary)`` for a config field's description."""
    return "; ".join(f"'{row.name}': {row.summary}" for row in rows)
