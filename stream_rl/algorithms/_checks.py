"""Argument checks shared by the algorithm modules (private).

Every public function validates its arguments up front and raises ``ValueError`` with a message that names the
offending argument, so a shape or configuration mistake fails at the call rather than as a silent wrong number.

Mask convention: a mask is ``[B, T]``, bool or numeric with values in {0, 1}; 1 marks a response token. Functions
whose formula walks along time (returns, GAE, REINFORCE++) additionally require the mask to be right-padded, i.e.
the valid tokens of each row form a prefix. The data checks (values, prefix) read the mask once on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def check_tensor(x: object, name: str, ndim: int | None = None) -> Tensor:
    """Return ``x`` if it is a tensor with ``ndim`` dimensions (any when None); raise ValueError otherwise."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(x.shape)}")
    return x


def check_float(x: object, name: str, ndim: int | None = None) -> Tensor:
    """Like :func:`check_tensor`, and the dtype must be floating point."""
    t = check_tensor(x, name, ndim)
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def check_same_shape(ref: Tensor, ref_name: str, **others: Tensor | None) -> None:
    """Raise ValueError naming the first tensor in ``others`` whose shape differs from ``ref``'s (None is skipped)."""
    for name, x in others.items():
        if x is None:
            continue
        check_tensor(x, name)
        if x.shape != ref.shape:
            raise ValueError(
                f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(x.shape)}")


def check_choice(value: object, name: str, choices: Sequence[str]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(map(repr, choices))}")


def check_unit_interval(value: float, name: str) -> float:
    """Return ``value`` as a float if it lies in [0, 1]; raise ValueError otherwise."""
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def check_positive(value: float, name: str) -> float:
    """Return ``value`` as a float if it is > 0 (and finite); raise ValueError otherwise."""
    value = float(value)
    if not 0.0 < value < float("inf"):
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def as_bool_mask(mask: object, like: Tensor, like_name: str, *, prefix: bool = False) -> Tensor:
    """Validate ``mask`` against ``like`` and return it as a bool tensor of the same shape.

    Raises ValueError if ``mask`` is not a tensor, its shape differs from ``like``'s, its values are not 0/1, or
    (``prefix=True``) some row has a valid token after a padding token.
    """
    m = check_tensor(mask, "mask")
    if m.shape != like.shape:
        raise ValueError(f"mask must have the shape of {like_name} {tuple(like.shape)}, got {tuple(m.shape)}")
    if m.dtype != torch.bool:
        if m.is_complex():
            raise ValueError(f"mask must be bool or real-valued, got dtype {m.dtype}")
        if not bool(((m == 0) | (m == 1)).all()):
            raise ValueError("mask values must be 0 or 1")
        m = m != 0
    if m.device != like.device:
        raise ValueError(f"mask is on {m.device} but {like_name} is on {like.device}")
    if prefix and m.shape[-1] > 1 and bool((m[..., 1:] & ~m[..., :-1]).any()):
        raise ValueError("mask must be right-padded: the valid tokens of each row must form a prefix")
    return m
