"""``stream-rl run``: the whole pipeline as processes on one machine (:mod:`~stream_rl.launch.orchestrator`), where
they run (:mod:`~stream_rl.launch.placement`: cores, threads, partition counts; :mod:`~stream_rl.launch.gpus`: the
GPUs each role sees and its share of them) and the inference servers it starts for ``producer.engine = "server"``
(:mod:`~stream_rl.launch.servers`)."""
