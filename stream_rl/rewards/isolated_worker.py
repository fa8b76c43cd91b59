"""The worker process of :mod:`stream_rl.rewards.isolated`: ``python -m stream_rl.rewards.isolated_worker REF``.

Consumes: frames on stdin (u32 length + msgpack ``{"args": [...]}``), the reward function ``REF``.
Produces: one frame per call on the original stdout (``{"value": v}`` or ``{"error": type, "message": str}``),
after a first ``{"ready": bool, "batched": bool}`` frame.
Guarantees: the user function's own prints go to stderr (fd 1 is pointed there before it is imported); a value
msgpack cannot carry becomes that call's error with the reason, never a dead worker; the worker exits when its
stdin closes.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
import os
import struct
import sys
from typing import Any, BinaryIO

import msgpack

_LEN = struct.Struct(">I")
_MAX_REQUEST = 256 << 20


def _send(out: BinaryIO, frame: dict) -> None:
    try:
        data = msgpack.packb(frame, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        data = msgpack.packb({"error": "RewardValueError", "message": f"the reward value cannot be sent: {exc}"})
    out.write(_LEN.pack(len(data)) + data)
    out.flush()


def _receive(inp: BinaryIO) -> dict | None:
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (size,) = _LEN.unpack(head)
    if size > _MAX_REQUEST:
        raise SystemExit(f"reward worker: request of {size} bytes refused")
    return msgpack.unpackb(inp.read(size), raw=False, strict_map_key=False)


def plain(value: Any) -> Any:
    """A reward value as msgpack carries it: numpy scalars and arrays to Python, huge integers refused by name."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        value = int(value)
        if not -(1 << 63) <= value < (1 << 64):
            raise ValueError(f"reward {value if len(str(value)) < 40 else str(value)[:20] + '...'} is an integer "
                             "beyond 64 bits, not a usable reward")
        return value
    if isinstance(value, numbers.Real):  # NaN and inf pass: the contract's check refuses them with its reason
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"reward {str(value)[:20]}... is too large for a float") from None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        return plain(value.tolist())
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    raise ValueError(f"reward returned a {type(value).__name__}, not a number, a dict or a list")


def _answer(fn: Any, args: list[Any], batched: bool) -> dict:
    try:
        value = fn(*args)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        if batched and isinstance(value, (list, tuple)):
            return {"value": [{"error": f"{type(v).__name__}: {v}"} if isinstance(v, Exception) else _one(v)
                              for v in value]}
        return {"value": plain(value)}
    except Exception as exc:  # the user's function failed: that call's error, the worker goes on
        return {"error": type(exc).__name__, "message": str(exc)[:2000]}


def _one(value: Any) -> Any:
    try:
        return plain(value)
    except ValueError as exc:
        return {"error": f"RewardValueError: {exc}"}


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: a worker stalled in a call is killed when the scorer dies, never left burning a core."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before the call above
        raise SystemExit(0)


def main(reference: str) -> int:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "wb")
    inp = os.fdopen(os.dup(0), "rb")
    os.dup2(2, 1)  # the function's prints go to stderr, never into the protocol
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdout = sys.stderr
    try:
        from stream_rl.rewards.calls import is_batched
        from stream_rl.rewards.routing import resolve_fn

        fn = resolve_fn(reference)  # a built-in verifier's short name or package.module:function
        batched = is_batched(fn)
    except Exception as exc:  # noqa: BLE001 - told to the parent, which refuses to start
        _send(out, {"ready": False, "message": f"{type(exc).__name__}: {exc}"})
        return 2
    _send(out, {"ready": True, "batched": batched})
    while (request := _receive(inp)) is not None:
        _send(out, _answer(fn, request["args"], batched))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
