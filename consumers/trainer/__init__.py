"""The trainer role (``stream-rl train``): whole groups in, policy versions and checkpoints out.

Modules: :mod:`~consumers.trainer.config` (``cfg.trainer``), :mod:`~consumers.trainer.batcher` (pure group
assembly, dedup, staleness, safe offsets), :mod:`~consumers.trainer.tensors` (pure padding and alignment),
:mod:`~consumers.trainer.train_step` (one training step on ``stream_rl.algorithms``), :mod:`~consumers.trainer.engines`
(torch and DeepSpeed ZeRO; their optimizer-state format: :mod:`~consumers.trainer.optim_state`),
:mod:`~stream_rl.storage.checkpoint` (atomic, pickle-free checkpoints) and
:mod:`~consumers.trainer.trainer` (``run_trainer``, the Kafka shell) with :mod:`~consumers.trainer.intake` (records
in, dropped groups out), :mod:`~consumers.trainer.versions` (policy versions) and :mod:`~consumers.trainer.progress`
(checkpoints and committed offsets); for ``trainer.lora``:
:mod:`~consumers.trainer.lora` (peft adapters on a frozen base) and :mod:`~consumers.trainer.export`
(``stream-rl export``). Importing this package loads neither torch nor
kafka; import the submodules you need.
"""

from consumers.trainer.config import KLConfig, LossConfig, TrainerConfig

__all__ = ["KLConfig", "LossConfig", "TrainerConfig"]
