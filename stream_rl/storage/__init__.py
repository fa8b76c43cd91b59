"""Durable files: the fsync-then-rename write pattern (:mod:`~stream_rl.storage.fsync`) and the trainer's checkpoint
format (:mod:`~stream_rl.storage.checkpoint`: layout, atomic save, load, prune), which operator tools (``stream-rl
gc``) read without importing the trainer."""
