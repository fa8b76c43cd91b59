"""Configuration of the versioned weight broadcast (``cfg.weights``).

Consumes: nothing (a pydantic section, validated when the root config is loaded).
Produces: :class:`WeightsConfig`, read by :class:`~stream_rl.weights.publisher.WeightsPublisher` (trainer) and
:class:`~stream_rl.weights.receiver.WeightsReceiver` (producers).
Guarantees: every field has bounds; ``chunk_size`` is further checked against ``kafka.max_request_size`` when a
publisher is built, so an inline chunk record never exceeds the broker's request limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from stream_rl.config.base import Section

MIB = 1 << 20


class WeightsConfig(Section):
    """How the trainer broadcasts policy weights and how producers fetch them."""

    mode: Literal["auto", "inline", "store"] = Field(
        "auto",
        description="inline: chunk records on a per-version topic; store: a safetensors file in store_dir; "
                    "auto: inline up to inline_max_bytes, store above")
    inline_max_bytes: int = Field(
        64 * MIB, ge=0,
        description="auto mode: payloads (tensor bytes) larger than this go to the store instead of Kafka")
    chunk_size: int = Field(
        900_000, ge=1,
        description="bytes of payload per inline chunk record; with its envelope a record must stay under "
                    "kafka.max_request_size (1 MiB by default)")
    store_dir: Path | None = Field(
        None,
        description="weights store directory (local or shared by every host); None means run_dir/weights")
    snapshot_every: int = Field(
        1, ge=1,
        description="1: every version is a full snapshot. K > 1: a full snapshot every K versions and deltas "
                    "(what changed, XOR + zlib) in between; a producer rebuilds a delta from the version it holds "
                    "or from the newest snapshot, checked bit for bit against the manifest (docs/weights.md)")
    keep_last: int = Field(
        3, ge=1, description="garbage collection keeps the newest this many versions (chunk topics and files)")
    fetch_timeout_s: float = Field(
        60.0, gt=0,
        description="upper bound on one fetch of a version; a missing or stalled chunk fails the fetch after it")
