"""The vLLM worker extension a ``vllm serve`` process loads for the ``server`` engine (``--worker-extension-cls
producers.engines.server_worker.StreamRLWorker``).

Consumes: calls through the server's ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``), whose arguments vLLM
passes as strings only: a path to a safetensors file of a complete policy version.
Produces: JSON-able dicts: what the server holds (parameter names and shapes, vocabulary size, logprobs mode), and
the digest of the version it loaded.
Guarantees: ``stream_rl_load`` reads the file in the server's own process (nothing but a path crosses the wire, no
pickle), checks every tensor's name and shape against the checkpoint the server started from before anything is
loaded (a mismatch raises and nothing changes), then reloads in place through the worker's own ``reload_weights``
(vLLM fuses q/k/v and gate/up itself). Imports only torch and safetensors, which every vLLM server has.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def shapes_digest(shapes: dict[str, tuple[int, ...]]) -> str:
    """A short, order-free digest of parameter names and shapes: two checkpoints of one architecture agree."""
    text = json.dumps(sorted((name, list(shape)) for name, shape in shapes.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def safetensors_files(path: str | Path) -> list[Path]:
    """``path`` itself (a file) or the safetensors files of a directory, sorted."""
    path = Path(path)
    return sorted(path.glob("*.safetensors")) if path.is_dir() else [path]


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every tensor of the safetensors files in ``model_dir`` (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def values_digest(model_dir: str | Path) -> str:
    """A digest of the values of every tensor's first row (first 64 values of a vector): cheap to read (slices
    only), and different for two checkpoints of one architecture (a base and its fine-tune, two seeds)."""
    from safetensors import safe_open

    digest = hashlib.sha256()
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            for name in sorted(handle.keys()):
                part = handle.get_slice(name)
                head = part[0:1] if len(part.get_shape()) > 1 else part[0:64]
                digest.update(name.encode() + head.float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class StreamRLWorker:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; ``self`` is the worker."""

    def stream_rl_info(self) -> dict:
        """What this server holds: the checkpoint's shapes digest, vocabulary size, max model length, logprobs
        mode (the ``server`` engine refuses a server whose answers would not be behaviour logprobs)."""
        model_config = self.vllm_config.model_config
        return {"shapes_digest": shapes_digest(checkpoint_shapes(model_config.model)),
                "values_digest": values_digest(model_config.model),
                "vocab_size": int(model_config.get_vocab_size()),
                "max_model_len": int(model_config.max_model_len),
                "logprobs_mode": str(model_config.logprobs_mode),
                "dtype": str(model_config.dtype).removeprefix("torch.")}

    def stream_rl_load(self, path: str) -> dict:
        """Load the complete version in the safetensors file ``path``, or in the safetensors files of the
        directory ``path`` (a checkpoint: version 0), all or nothing (see the module)."""
        from safetensors.torch import load_file

        expected = checkpoint_shapes(self.vllm_config.model_config.model)
        tensors = {}
        for file in safetensors_files(path):
            tensors.update(load_file(str(file)))
        given = {name: tuple(t.shape) for name, t in tensors.items()}
        if given != expected:
            missing = sorted(set(expected) - set(given))[:3]
            unexpected = sorted(set(given) - set(expected))[:3]
            raise ValueError(f"{path} does not fit the served model (missing {missing}, unexpected {unexpected})")
        dtype = self.vllm_config.model_config.dtype
        weights = [(name, t.to(dtype) if t.is_floating_point() else t) for name, t in tensors.items()]
        self.reload_weights(weights_iterator=weights)
        return {"loaded": path, "shapes_digest": shapes_digest(given)}
