#!/usr/bin/env python3
"""Print stream-rl records as JSON lines; needs only the `msgpack` package. Layout: docs/wire-format.md.

Input (FILE or stdin): record values, each after its length as a 4-byte big-endian signed int (-1: null value):
    kcat -C -b HOST:PORT -t TOPIC -e -f '%R%s' | python3 ops/wire_reader.py
or, with --raw, one bare value. Output: one JSON object per record; arrays ({dtype, shape, data} maps) as nested
lists of numbers, other bytes as base64 strings, a null value as null.
"""
import base64, json, math, struct, sys

import msgpack

CODES = {"|i1": "b", "|u1": "B", "<i2": "h", "<u2": "H", "<i4": "i", "<u4": "I", "<i8": "q", "<u8": "Q",
         "<f2": "e", "<f4": "f", "<f8": "d"}


def nest(flat, shape):
    step = math.prod(shape[1:])
    return flat[0] if not shape else flat if len(shape) == 1 else [
        nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def plain(obj):
    if isinstance(obj, dict) and obj.get("dtype") in CODES and isinstance(obj.get("data"), bytes):
        code, data = CODES[obj["dtype"]], obj["data"]
        return nest(struct.unpack(f"<{len(data) // struct.calcsize(code)}{code}", data), obj["shape"])
    if isinstance(obj, (dict, list)):
        return {k: plain(v) for k, v in obj.items()} if isinstance(obj, dict) else [plain(v) for v in obj]
    return base64.b64encode(obj).decode("ascii") if isinstance(obj, bytes) else obj


def values(stream):
    while header := stream.read(4):
        if len(header) != 4:
            sys.exit("wire_reader: truncated length prefix")
        (size,) = struct.unpack(">i", header)
        value = None if size < 0 else stream.read(size)
        if value is not None and len(value) != size:
            sys.exit(f"wire_reader: truncated value ({len(value)} of {size} bytes)")
        yield value


if __name__ == "__main__":
    args = [arg for arg in sys.argv[1:] if arg != "--raw"]
    with open(args[0], "rb") if args else sys.stdin.buffer as stream:
        for value in [stream.read()] if "--raw" in sys.argv else values(stream):
            record = None if value is None else msgpack.unpackb(value, raw=False, strict_map_key=True)
            print(json.dumps(plain(record), ensure_ascii=False))
