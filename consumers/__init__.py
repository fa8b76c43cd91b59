"""The roles that consume rollouts: the scorer (``scorer/``, ``stream-rl score``: rollouts in, scored rollouts out)
and the trainer (``trainer/``, ``stream-rl train``: scored rollouts in, weight versions out). Each is a Kafka loop
around a pure step; neither imports the other.
"""
