"""Checks of static (Python) arguments shared by the API, AccumLayout and the tools: errors name the argument and
show the value and its type. A leaf module (no package imports)."""

from __future__ import annotations

import numbers

import numpy as np

MAX_HEAD_DIM = 256  # FlashAttention's largest head dimension; the kernel's tiles are sized for it


def describe(value) -> str:
    """``value`` as an error message shows it: its repr and its type."""
    return f"{value!r} ({type(value).__name__})"


def static_int(name: str, value, *, minimum: int | None = None) -> int:
    """``value`` as a Python int; ``TypeError`` unless it is an integer (bools are not), ``ValueError`` below
    ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a Python int, got {describe(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def static_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {describe(value)}")
    return bool(value)


def head_dim(value, name: str = "head_dim") -> int:
    """A head dimension: a Python int, a positive multiple of 8, at most 256."""
    value = static_int(name, value)
    if value <= 0 or value % 8 or value > MAX_HEAD_DIM:
        raise ValueError(f"{name} must be a positive multiple of 8 and at most {MAX_HEAD_DIM}, got {value}")
    return value
