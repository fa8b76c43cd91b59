"""The configuration reference (docs/configuration.md) generated from the pydantic models, so it stays true.

Consumes: the root config model. Produces: Markdown with one table per section (field, type, default, meaning).
Guarantees: every field of every section appears; a test compares the committed document with this output.
"""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel

HEADER = """# Configuration

Every role reads one configuration, resolved in this order (later wins):

1. the defaults below;
2. a TOML or YAML file: `--config FILE` or `STREAM_RL_CONFIG=FILE`;
3. environment variables `STREAM_RL_<SECTION>__<FIELD>` (nested sections joined by `__`, e.g.
   `STREAM_RL_TRAINER__KL__COEF=0.01`), values parsed as YAML scalars;
4. `--set section.field=value` flags (repeatable) and each command's named flags (`--bootstrap`, `--run`, ...).

A value of a variable or `--set` that opens with `{` or `[` is TOML, as in the file:
`--set 'data.chat_template_kwargs={enable_thinking = false}'` is that table (a YAML flow value without `=`, such as
`[a, b]`, still reads as YAML); one that is neither is refused naming the flag or variable. Any other value is a
YAML scalar (`4` an int, `true` a bool).

An invalid value stops the command with exit code 2 and one line naming the field and where the value came from.
`--dry-run` (and `stream-rl config`) prints the resolved configuration with secrets masked. Secrets
(`kafka.sasl_password`) are read from the environment or from a file named in the config
(`kafka.sasl_password_file`), never printed, and never written into a run directory.

Shipped example: `configs/demo.toml` (the settings `make run` uses).

This reference is generated from the code (`python -m stream_rl.cli.config > docs/configuration.md`);
a test fails when it is out of date.

## Refused combinations and rules across sections

Checked when the configuration is loaded, so `--dry-run` refuses them with exit code 2; an error that involves two
fields names both and where each value came from.

| rule | why |
|---|---|
| `producer.versions_ahead <= trainer.max_lag` (when `producer.max_groups_per_version` is set: without that backpressure `versions_ahead` does nothing) | producers further ahead generate rollouts the trainer must drop as stale |
| `producer.partial_max_lag <= trainer.max_lag`; `producer.partial_max_lag` needs `producer.oversample > 0` or `producer.abort_after_s`, and is refused with `producer.stop` (and so with multi-turn, as the cut itself is) | resumed prefixes older than `max_lag` would be dropped by the trainer; nothing is cut without them; a stop string spanning the cut would be missed |
| `trainer.loss.max_len >= producer.max_new_tokens` when `trainer.loss.agg = "seq-mean-token-sum-norm"` | Dr. GRPO's constant normaliser must cover the longest response; `max_len` unset takes `producer.max_new_tokens` |
| `trainer.kl.kind = "k1"` with `trainer.kl.placement = "loss"` is refused | k1 has zero expected gradient as a loss term (docs/algorithms.md) |
| `trainer.kl.adaptive = true` needs `trainer.kl.coef > 0` | the controller is multiplicative: from 0 it never moves |
| `trainer.temperature` is refused | removed: each rollout's logits are divided by its own `Rollout.temperature` (`producer.temperature`) |
| `scorer.half_precision` is refused | removed: `scorer.dtype` (`bfloat16` for what `half_precision = true` did) |
| `run.placement = "elastic"` is refused | removed: its lease measured 1.03x `auto` on the demo, within the noise (docs/architecture.md, "Elastic placement: designed, measured, removed"); use `auto` |
| `trainer.schedule` other than `constant` needs `trainer.max_steps` | the decay ends at `max_steps` |
| `scorer` needs `reward_fn` and/or `reward_model_dir` | a scorer without a reward source has nothing to attach |
| `alerts.consumer_lag.action` and `alerts.trainer_stalled.action` may not be `pause` | a paused role could never clear them (docs/alerts.md) |
| `alerts.memory_growth.min_span_s <= alerts.memory_growth.window_s` | the samples could never span enough time |
| `trainer.lora.enabled` with `trainer.engine = "deepspeed"` is refused | the adapters are trained by the torch engine only |
| `trainer.keep_best = "eval/<set>/<metric>"` needs an `[eval]` section, `<set>` in `eval.sets` (`heldout` with the demo) and a metric that evaluation produces (also as `<set>/<source>/<metric>`) | otherwise no evaluation could ever name a best version |
| `run.gpus`: every index below `run.gpus.count` (unset: below the count torch reports, checked when `stream-rl run` starts) | a role pointed at a GPU that does not exist would fail after the others started |
| `run.gpus.producers` holds a whole number (>= 1) of blocks of `producer.vllm.tensor_parallel_size` GPUs | each producer shards its model over one block |
| `run.trainer_ranks <=` the GPUs of `run.gpus.trainer` | each trainer rank needs a GPU of its own |
| per GPU, the shares of the processes on it (`producer.vllm.gpu_memory_utilization` or `run.gpus.producer_memory`, `run.gpus.trainer_memory`, `run.gpus.scorer_memory`, `run.gpus.evaluator_memory`) `* (1 + run.gpus.headroom) <= 1` | two roles given more memory than the GPU has fail mid-run (docs/planner.md) |
| a `[driver]` needs `driver.gateway_url`, or a `[gateway]` section with a `gateway.port` other than 0 | the driver plays through a gateway it must be able to reach before it starts (docs/agents.md) |
| `producer.vllm.engine_kwargs` may not repeat an argument stream-rl sets (`dtype`, `seed`, `tensor_parallel_size`, ...); keys the installed vLLM's `EngineArgs` lacks are refused by `stream-rl run` (`--dry-run` too) before it starts anything, where vLLM is installed (read in a child process), and again where the engine is built | the config layer does not import vLLM |

Allowed, but printed as a one-line `warning:` on stderr by every command:

- `producer.versions_ahead = trainer.max_lag` (> 0): the producers may run a full `max_lag` versions ahead of the
  weights they hold, so some rollouts reach the trainer `max_lag + 1` versions old and are dropped as stale (the
  asynchronous benchmark in docs/benchmarks.md runs this way on purpose, to measure the most overlap, and reports
  the drops); `versions_ahead < max_lag` avoids them.
- `trainer.loss.kind = "gspo"` with `clip_low` or `clip_high` >= 0.01: a sequence ratio stays within ~1e-3 of 1, so a
  PPO-sized clip never acts (GSPO's defaults are the paper's 3e-4 / 4e-4).

Defaults that depend on another field are resolved at load time and shown resolved by `--dry-run`:
`trainer.loss.clip_low` / `clip_high` / `agg` (by `trainer.loss.kind`), `trainer.loss.max_len`
(`producer.max_new_tokens`), `trainer.kl.kind` (k2 in the loss, k3 in the reward) and `trainer.whiten_advantages`
(on for `gae`).
"""


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "").replace("pathlib.", "")
    return text.replace("|", "\\|")


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
    else:
        value = field.default
    try:
        text = json.dumps(value, default=str)
    except TypeError:
        text = str(value)
    return f"`{text}`".replace("|", "\\|")


def _optional_section(annotation: Any) -> type[BaseModel] | None:
    """The section class of ``Section`` or ``Section | None`` (an optional section: a row, then its own table)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def _section(model: type[BaseModel], path: str, out: list[str]) -> None:
    subsections = []
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        section = _optional_section(ann)
        if section is not None:
            subsections.append((name, section))
            if section is ann:
                continue
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{name}` | {_type_name(ann)} | {_default(field)} | {desc} |")
    if rows:
        doc = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""
        out += [f"## `{path or '(root)'}`", "", doc, "", "| field | type | default | meaning |",
                "|---|---|---|---|", *rows, ""]
    for name, sub in subsections:
        _section(sub, f"{path}.{name}" if path else name, out)


def config_reference(model: type[BaseModel]) -> str:
    out: list[str] = [HEADER]
    _section(model, "", out)
    return "\n".join(out).rstrip() + "\n"
