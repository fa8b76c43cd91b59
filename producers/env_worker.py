"""The child process of an isolated environment (``python -m producers.env_worker REFERENCE``; see
:mod:`producers.env_process`).

Consumes: length-prefixed msgpack frames on stdin: ``{"op": "reset", "prompt": <Prompt wire bytes>}`` once, then
``{"op": "step", "text": str}`` per policy turn.
Produces: one frame per request on the protocol channel: ``{"ok": true, "value": ...}`` (a step's value is an
:class:`~producers.environment.Observation` as a map) or ``{"ok": false, "error": "Type: message"}``.
Guarantees: the environment is made at the first ``reset``, with the same loader as in the producer
(:func:`producers.environment.load_environment`); anything it prints goes to stderr (the protocol runs on a private
copy of the original stdout); it ends when stdin closes.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import sys

import msgpack

_HEADER = struct.Struct(">I")


def _read(stream, size: int) -> bytes | None:
    data = stream.read(size)
    return data if data is not None and len(data) == size else None


def _answer(out, value: dict) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    out.write(_HEADER.pack(len(body)) + body)
    out.flush()


def main(reference: str) -> None:
    from producers.environment import load_environment
    from producers.multiturn import as_observation
    from schemas import decode

    out = os.fdopen(os.dup(1), "wb")  # the protocol's channel; the environment's prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    env = None
    while (header := _read(sys.stdin.buffer, _HEADER.size)) is not None:
        request = msgpack.unpackb(_read(sys.stdin.buffer, _HEADER.unpack(header)[0]) or b"", raw=False)
        try:
            if env is None:  # the reference loads here, so that a failure to load is the call's answer
                env = load_environment(reference).make()
            if request["op"] == "reset":
                env.reset(decode(request["prompt"], "prompt"))
                value = None
            else:
                value = dataclasses.asdict(as_observation(env.step(request["text"])))
            _answer(out, {"ok": True, "value": value})
        except Exception as exc:  # the environment's failure is this call's answer, not this process's end
            _answer(out, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main(sys.argv[1])
