"""Record batches the client cannot read: where they are, so the consumer can dead-letter them and seek past.

Consumes: an exception raised by ``KafkaConsumer.poll`` and that consumer.
Produces: an :class:`Unreadable` (partition, first and last offset of what cannot be read, reason) or ``None``
when the exception is not about reading a batch (a network or authorisation error, which must propagate).
Guarantees: a batch is recognised as unreadable when the error is one of kafka-python's record errors
(``UnsupportedCodecError``, ``CorruptRecordError``, ``RecordTooLargeError``) or any error raised while kafka-python
unpacked a fetched batch (a codec library failing on a corrupt payload). The range never reaches past the batch:
``first`` is the consumer's position (kafka-python leaves it on the first record it could not return) and
``last`` is the batch's last offset when its header is trustworthy (a CRC failure may have corrupted it: then
only ``first`` is skipped, and the next poll finds the rest one offset at a time), so no readable record is
skipped.

How (kafka-python 3.0.12 internals, isolated here): the fetcher unpacks batches in a generator,
``Fetcher.PartitionRecords._unpack_records``, whose frame is in the exception's traceback, even when the
exception was parked and re-raised by a later poll; its locals name the partition (``self.topic_partition``)
and the batch (``batch``: ``base_offset``, ``last_offset``). ``RecordTooLargeError`` carries ``{tp: offset}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_UNPACK_FRAME = "_unpack_records"
MAX_BATCH_SPAN = 100_000
"""A batch header claiming more offsets than this after a CRC failure is not trusted."""


@dataclass(frozen=True)
class Unreadable:
    """Offsets ``first..last`` of partition ``tp`` cannot be read; ``reason`` names the error."""

    tp: Any
    first: int
    last: int
    reason: str
    error_type: str


@dataclass(frozen=True)
class SkippedRecord:
    """Stands for one offset of an unreadable batch in a group-less read (``stream-rl replay``): the fields of a
    :class:`~stream_rl.transport.reader.Record`, with no key, value or headers, plus the reason."""

    topic: str
    partition: int
    offset: int
    reason: str
    error_type: str
    key: bytes | None = None
    value: bytes | None = None
    headers: tuple = ()
    timestamp_ms: int = -1

    @classmethod
    def each(cls, where: Unreadable) -> list[SkippedRecord]:
        return [cls(where.tp.topic, where.tp.partition, offset, where.reason, where.error_type)
                for offset in range(where.first, where.last + 1)]


def _unpack_frame_locals(exc: BaseException) -> dict[str, Any] | None:
    tb = exc.__traceback__
    found = None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == _UNPACK_FRAME:
            found = tb.tb_frame.f_locals
        tb = tb.tb_next
    return found


def _known_record_error(exc: BaseException) -> bool:
    from kafka.consumer.fetcher import RecordTooLargeError
    from kafka.errors import CorruptRecordError, UnsupportedCodecError

    return isinstance(exc, (UnsupportedCodecError, CorruptRecordError, RecordTooLargeError))


def find_unreadable(consumer, exc: BaseException) -> Unreadable | None:
    """Where the batch that made ``consumer.poll`` raise ``exc`` lies, or None if ``exc`` is not about a batch."""
    error_type = type(exc).__name__
    reason = f"record batch cannot be read by the client: {error_type}: {exc}"[:2000]
    too_large = exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], dict) else None
    if too_large and _known_record_error(exc):
        tp, offset = next(iter(too_large.items()))
        return Unreadable(tp, int(offset), int(offset), reason, error_type)
    frame = _unpack_frame_locals(exc)
    if frame is None or "self" not in frame:
        return None  # not raised while unpacking a batch: not ours to swallow
    tp = frame["self"].topic_partition
    first = consumer.position(tp)
    batch = frame.get("batch")
    last = first
    if batch is not None:
        claimed, highwater = int(batch.last_offset), consumer.highwater(tp)
        trusted = not _is_crc_error(exc) or (claimed - first < MAX_BATCH_SPAN
                                             and (highwater is None or claimed < highwater))
        if trusted and claimed >= first:
            last = claimed
    return Unreadable(tp, first, last, reason, error_type)


def _is_crc_error(exc: BaseException) -> bool:
    from kafka.errors import CorruptRecordError

    return isinstance(exc, CorruptRecordError)
