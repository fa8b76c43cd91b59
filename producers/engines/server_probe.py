"""Whether an inference server can serve the ``server`` engine, and bringing it to a policy version.

Consumes: a server's base URL and the policy's checkpoint directory (``producer.model_dir``).
Produces: :class:`ServerInfo` (vocabulary size, max model length, the version it is labelled with), or raises
:class:`~producers.engines.base.EngineError` with one line saying what is wrong and how to start the server right;
:func:`push_version` loads a version into a server.
Guarantees: a server is refused when it cannot be reached, runs a vLLM outside the tested range (``/version``,
:data:`producers.engines.vllm_args.TESTED_RANGE`), is not a vLLM server with the RL endpoints
(``VLLM_SERVER_DEV_MODE=1``), lacks the worker extension, serves another model (parameter names and shapes, or
the values of the checkpoint's smallest tensor, differ from ``model_dir``), returns logprobs other than those of
the sampled distribution, has the token-in/token-out endpoint disabled, or answers a one-token probe without token
ids, logprobs or version spans. :func:`push_version` pauses keeping requests and always resumes, also on failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from producers.engines.base import EngineError
from producers.engines.server_http import ServerDown, ServerRefused, call
from producers.engines.server_worker import checkpoint_shapes, shapes_digest, values_digest

EXTENSION = "producers.engines.server_worker.StreamRLWorker"
SERVER_FLAGS = ("--enable-scale-out", "--logprobs-mode processed_logprobs", f"--worker-extension-cls {EXTENSION}")
HOW = f"start it with VLLM_SERVER_DEV_MODE=1 and {' '.join(SERVER_FLAGS)} (stream-rl run does)"


@dataclass(frozen=True)
class ServerInfo:
    vocab_size: int
    max_model_len: int
    version: int | None  # the stream-rl version it is labelled with (None: not one of ours)


def rpc(url: str, method: str, args: list[str], timeout_s: float) -> dict:
    """One worker-extension call through ``/collective_rpc``; the first worker's answer."""
    try:
        answer = call(url, "POST", "/collective_rpc", {"method": method, "args": args}, timeout_s)
    except ServerRefused as exc:
        if exc.status == 404:
            raise EngineError(f"{url} has no /collective_rpc: {HOW}") from exc
        raise
    except ServerDown as exc:
        if "has no attribute" in str(exc):
            raise EngineError(f"{url} was started without the stream-rl worker extension: {HOW}") from exc
        raise
    results = answer.get("results") if isinstance(answer, dict) else None
    if not results or not isinstance(results[0], dict):
        raise EngineError(f"{url}: /collective_rpc {method} answered {answer!r}")
    return results[0]


@dataclass(frozen=True)
class Fingerprint:
    """What a server must match of the policy's checkpoint (read once per engine, not once per server)."""

    model_dir: Path
    shapes: str  # digest of parameter names and shapes
    values: str  # digest of each tensor's first row

    @classmethod
    def of(cls, model_dir: Path) -> Fingerprint:
        return cls(model_dir, shapes_digest(checkpoint_shapes(model_dir)), values_digest(model_dir))


def probe_server(url: str, expected: Fingerprint, timeout_s: float) -> ServerInfo:
    """Check ``url`` as the module says against the policy's ``expected`` fingerprint; its :class:`ServerInfo`."""
    try:
        call(url, "GET", "/v1/models", timeout_s=min(timeout_s, 30.0))
    except ServerDown as exc:
        raise EngineError(f"cannot reach {url}: {exc}") from exc
    except ServerRefused as exc:
        raise EngineError(f"{url} is not an OpenAI-compatible server (GET /v1/models: {exc})") from exc
    _check_version(url, timeout_s)
    info = rpc(url, "stream_rl_info", [], timeout_s)
    if info.get("shapes_digest") != expected.shapes:
        raise EngineError(f"{url} serves another model: its parameter names or shapes differ from those of "
                          f"producer.model_dir {expected.model_dir}")
    if info.get("values_digest") != expected.values:
        raise EngineError(f"{url} serves another checkpoint of this architecture: its weights differ from those of "
                          f"producer.model_dir {expected.model_dir}")
    if info.get("logprobs_mode") != "processed_logprobs":
        raise EngineError(f"{url} returns {info.get('logprobs_mode')} logprobs, not those of the distribution it "
                          f"samples from: {HOW}")
    _probe_generate(url, timeout_s)
    label = str(call(url, "GET", "/weight_info", timeout_s=timeout_s).get("weight_version"))
    return ServerInfo(int(info["vocab_size"]), int(info["max_model_len"]), int(label) if label.isdigit() else None)


def _check_version(url: str, timeout_s: float) -> None:
    """The server's vLLM must be in the range the worker extension and the endpoints were checked in: the extension
    calls the worker's ``reload_weights``, and the engine reads ``/inference/v1/generate``'s version spans."""
    from producers.engines.vllm_args import TESTED_RANGE, in_tested_range

    answer = call(url, "GET", "/version", timeout_s=timeout_s)
    version = str(answer.get("version")) if isinstance(answer, dict) else ""
    if not in_tested_range(version):
        raise EngineError(f"{url} runs vLLM {version or '(unknown version)'}; the server engine is tested with "
                          f"vllm>={TESTED_RANGE[0]},<{TESTED_RANGE[1]} (its worker extension uses the worker's "
                          f"reload_weights)")


def _probe_generate(url: str, timeout_s: float) -> None:
    body = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "logprobs": 0, "temperature": 1.0, "seed": 0},
            "output_mode": "tokens"}
    try:
        answer = call(url, "POST", "/inference/v1/generate", body, timeout_s)
    except ServerRefused as exc:
        raise EngineError(f"{url} refuses token-in/token-out generation ({exc.message}): {HOW}") from exc
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if choices else {}
    if not choice.get("token_ids"):
        raise EngineError(f"{url} answers without token ids: {HOW}")
    if not (choice.get("logprobs") or {}).get("content"):
        raise EngineError(f"{url} answers without logprobs: {HOW}")
    if not choice.get("weight_versions"):
        raise EngineError(f"{url} answers without weight version spans (vLLM >= 0.32 needed)")


def push_version(url: str, path: Path, version: int, idle: bool, timeout_s: float) -> None:
    """Load ``path`` (a version file, or the checkpoint directory for version 0) into ``url`` and label it
    ``version``, paused keeping in-flight requests; the prefix cache is reset when ``idle``."""
    call(url, "POST", "/pause?mode=keep", timeout_s=timeout_s)
    try:
        rpc(url, "stream_rl_load", [str(path)], timeout_s)
        call(url, "POST", "/update_weight_version", {"new_version": str(version)}, timeout_s)
        if idle:
            call(url, "POST", "/reset_prefix_cache", timeout_s=timeout_s)
    finally:
        call(url, "POST", "/resume", timeout_s=timeout_s)
