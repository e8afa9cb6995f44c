"""Checks of static (Python) arguments shared by the API, AccumLayout, arch and precompile: errors name the argument
and show the value and its type. A leaf module (no package imports)."""

from __future__ import annotations

import functools
import inspect
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


def required_arguments(**hints: str):
    """Decorate a function whose parameters without a default must be passed: a call that leaves one out raises
    ``TypeError`` naming it, followed by ``hints[name]`` (how to choose it: a string, or a function that returns one,
    called only then), instead of Python's bare message. ``inspect.signature`` and ``help`` show the function's own
    signature."""
    def wrap(fn):
        signature = inspect.signature(fn)
        required = [name for name, p in signature.parameters.items() if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        title = fn.__qualname__.removesuffix(".__init__")

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            try:
                given = signature.bind_partial(*args, **kwargs).arguments
            except TypeError as e:
                shown = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
                shown = signature.replace(parameters=shown[1 if required[:1] in (["cls"], ["self"]) else 0:],
                                          return_annotation=signature.empty)
                raise TypeError(f"{title}(): {e}; the signature is {title}{shown}") from None
            missing = [name for name in required if name not in given]
            if missing:
                texts = {name: hints.get(name) for name in missing}
                texts = {name: t() if callable(t) else t for name, t in texts.items()}
                needs = " and ".join(", ".join(f"{name}=" for name in missing).rsplit(", ", 1))
                why = set(texts.values())
                if len(why) == 1:
                    raise TypeError(f"{title}() needs {needs}" + (f": {why.pop()}" if None not in why else ""))
                raise TypeError(f"{title}() needs {needs}. "
                                + " ".join(f"{name}: {t}." for name, t in texts.items() if t))
            return fn(*args, **kwargs)
        return checked
    return wrap
