"""What every role process runs with besides Kafka: logging set-up (:mod:`~stream_rl.runtime.logs`), the crash
points of the recovery drills (:mod:`~stream_rl.runtime.failpoints`), and socket deadlines with the bounded HTTP
handler that the reward server and the gateway serve with (:mod:`~stream_rl.runtime.http_serving`)."""
