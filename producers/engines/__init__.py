"""Generation engines behind one interface (``base.GenerationEngine``): ``hf``, ``vllm`` (in-process) and
``server`` (a fleet of ``vllm serve`` processes).

Consumes: a :class:`~producers.config.ProducerConfig`. Produces: a ready engine at policy version 0.
Guarantees: importing this package imports neither torch nor vLLM; each engine module is imported on demand; the
engine returned can sample as the section says (``GenerationEngine.check_sampling``: a stop string the tokenizer
cannot write or a stop token id outside the vocabulary is refused here, naming the field, and the engine closed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from producers.engines.base import EngineError, GenerationEngine, Sample, Sampling, WeightsMismatch, prompt_seed

if TYPE_CHECKING:
    from producers.config import ProducerConfig

__all__ = ["EngineError", "GenerationEngine", "Sample", "Sampling", "WeightsMismatch", "build_engine", "prompt_seed"]


def build_engine(cfg: ProducerConfig) -> GenerationEngine:
    """The engine ``cfg.engine`` names, loaded from ``cfg.model_dir`` (version 0), checked against the section's
    sampling settings."""
    engine = _load(cfg)
    try:
        engine.check_sampling(cfg.sampling())
    except EngineError:
        engine.close()
        raise
    return engine


def _load(cfg: ProducerConfig) -> GenerationEngine:
    if cfg.engine == "hf":
        from producers.engines.hf import HFEngine

        return HFEngine.from_dir(cfg.model_dir, device=cfg.device, dtype=cfg.dtype)
    if cfg.engine == "vllm":
        from producers.engines.vllm import VLLMEngine

        return VLLMEngine(cfg.model_dir, settings=cfg.vllm, dtype=cfg.dtype, seed=cfg.seed)
    if cfg.engine == "server":
        from producers.engines.server import ServerEngine

        return ServerEngine(cfg.model_dir, settings=cfg.server)
    raise EngineError(f"unknown engine {cfg.engine!r} (expected 'hf', 'vllm' or 'server')")
