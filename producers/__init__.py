"""The producer role (``stream-rl produce``): prompts in, groups of sampled rollouts out.

``role.py`` is the Kafka loop around the pure step ``step.py``; around them: publishing a batch (``publish.py``),
the opt-in parts built at start-up (``parts.py``), the backpressure budget (``budget.py``, ``stale_feed.py``),
epoch order (``epoch_gate.py``), weight following (``weights_follower.py``), durable partial rollouts
(``partials.py``), multi-turn episodes (``multiturn.py``, ``chat_turns.py``, ``environment.py``, ``hub_envs.py``)
and the config section (``config.py``). Also here: the generation engines (``engines/``: hf, in-process vLLM, the
server fleet), which the evaluator uses too, and the agents' gateway (``gateway/``, ``stream-rl gateway``).
"""
