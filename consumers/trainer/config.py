"""The trainer's configuration section (``cfg.trainer``).

Consumes: values from the config file, ``STREAM_RL_TRAINER__*`` variables and ``--set trainer.x=y`` flags.
Produces: a validated :class:`TrainerConfig` with the nested :class:`OverlongConfig` (DAPO's overlong handling;
DAPO's other option, ``dynamic_sampling``, is a flag of the section), :class:`KLConfig`, :class:`LossConfig` and
:class:`LoraConfig`: the whole section in one module.
Choices and per-kind defaults (loss kinds, advantage estimators, KL estimators, aggregation and IS modes) come from
the torch-free catalogue ``stream_rl/algorithms/catalogue.py``, where each is declared once; each ``trainer.loss``
setting's default, bounds, description and checks are the loss spec's (``stream_rl/algorithms/spec.py``, no
pydantic), from which :class:`LossConfig` builds its fields.
Guarantees: every field has a description and bounds; combinations that cannot work (a decaying learning-rate
schedule without ``max_steps``, k1 as a loss term, an adaptive KL starting at 0) are rejected here, not at step
1000; defaults that depend on another field (the GSPO clip range, the in-loss KL estimator, whitening for GAE) are
resolved here, so ``--dry-run`` prints what the trainer will use. Rules across sections (the Dr. GRPO length
normaliser against ``producer.max_new_tokens``) live in the root config.

One trainer *step* consumes one batch of ``groups_per_step`` whole groups. Within a step the batch is split into
``minibatches`` optimizer updates, repeated for ``epochs`` passes; each update accumulates gradients over micro
batches of at most ``micro_batch_size`` sequences (and, with ``max_tokens_per_micro_batch``, at most that many
tokens: :mod:`consumers.trainer.micro`). Versions, broadcasts, checkpoints and the learning-rate schedule
count steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from stream_rl.algorithms import catalogue as cat
from stream_rl.algorithms.spec import LOSS_FIELDS, LossSpec
from stream_rl.config.base import DEVICE_PATTERN, Section

# The choices and per-kind defaults are the catalogue's (stream_rl/algorithms/catalogue.py, torch-free): declared
# there once, re-exported here under the names the config has always used.
ADVANTAGES = cat.ADVANTAGE_NAMES
KL_IN_LOSS_DEFAULT = cat.KL_IN_LOSS_DEFAULT
KL_IN_REWARD_DEFAULT = cat.KL_IN_REWARD_DEFAULT
LOSS_DEFAULTS: dict[str, dict[str, float | str]] = cat.LOSS_DEFAULTS
PPO_RANGE_CLIP = cat.PPO_RANGE_CLIP


class OverlongConfig(Section):
    """DAPO's overlong handling: mask truncated responses out of the loss and/or a soft length penalty.

    Formulas: ``stream_rl.algorithms.shaping`` (DAPO, Yu et al. 2025, section 3.4). ``max_len`` None takes
    ``producer.max_new_tokens`` (resolved by the root config, so ``--dry-run`` prints the number used).
    """

    filter: bool = Field(False, description="overlong filtering: a response cut at the length budget "
                                            "(finish_reason 'length') gets no loss; its reward still counts in its "
                                            "group's advantage statistics")
    buffer: int | None = Field(None, ge=1, description="soft overlong punishment: over the last `buffer` tokens of "
                               "`max_len` the reward falls linearly by up to `factor` (DAPO eq. 13), and by "
                               "`factor` beyond max_len; None: no penalty")
    max_len: int | None = Field(None, ge=1, description="the penalty's length budget L_max; None: "
                                                        "producer.max_new_tokens")
    factor: float = Field(1.0, gt=0.0, description="size of the full penalty (the reward falls by at most this)")

    @model_validator(mode="after")
    def _consistent(self) -> OverlongConfig:
        if self.buffer is not None and self.max_len is not None and self.buffer > self.max_len:
            raise ValueError(f"buffer={self.buffer} > max_len={self.max_len}: the penalty's ramp must fit in the "
                             f"length budget")
        return self


class KLConfig(Section):
    """KL regularisation towards the frozen reference policy (reference logprobs come from the scorer)."""

    coef: float = Field(0.0, ge=0.0, description="initial KL coefficient beta; 0 switches the penalty off "
                                                  "(KL to the reference is still reported when available)")
    kind: Literal[cat.KL_KINDS] | None = Field(  # type: ignore[valid-type]
        None, description="per-token KL estimator (Schulman 2020); None: k2 in the loss (expected gradient "
                          "grad KL(pi||ref)), k3 in the reward; k3 in the loss has the gradient of KL(ref||pi); "
                          "k1 in the loss is rejected (zero expected gradient)")
    placement: Literal["reward", "loss"] = Field(
        "loss", description="'reward': subtract beta * KL from the rewards before the advantages (classic PPO); "
                            "'loss': add beta * KL to the loss (GRPO), weighted like the policy term")
    adaptive: bool = Field(False, description="adapt beta towards `target` (Ziegler et al. 2019) instead of fixed; "
                                              "needs coef > 0 (a multiplicative controller never leaves 0)")
    target: float = Field(0.1, gt=0.0, description="adaptive KL: desired mean per-token KL to the reference")
    horizon: float = Field(10_000.0, gt=0.0, description="adaptive KL: samples over which beta moves <= 20 %")
    report: bool = Field(False, description="report kl/ref_mean (and let the kl_ref_high alert watch it) even "
                                            "with coef 0; `stream-rl run` on the demo gives the scorer the "
                                            "reference model only when coef > 0 or report is true (otherwise no "
                                            "reference forward pass is run)")

    @property
    def needs_reference(self) -> bool:
        """Whether anything consumes reference logprobs: the penalty (coef > 0) or the requested metric."""
        return self.coef > 0 or self.report

    @model_validator(mode="after")
    def _consistent(self) -> KLConfig:
        if self.kind is None:
            self.kind = KL_IN_LOSS_DEFAULT if self.placement == "loss" else KL_IN_REWARD_DEFAULT
        if self.kind not in cat.KL_LOSS_KINDS and self.placement == "loss":
            raise ValueError("kind='k1' with placement='loss' has zero expected gradient: use kind='k2' "
                             "(gradient of KL(pi||ref)) or 'k3' (gradient of KL(ref||pi)), or placement='reward'")
        if self.adaptive and self.coef == 0:
            raise ValueError("adaptive=true with coef=0 never moves (beta is updated multiplicatively): set coef > 0 "
                             "or adaptive=false")
        return self


def _declared(name: str, **section_only: Any) -> Any:
    """``trainer.loss.<name>`` as :class:`~stream_rl.algorithms.spec.LossSpec` declares it (its default, and its
    description and bounds as ``Field`` keywords: ``stream_rl/algorithms/spec.py``), with ``section_only`` on top."""
    declared = LOSS_FIELDS[name]
    return Field(**{"default": declared.default, **declared.metadata, **section_only})


class LossConfig(Section):
    """The policy loss of ``stream_rl.algorithms.policy_loss`` (its ``LossSpec``) and its off-policy correction.

    Every field but ``off_policy_correction`` (the trainer's own) is the spec's declaration (:func:`_declared`):
    default, bounds and description written once, in ``stream_rl/algorithms/spec.py``; the types here are the
    catalogue's choices. The kind's defaults and the spec's checks are the spec's too (:meth:`_as_the_spec`)."""

    kind: Literal[cat.LOSS_KIND_NAMES] = _declared("kind")  # type: ignore[valid-type]
    clip_low: float | None = _declared("clip_low")
    clip_high: float | None = _declared("clip_high")
    dual_clip: float | None = _declared("dual_clip")
    off_policy_correction: bool = Field(
        True, description="multiply each token's loss by pi_prox / mu (decoupled PPO / truncated IS), with mu the "
                          "producer's behaviour logprobs; gspo uses the sequence weight (geometric mean)")
    # The one default the section does not share with a bare LossSpec (whose is_cap is None: it has no behaviour
    # logprobs to weigh): the trainer corrects off-policy by default, so it caps the weight by default, at 5.
    is_cap: float | None = _declared("is_cap", default=5.0)
    is_mode: Literal[cat.IS_MODES] = _declared("is_mode")  # type: ignore[valid-type]
    agg: Literal[cat.AGG_MODES] | None = _declared("agg")  # type: ignore[valid-type]
    max_len: int | None = _declared("max_len")

    @model_validator(mode="after")
    def _as_the_spec(self) -> LossConfig:
        """The kind's defaults for the knobs left None and every check of the spec (a knob the kind does not use),
        by building the spec this section gives the trainer."""
        spec = LossSpec.from_config(self)
        for name in LOSS_DEFAULTS[self.kind]:
            if getattr(self, name) is None:
                setattr(self, name, getattr(spec, name))
        return self


class LoraConfig(Section):
    """LoRA adapters (Hu et al. 2021) trained through ``peft`` on a frozen base: W = W0 + (alpha / rank) * B A."""

    enabled: bool = Field(False, description="train LoRA adapters on the frozen trainer.model_dir instead of every "
                                             "weight; versions then carry only the adapter tensors "
                                             "(docs/weights.md, 'LoRA adapters')")
    rank: int = Field(8, ge=1, le=4096, description="adapter rank r (A is [r, in], B is [out, r])")
    alpha: float = Field(16.0, gt=0.0, description="scaling numerator: the update is (alpha / rank) * B A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter input; the trainer runs in "
                                                           "eval() mode (engines.py), so it is inactive there")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
        description="names (last path component) of the nn.Linear modules that get an adapter, e.g. q_proj, "
                    "v_proj, up_proj")


class TrainerConfig(Section):
    """The ``stream-rl train`` role: batching, staleness, advantages, KL, loss, optimiser, broadcast, checkpoints."""

    REMOVED = {"temperature": "trainer.temperature was removed: the trainer divides each rollout's logits by that "
                              "rollout's own sampling temperature (Rollout.temperature, set by producer.temperature)"}
    model_dir: Path | None = Field(None, description="local Hugging Face directory of the initial policy "
                                                     "(safetensors); required to train")
    engine: Literal["torch", "deepspeed"] = Field("torch", description="plain torch or DeepSpeed ZeRO")
    device: str = Field("auto", pattern=DEVICE_PATTERN,
                        description="'auto': cuda when torch sees a GPU, else cpu; or cpu, cuda, cuda:N")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="'bfloat16': mixed precision, bf16 compute under autocast with fp32 master weights, "
                               "gradients and AdamW state; 'float32': everything in fp32")
    zero_stage: int = Field(2, ge=1, le=3, description="DeepSpeed ZeRO stage (engine='deepspeed' only)")
    collective_timeout_s: float = Field(
        600.0, gt=0.0, description="data-parallel ranks (stream-rl train --nproc N, torchrun): a collective that "
                                   "does not complete in this many seconds (a rank died or hung) stops the trainer")
    advantage: Literal[cat.ADVANTAGE_NAMES] = Field(  # type: ignore[valid-type]
        "grpo", description="advantage estimator (stream_rl/algorithms/catalogue.py): "
                            + cat.choices_text(cat.ADVANTAGE_ROWS) + "; 'gae' adds a value head trained with the "
                            "clipped value loss")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount for reinforce_pp and gae")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda")
    whiten_advantages: bool | None = Field(
        None, description="whiten the advantages over each batch's valid tokens (zero mean, unit variance); None: "
                          "on for gae (as CleanRL and RLHF PPO do), off otherwise")
    recompute_proximal: Literal["auto", "always"] = Field(
        "auto", description="'auto': with epochs * minibatches == 1 the single update's own forward gives pi_prox "
                            "(the ratio is exactly 1) and the separate proximal pass is skipped when nothing "
                            "before the update needs it; 'always': always run it")
    vf_coef: float = Field(0.5, ge=0.0, description="weight of the value loss (advantage='gae' only)")
    value_clip: float = Field(0.2, gt=0.0, description="value-loss clip range (advantage='gae' only)")
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: a complete group whose rewards are all equal (no GRPO gradient) "
                           "goes to the stale topic with that reason instead of into a batch (not re-queued; the "
                           "producers' budget gets it back and they sample more prompts); grpo, dr_grpo, rloo only")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    max_lag: int = Field(4, ge=0, description="staleness bound: a rollout whose oldest token is more than this "
                                              "many policy versions old is dropped and its prompt re-queued")
    max_requeues: int = Field(
        3, ge=0, le=100, description="a (prompt, epoch) whose group is dropped (stale, a member dead-lettered, its "
                                     "step's update skipped) is re-queued at most this many times; a dropped group "
                                     "of the last attempt goes to the stale topic with requeued=false")
    accept_offset_loss: bool = Field(
        False, description="--resume with a checkpoint offset outside the broker's range of its partition (topic "
                           "re-created, truncated or retention-deleted): false stops the trainer with an error "
                           "naming the partition, the offset and the range; true logs that as a warning and "
                           "continues from the partition's first offset on the broker")
    groups_per_step: int = Field(32, ge=1, description="whole groups (prompts) per trainer step")
    micro_batch_size: int = Field(64, ge=1, description="sequences per forward/backward (gradient accumulation)")
    share_prompts: bool = Field(True, description="run each distinct prompt of a micro batch once and let its "
                                "responses attend to its cached keys/values (exact up to float rounding; a group "
                                "of G samples pays for its prompt once, consumers/trainer/prefix.py); false: every "
                                "row runs its own prompt")
    packing: bool = Field(False, description="pack each micro batch's sequences end to end into rows of one width "
                          "(no compute on padding; position ids and causal attention kept per sequence by a block "
                          "mask, exact up to float rounding, consumers/trainer/packing.py); an alternative to "
                          "share_prompts (set it false); needs the policy's attention to be 'sdpa' or 'eager'")
    pack_length: int | None = Field(None, ge=1, le=1_048_576, description="packing: width of a packed row in tokens; "
                                    "a micro batch whose longest sequence (prompt + response) is longer gets rows "
                                    "that wide (a sequence is never split); None: the longest sequence of each "
                                    "micro batch; ignored without packing")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, le=16_777_216, description="fill each micro batch by token count instead of a fixed number of "
        "sequences: rows are added in order while the micro batch's tokens stay within this budget (a row costs its "
        "prompt + response tokens with packing, else the batch's padded width P + T; a row larger than the budget "
        "gets a micro batch of its own, never split); micro_batch_size still caps the rows; the same loss and "
        "gradients up to float rounding (consumers/trainer/micro.py); None: micro_batch_size sequences each")
    gradient_checkpointing: bool = Field(
        False, description="activation checkpointing: each decoder layer keeps only its input and recomputes its "
                           "activations in backward (Hugging Face gradient_checkpointing_enable, non-reentrant; "
                           "same loss and gradients, about one more forward of compute); the key/value cache is "
                           "off under it, so share_prompts must be false")
    epochs: int = Field(1, ge=1, description="passes over each batch")
    minibatches: int = Field(1, ge=1, description="optimizer updates per pass over a batch")
    lr: float = Field(1e-4, gt=0.0, description="peak AdamW learning rate")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW (beta1, beta2), each in [0, 1)")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 to lr over this many steps")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after warm-up: constant, or linear/cosine decay to 0 at max_steps")
    grad_clip: float | None = Field(1.0, gt=0.0, description="clip the global gradient norm; None: no clipping")
    success_threshold: float = Field(1.0, description="a rollout with reward >= this counts as a success in the "
                                                      "per-group success-rate metric")
    broadcast_every: int = Field(1, ge=1, description="publish policy version v+1 every this many steps")
    checkpoint_every: int = Field(50, ge=1, description="write an atomic checkpoint every this many steps")
    keep_checkpoints: int = Field(3, ge=1, description="complete checkpoints kept; older ones are pruned")
    checkpoint_dir: Path | None = Field(None, description="where checkpoints go; default run_dir/checkpoints")
    keep_best: str | None = Field(
        None, pattern=r"^eval/[A-Za-z0-9_.-]+/.+$", max_length=255,
        description="keep the best policy version by this evaluation metric, 'eval/<set>/<metric>' (e.g. "
                    "eval/heldout/greedy/accuracy; needs an [eval] section), in checkpoint_dir/best/ beside the "
                    "latest checkpoint (stream_rl/evaluation/best.py; never removed by gc); None: off")
    keep_best_mode: Literal["max", "min"] = Field("max", description="keep_best: a higher ('max') or lower ('min') "
                                                                     "value is better")
    keep_best_pending: int = Field(
        3, ge=1, le=1000, description="keep_best: at most this many versions due for evaluation keep their weights "
                                      "on disk (checkpoint_dir/eval-pending/) until their evaluation arrives; a "
                                      "newer one drops the oldest")
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps; None: run until stopped")
    poll_timeout_s: float = Field(1.0, gt=0.0, description="how long one poll of the scored topic waits")
    seed: int = Field(0, ge=0, description="seeds torch, numpy and python RNGs (minibatch shuffling)")

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.whiten_advantages is None:
            self.whiten_advantages = cat.ADVANTAGES[self.advantage].whiten
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1), got {self.betas}")
        if self.dynamic_sampling and self.advantage in cat.TOKEN_LEVEL_ADVANTAGES:
            sequence_level = [a for a in cat.ADVANTAGE_NAMES if a not in cat.TOKEN_LEVEL_ADVANTAGES]
            raise ValueError(f"dynamic_sampling=true with advantage={self.advantage!r}: equal rewards still give "
                             f"token-level advantages there; use {', '.join(sequence_level[:-1])} or "
                             f"{sequence_level[-1]}, or dynamic_sampling=false")
        if self.packing and self.share_prompts:
            raise ValueError("packing=true with share_prompts=true: they are alternative forward paths (packed rows, "
                             "or each distinct prompt once on a key/value cache); set share_prompts=false to pack")
        if self.gradient_checkpointing and self.share_prompts:
            raise ValueError("gradient_checkpointing=true with share_prompts=true: checkpointed layers run without "
                             "the key/value cache the shared-prompt forward needs; set share_prompts=false (packing "
                             "works with checkpointing)")
        if self.schedule != "constant" and self.max_steps is None:
            raise ValueError(f"schedule={self.schedule!r} decays to 0 at max_steps: set max_steps")
        if self.lora.enabled and self.engine == "deepspeed":
            raise ValueError("lora.enabled=true with engine='deepspeed' is not supported (the adapters are trained "
                             "by the torch engine only): set engine='torch' or lora.enabled=false")
        return self
