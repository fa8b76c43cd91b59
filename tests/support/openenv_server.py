"""A real OpenEnv server for the served-environment tests: openenv-core's own FastAPI app (``create_fastapi_app``:
``/health``, ``/schema``, ``/metadata`` and the ``/ws`` sessions) under uvicorn, serving a class of
:mod:`support.openenv_guess` on 127.0.0.1.

``python -m support.openenv_server CLASS [MAX_SESSIONS]`` binds a free port, prints it on its first line, then
serves; :func:`served` runs that as a child process for a test and kills it afterwards."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from support.paths import TESTS_DIR


@contextlib.contextmanager
def served(cls_name: str = "GuessDigit", sessions: int = 4) -> Iterator[tuple[str, subprocess.Popen]]:
    """(its ``http://127.0.0.1:PORT`` URL, its process) while the server runs; killed on exit."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "support.openenv_server", cls_name, str(sessions)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the OpenEnv server {cls_name} did not start") from None
                time.sleep(0.2)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str]) -> None:
    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app

    from support import openenv_guess

    cls = getattr(openenv_guess, argv[0])
    sessions = int(argv[1]) if len(argv) > 1 else 4
    app = create_fastapi_app(cls, openenv_guess.GuessAction, openenv_guess.GuessObservation,
                             max_concurrent_envs=sessions)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1:])
