"""Figures at a readable scale, each with its unit: parameter counts (``1.23 M``, ``8.03 B``) and bytes
(``512 B``, ``1.5 MiB``, ``12.3 GiB``).

Consumes: numbers. Produces: strings.
Guarantees: three significant digits (no exponent), the largest unit whose value is at least 1 (binary units for
bytes, decimal K/M/B/T for counts); pure.
"""

from __future__ import annotations

def _digits(v: float) -> str:
    """Three significant digits, without an exponent (``999.7`` -> ``1000``, ``12.34`` -> ``12.3``)."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


_COUNT_UNITS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))
_BYTE_UNITS = ((1024**4, "TiB"), (1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB"))


def human_count(n: float) -> str:
    """``1234567`` -> ``1.23 M``; ``8030261248`` -> ``8.03 B``; under 1000 the number itself."""
    for scale, unit in _COUNT_UNITS:
        if abs(n) >= scale:
            return f"{_digits(n / scale)} {unit}"
    return _digits(n)


def human_bytes(n: float) -> str:
    """``512`` -> ``512 B``; ``1572864`` -> ``1.5 MiB``; ``13207024435`` -> ``12.3 GiB``."""
    for scale, unit in _BYTE_UNITS:
        if abs(n) >= scale:
            return f"{_digits(n / scale)} {unit}"
    return f"{_digits(n)} B"


def human_gib(gib: float) -> str:
    """A size given in GiB (``--gpu-memory-gib``) at its readable scale: ``80`` -> ``80 GiB``."""
    return human_bytes(gib * 1024**3)
