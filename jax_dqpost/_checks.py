"""How jax_dqpost checks a static (Python) argument and says what is wrong, for every layer: errors that name the
argument and show the value (``TypeError``, ``ValueError``), the ``TypeError`` of a required argument left out,
warnings at the user's line, and the environment flags. No other module of the package is imported here."""

from __future__ import annotations

import functools
import inspect
import numbers
import os
import sys
import traceback
import warnings

import jax
import numpy as np

MAX_HEAD_DIM = 256  # FlashAttention's largest head dimension; the kernel's tiles are sized for it


def describe(value) -> str:
    """``value`` as an error message shows it, in one short line: an array (or anything with a shape and a dtype)
    of one or more dimensions by its shape and dtype, never its values; a sequence whose repr is long by its length; else its repr (cut at
    80 characters) and its type."""
    kind = type(value).__name__
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None and tuple(shape) != ():
        return f"{kind} of shape {tuple(shape)} and dtype {dtype}"
    text = " ".join(repr(value).split())
    if len(text) > 80:
        if isinstance(value, (list, tuple)):
            return f"a {kind} of {len(value)} items"
        text = text[:77] + "..."
    return f"{text} ({kind})"


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


def required_arguments(first=None, /, **hints: str):
    """Decorate a function whose parameters without a default must be passed: a call that leaves one out raises
    ``TypeError`` naming it, followed by ``hints[name]`` (how to choose it), instead of Python's bare message.
    ``first``: None, or a function of the arguments given (a dict by name) called before that, to raise an error
    that says more (what a positional argument was taken for). ``inspect.signature`` and ``help`` show the
    function's own signature."""
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
            if first is not None:
                first(given)
            missing = [name for name in required if name not in given]
            if missing:
                texts = {name: hints.get(name) for name in missing}
                needs = " and ".join(", ".join(f"{name}=" for name in missing).rsplit(", ", 1))
                why = set(texts.values())
                if len(why) == 1:
                    raise TypeError(f"{title}() needs {needs}" + (f": {why.pop()}" if None not in why else ""))
                raise TypeError(f"{title}() needs {needs}. "
                                + " ".join(f"{name}: {t}." for name, t in texts.items() if t))
            return fn(*args, **kwargs)
        return checked
    return wrap


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """Warn at the first frame outside jax_dqpost, jax and jaxlib: the user's line that led here (a lowering runs
    deep inside jax), so that the user's filters and ``-W`` options match it. Python 3.12 skips those files
    itself (``skip_file_prefixes``); 3.11 counts them in the stack ``traceback`` extracts."""
    import jaxlib

    inside = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, jaxlib, sys.modules[__package__]))
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=inside)
        return
    level = 2  # this function's caller; warnings counts no frame of importlib's bootstrap, nor do we
    for frame in traceback.extract_stack()[-2::-1]:
        if "importlib" in frame.filename and "_bootstrap" in frame.filename:
            continue
        if not frame.filename.startswith(inside):
            break
        level += 1
    warnings.warn(message, category, stacklevel=level)


def env_flag(name: str, what: str, default: bool = False) -> bool:
    """Whether the environment variable ``name`` is 1 (0: no; unset or empty: ``default``); ``ValueError`` naming
    it, its value and what 1 does (``what``) for any other value."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1 (or unset), got {value!r} (1 {what})")
    return default if value == "" else value == "1"
