"""What every role process runs with besides Kafka: logging set-up (:mod:`~stream_rl.runtime.logs`), the crash
points of the recovery drills (:mod:`~stream_rl.runtime.failpoints`), socket deadlines with the bounded HTTP
server and handler that the reward server and the gateway serve with (a cap on connections, a deadline on each
request and answer: :mod:`~stream_rl.runtime.http_serving`) and the loader of ``package.module:name`` references to
user code (:mod:`~stream_rl.runtime.references`)."""
