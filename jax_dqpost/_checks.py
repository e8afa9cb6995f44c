"""The rules for what a user passes, in one place, for every entry point: static (Python) arguments of the API,
``AccumLayout``, the presets, ``arch`` and precompile; the output dtype; offsets and lengths a host can see; and,
under ``jax.experimental.checkify``, traced ones on the device. Errors name the argument and show the value
(``TypeError``, ``ValueError``). It imports only ``abi`` and ``varlen`` (leaves) of the package. Where an argument
becomes an operand (``_operands.py``), its type is checked as it is converted; the shapes are checked by the plan
in abstract evaluation, also under vmap and sharding (``plan.py``)."""

from __future__ import annotations

import functools
import inspect
import numbers
import os
import sys
import traceback
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from . import abi
from .varlen import INT32_MAX

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


class ArgNames(NamedTuple):
    """What the API calls one tensor's arguments: errors name the argument the caller passed."""

    accum: str
    seqlen: str
    total: str
    cu_seqlens: str
    seqused: str
    head_dim: str


ARG_NAMES = {
    "dq": ArgNames("dq_accum", "seqlen_q", "total_q", "cu_seqlens_q", "seqused_q", "head_dim"),
    "dk": ArgNames("dk_accum", "seqlen_k", "total_k", "cu_seqlens_k", "seqused_k", "head_dim"),
    "dv": ArgNames("dv_accum", "seqlen_k", "total_k", "cu_seqlens_k", "seqused_k", "head_dim_v"),
}
"""The names of each tensor's arguments (``dq_postprocess`` and ``dq_accum_from_dq`` use dQ's)."""


OUT_DTYPE_SPELLINGS = {"bf16": np.dtype(jnp.bfloat16), "bfloat16": np.dtype(jnp.bfloat16),
                       "fp16": np.dtype(jnp.float16), "f16": np.dtype(jnp.float16), "float16": np.dtype(jnp.float16)}
"""The names the API takes for the output dtype (``dtype=``, and precompile's ``--dtypes``); other strings that
numpy reads as float16 (``"half"``, ``"e"``, ``"f2"``) are refused."""
_OUT_DTYPE_WANT = ("dtype must be jnp.bfloat16 or jnp.float16 (or "
                   + ", ".join(repr(name) for name in OUT_DTYPE_SPELLINGS) + ")")


def out_dtype(dtype) -> np.dtype:
    """dQ's dtype: bfloat16 or float16, as a dtype or one of the names of :data:`OUT_DTYPE_SPELLINGS`; ``None`` is
    not float64 here."""
    if isinstance(dtype, str) and dtype in OUT_DTYPE_SPELLINGS:
        return OUT_DTYPE_SPELLINGS[dtype]
    out = abi.dtype_of(dtype)
    if out is None:
        raise TypeError(f"{_OUT_DTYPE_WANT}, got {describe(dtype)}")
    if out not in abi.OUT_DTYPES:
        raise ValueError(f"{_OUT_DTYPE_WANT}, got {out.name}")
    if isinstance(dtype, str):  # numpy's other names of float16
        raise ValueError(f"{_OUT_DTYPE_WANT}, got {dtype!r} (numpy's name for {out.name})")
    return out


def check_offsets(cu_seqlens, seqused, total: int, names) -> None:
    """Validate static offsets at trace time: ValueError naming the argument and the bad value (``names``: the
    arguments' names, an :class:`ArgNames`)."""
    cu_n, used_n, total_n = names.cu_seqlens, names.seqused, names.total
    cu = list(cu_seqlens)
    if not cu:
        raise ValueError(f"{cu_n} must have batch + 1 entries (at least 1), got {cu}")
    if cu[0] < 0:
        raise ValueError(f"{cu_n}[0] must be >= 0, got {cu[0]}")
    for b in range(len(cu) - 1):
        if cu[b + 1] < cu[b]:
            raise ValueError(f"{cu_n} must be non-decreasing, got {cu_n}[{b}]={cu[b]} > {cu_n}[{b + 1}]={cu[b + 1]}")
    if cu[-1] > total:
        raise ValueError(f"{cu_n}[-1]={cu[-1]} exceeds {total_n}={total}")
    if seqused is not None:
        used = list(seqused)
        if len(used) != len(cu) - 1:
            raise ValueError(f"{used_n} must have batch={len(cu) - 1} entries, got {len(used)}")
        for b, u in enumerate(used):
            if not 0 <= u <= cu[b + 1] - cu[b]:
                raise ValueError(f"{used_n}[{b}]={u} must be in [0, {cu[b + 1] - cu[b]}] (the length of sequence "
                                 f"{b} in {cu_n})")


def check_dense_seqused(used: list[int], seqlen: int, names: ArgNames) -> None:
    bad = [(b, u) for b, u in enumerate(used) if not 0 <= u <= seqlen]
    if bad:
        raise ValueError(f"{names.seqused}[{bad[0][0]}]={bad[0][1]} must be in [0, {names.seqlen}={seqlen}]")


