"""What every role process runs with besides Kafka: logging set-up (:mod:`~stream_rl.runtime.logs`) and the crash
points of the recovery drills (:mod:`~stream_rl.runtime.failpoints`)."""
