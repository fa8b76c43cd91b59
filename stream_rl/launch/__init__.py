"""``stream-rl run``: the whole pipeline as processes on one machine (:mod:`~stream_rl.launch.orchestrator`) and
where they run (:mod:`~stream_rl.launch.placement`: cores, threads, partition counts)."""
