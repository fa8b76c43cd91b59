"""What every role process runs with besides Kafka: logging set-up (:mod:`~stream_rl.runtime.logs`), the crash
points of the recovery drills (:mod:`~stream_rl.runtime.failpoints`), socket deadlines with the bounded HTTP
handler that the reward server and the gateway serve with (:mod:`~stream_rl.runtime.http_serving`), the loader of
``package.module:name`` references to user code (:mod:`~stream_rl.runtime.references`) and a follower of a
JSON-lines file another process appends to (:mod:`~stream_rl.runtime.appended`)."""
