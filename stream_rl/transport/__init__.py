"""Kafka transport edge: the only place that imports kafka-python (see edge.py for the delivery contract);
``memory://<name>`` bootstrap addresses select the in-process bus of :mod:`stream_rl.transport.memory`."""

from stream_rl.transport.edge import (
    BrokerUnreachable,
    Consumed,
    DeliveryError,
    RecordTooLarge,
    Sink,
    Source,
    group_by_partition,
)
from stream_rl.transport.reader import Reader, Record
from stream_rl.transport.topics import LOGICAL_TOPICS, TopicError, TopicNames, ensure_topics, resolve_topic

__all__ = ["BrokerUnreachable", "Consumed", "DeliveryError", "RecordTooLarge", "Sink", "Source", "group_by_partition", "LOGICAL_TOPICS", "TopicError",
           "TopicNames", "ensure_topics", "resolve_topic", "Reader", "Record"]