def static_ints(name: str, x) -> list[int]:
    if isinstance(x, (list, tuple)) and any(isinstance(v, jax.core.Tracer) for v in x):
        raise TypeError(f"{name} is a Python {type(x).__name__} of traced values (a list passed through jax.jit "
                        "has traced items): pass a jax int32 array for offsets read at run time, or keep the list "
                        "static (static_argnums or static_argnames of jax.jit, or a closure) for a launch grid "
                        "fitted to its values")
    arr = np.asarray(x)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{name} must be a 1-D sequence of ints, got {describe(x)}")
    return [int(v) for v in arr]


def check_rows_fit_int32(name: str, value: int, rows: int) -> None:
    """The one check that a side's rows fit the kernel's int32 row offsets, for dense and packed sides alike:
    ``rows`` is what the accumulator holds with its padding."""
    if rows > INT32_MAX:
        raise ValueError(f"{name}={value} is too large: the accumulator's {rows} rows (with padding) do not fit the "
                         f"kernel's int32 row offsets (at most {INT32_MAX})")


def check_finite_f32(name: str, value) -> None:
    """``ValueError`` unless ``value`` (a Python real) rounds to a finite float32."""
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond float64
        as_float = float("inf")
    with np.errstate(over="ignore", invalid="ignore"):
        finite = bool(np.isfinite(np.float32(as_float)))
    if not finite:
        shown = repr(value)
        raise ValueError(f"{name} must be finite in float32, got {shown if len(shown) <= 40 else shown[:37] + '...'}")


# ---- checks of traced values, on the device: the same rules and messages as the trace-time checks of the values a
# host can see, with the first bad index and its value
CHECKIFY_ENV = "JAX_DQPOST_CHECKIFY"
"""Set to 1 to check traced offsets, lengths and scales on the device, under ``jax.experimental.checkify``."""


def device_checks() -> bool:
    """Whether ``JAX_DQPOST_CHECKIFY=1`` asks for the device checks (unset, empty or 0: no; ``ValueError`` for any
    other value). Read each time a call is traced, so a value set after ``import jax_dqpost`` counts from the next
    trace (a function jax has already traced and cached keeps what it traced: ``jax.clear_caches()`` forgets it).
    On, each check is a ``checkify.debug_check``, reported in a function ``jax.experimental.checkify.checkify``
    transforms and dropped in one it does not; but it is an effect of the traced function (``jax.export`` cannot
    serialize it), so off (the default) nothing is traced."""
    return env_flag(CHECKIFY_ENV, "checks traced offsets, lengths and scales on the device under "
                                  "jax.experimental.checkify")


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


def env_flag(name: str, what: str) -> bool:
    """Whether the environment variable ``name`` is 1 (unset, empty or 0: no); ``ValueError`` naming it, its value
    and what 1 does (``what``) for any other value."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1 (or unset), got {value!r} (1 {what})")
    return value == "1"


device_checks()  # a bad JAX_DQPOST_CHECKIFY fails here, at import, on every platform


def device_check_offsets(cu, used, total: int, names: ArgNames) -> None:
    if not device_checks():
        return
    cu_n, used_n, total_n = names.cu_seqlens, names.seqused, names.total
    checkify.debug_check(cu[0] >= 0, f"{cu_n}[0] must be >= 0, got {{}}", cu[0])
    if cu.shape[0] > 1:
        decreasing = cu[1:] < cu[:-1]
        b = jnp.argmax(decreasing)
        checkify.debug_check(~decreasing.any(), f"{cu_n} must be non-decreasing, got {cu_n}[{{}}]={{}} > "
                             f"{cu_n}[{{}}]={{}}", b, cu[b], b + 1, cu[b + 1])
    checkify.debug_check(cu[-1] <= total, f"{cu_n}[-1]={{}} exceeds {total_n}={total}", cu[-1])
    if used is not None and used.shape[0]:
        lengths = cu[1:] - cu[:-1]
        outside = (used < 0) | (used > lengths)
        b = jnp.argmax(outside)
        checkify.debug_check(~outside.any(), f"{used_n}[{{}}]={{}} must be in [0, {{}}] (the length of sequence {{}} "
                             f"in {cu_n})", b, used[b], lengths[b], b)


def device_check_finite(name: str, scale) -> None:
    if not device_checks():
        return
    checkify.debug_check(jnp.isfinite(scale), f"{name} must be finite in float32, got {{}}", scale)


def device_check_dense_seqused(used, seqlen: int, names: ArgNames) -> None:
    if device_checks() and used.shape[0]:
        outside = (used < 0) | (used > seqlen)
        b = jnp.argmax(outside)
        checkify.debug_check(~outside.any(), f"{names.seqused}[{{}}]={{}} must be in [0, {names.seqlen}={seqlen}]",
                             b, used[b])
