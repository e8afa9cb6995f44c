"""The API's arguments, checked and made the primitive's operands and the parts of its plan, for every entry point:
the output dtype, offsets and lengths a host can see (checked now) and, under ``jax.experimental.checkify``, traced
ones on the device, scales, the sink's operands. Errors name the argument and show the bad value (``TypeError``,
``ValueError`` at trace time); the shapes are checked by the plan in abstract evaluation, also under vmap and
sharding (``_primitive/plan.py``)."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from .._kernel import abi
from .._checks import describe, env_flag, static_int
from ..layout import CONSTRUCTORS, NO_DEFAULT, AccumLayout
from ._primitive.plan import ARG_NAMES, ArgNames, Part
from .._kernel.varlen import INT32_MAX, WorkList
from ..layout import padded_total

LAYOUT_HINT = f"the AccumLayout of the producer's accumulator ({NO_DEFAULT}); {CONSTRUCTORS}"
"""What a missing layout argument's error says."""


def part(layout, head_dim, dtype, seqlen, total, cu_seqlens, seqused,
         names: ArgNames = ARG_NAMES["dq"]) -> tuple[Part, object]:
    """One tensor's :class:`~jax_dqpost._primitive.plan.Part` and its side's int32 aux operand (empty, seqused or the
    work list), from the API's arguments of its side; errors name the arguments as ``names`` does."""
    seqlen_n, total_n, cu_n, used_n = names.seqlen, names.total, names.cu_seqlens, names.seqused
    if cu_seqlens is None:
        if total is not None:
            raise ValueError(f"{total_n}={total!r} is only for variable-length batches (with {cu_n})")
        if seqlen is None:
            raise ValueError(f"{seqlen_n} is required for dense batches (or pass {cu_n} and {total_n})")
        seqlen = static_int(seqlen_n, seqlen, minimum=0)
        check_rows_fit_int32(seqlen_n, seqlen, layout.padded_seqlen(seqlen))
        plan = Part(layout, head_dim, dtype, seqlen=seqlen, seqused=seqused is not None)
        if seqused is None:
            return plan, jnp.zeros((0,), jnp.int32)
        if _is_static(seqused):
            used = static_ints(used_n, seqused)
            check_dense_seqused(used, plan.seqlen, names)
            return plan, jnp.asarray(np.asarray(used, np.int32).reshape(-1))
        used, values = _int_array(used_n, seqused), _visible_ints(used_n, seqused)
        if values is not None:  # still an operand the kernel reads at run time; the values seen now are checked
            check_dense_seqused(values, plan.seqlen, names)
        else:
            device_check_dense_seqused(used, plan.seqlen, names)
        return plan, used

    if seqlen is not None:
        raise ValueError(f"{seqlen_n}={seqlen!r} is only for dense batches; variable-length batches take {total_n}")
    if layout.varlen_unreadable:
        raise ValueError(f"{cu_n} given (a packed batch), but {layout.varlen_unreadable}")
    if total is None:
        raise ValueError(f"{total_n} (rows of the packed output) is required with {cu_n}")
    total = static_int(total_n, total, minimum=0)
    if _is_static(cu_seqlens) and (seqused is None or _is_static(seqused)):
        cu = static_ints(cu_n, cu_seqlens)
        used = None if seqused is None else static_ints(used_n, seqused)
        check_offsets(cu, used, total, names)
        check_rows_fit_int32(total_n, total, _varlen_rows(total, len(cu) - 1, layout))
        work, work_list = WorkList.build(np, np.asarray(cu), None if used is None else np.asarray(used),
                                         total=total, layout=layout)
        return Part(layout, head_dim, dtype, work=work), jnp.asarray(work_list)
    cu = _int_array(cu_n, _static_as_array(cu_n, cu_seqlens))
    used = None if seqused is None else _int_array(used_n, _static_as_array(used_n, seqused))
    cu_values = _visible_ints(cu_n, cu_seqlens)
    used_values = None if used is None else _visible_ints(used_n, seqused)
    if cu_values is not None:  # still operands the kernel reads at run time; the values seen now are checked
        check_offsets(cu_values, used_values, total, names)
    elif used_values is not None:  # traced offsets: only the lengths' sign can be checked without them
        bad = [(b, u) for b, u in enumerate(used_values) if u < 0]
        if bad:
            raise ValueError(f"{used_n}[{bad[0][0]}]={bad[0][1]} must be >= 0")
    if cu.shape[0] < 1:
        raise ValueError(f"{cu_n} must have batch + 1 entries (at least 1), got shape {cu.shape}")
    batch = cu.shape[0] - 1
    if used is not None and used.shape != (batch,):
        raise ValueError(f"{used_n} must have shape ({batch},) to match {cu_n} of {batch + 1} entries, got "
                         f"{used.shape}")
    if cu_values is None or (used is not None and used_values is None):
        device_check_offsets(cu, used, total, names)
    check_rows_fit_int32(total_n, total, _varlen_rows(total, batch, layout))
    work, work_list = WorkList.build(jnp, cu, used, total=total, layout=layout,
                                num_tiles=WorkList.max_tiles(total, batch, layout))
    return Part(layout, head_dim, dtype, work=work), work_list


def check_layout(layout, name: str = "layout") -> None:
    if not isinstance(layout, AccumLayout):
        raise TypeError(f"{name} must be an AccumLayout, got {describe(layout)}; {CONSTRUCTORS}")


def accumulator(name: str, x):
    """A float32 accumulator operand (``TypeError`` naming the argument otherwise)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None and isinstance(x, (list, tuple)):
        x = np.asarray(x, np.float32)
        dtype = x.dtype
    if dtype is None or np.dtype(dtype) != np.float32:
        raise TypeError(f"{name} must be float32, got {describe(x) if dtype is None else np.dtype(dtype).name}")
    return jnp.asarray(x)


WIDE_SINK_DTYPE = np.dtype(np.float64)
"""A sink dtype the kernel does not take (not in ``abi.SINK_DTYPES``) but the API does, as jax's own operations
take such a value under ``jax_enable_x64``: read as float32 (as a float64 scale is), its gradient returned in it."""


def sink_operands(learnable_sink, lse, dpsum):
    """``(learnable_sink, lse, dpsum)`` as operands, or None without a sink; all three or none. A float64 sink
    (:data:`WIDE_SINK_DTYPE`, under ``jax_enable_x64``; without it jax makes it float32) is float32 here: the caller
    converts dsink back (:func:`dsink_dtype`)."""
    given = {name: v is not None for name, v in (("learnable_sink", learnable_sink), ("lse", lse), ("dpsum", dpsum))}
    if not any(given.values()):
        return None
    if not all(given.values()):
        missing = [name for name, g in given.items() if not g]
        raise ValueError(f"the sink gradient needs learnable_sink, lse and dpsum; missing {', '.join(missing)}")
    sink = _sink(learnable_sink)
    if sink.dtype not in abi.SINK_DTYPES:  # float64: read as float32
        sink = sink.astype(jnp.float32)
    return (sink, accumulator("lse", lse), accumulator("dpsum", dpsum))


SINK_DTYPES_WANT = "a float32, bfloat16, float16 or float64 (read as float32) array"
"""What an error says the sink may be."""


def _sink(learnable_sink):
    """``learnable_sink`` as a jax array of one of ``abi.SINK_DTYPES`` or :data:`WIDE_SINK_DTYPE` (as jax makes
    it: float32 for a float64 value without ``jax_enable_x64``); ``TypeError`` naming it otherwise."""
    sink_dtype = getattr(learnable_sink, "dtype", None)
    if sink_dtype is None or np.dtype(sink_dtype) not in (*abi.SINK_DTYPES, WIDE_SINK_DTYPE):
        raise TypeError(f"learnable_sink must be {SINK_DTYPES_WANT}, got "
                        + (describe(learnable_sink) if sink_dtype is None else f"dtype {np.dtype(sink_dtype)}"))
    return jnp.asarray(learnable_sink)


def dsink_dtype(learnable_sink) -> np.dtype:
    """The type of dsink: ``learnable_sink``'s as jax holds it (float64 under ``jax_enable_x64``, else float32)."""
    return np.dtype(_sink(learnable_sink).dtype)


def _is_static(x) -> bool:
    """Python sequences of ints and numpy arrays are static; jax arrays (and tracers) are device data."""
    return isinstance(x, (list, tuple, range, np.ndarray))


def _visible_ints(name: str, x) -> list[int] | None:
    """The values of offsets or lengths if this host can read them now: static ones, or a jax array that is not a
    tracer (outside jit, or a constant inside it); None for traced values."""
    return static_ints(name, x) if _host_visible(x) else None


def _host_visible(x) -> bool:
    """Whether this host can read ``x``'s values now: static values, numpy, or a jax array that is not a tracer
    (outside jit, or a constant inside it) and whose shards are all this process's."""
    if isinstance(x, jax.Array):
        return not isinstance(x, jax.core.Tracer) and x.is_fully_addressable
    return _is_static(x) or isinstance(x, np.generic)


def _static_as_array(name: str, x):
    """A Python sequence as a numpy array (its items checked: ints, none traced), anything else as it is."""
    return np.asarray(static_ints(name, x)) if isinstance(x, (list, tuple, range)) else x


WIDENED_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.uint8, np.uint16))
"""Integer types of a jax array of offsets or lengths that int32 holds exactly: widened to int32. Any other but
int32 (int64, uint32, uint64) is refused, traced or not: its values might not fit, and traced ones cannot be seen."""


def _int_array(name: str, x):
    """Offsets or lengths as the kernel's 1-D int32 operand: a jax array (traced or not) of int32 or of a type
    :data:`WIDENED_DTYPES` widens, or a numpy array whose values the caller checks (``TypeError`` otherwise)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array or a sequence of Python ints, got {type(x).__name__} "
                        f"of dtype {dtype}")
    if isinstance(x, jax.Array) and np.dtype(dtype) != np.int32 and np.dtype(dtype) not in WIDENED_DTYPES:
        raise TypeError(f"{name} must be a jax array of int32 (int8, int16, uint8 and uint16 are widened), got "
                        f"dtype {np.dtype(dtype).name}, which int32 cannot hold exactly: pass int32 "
                        f"({name}.astype(jnp.int32) once its values fit), or numpy or Python ints, checked when "
                        "traced")
    if np.ndim(x) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {np.shape(x)}")
    return jnp.asarray(x).astype(jnp.int32)


def _varlen_rows(total: int, batch: int, layout) -> int:
    """The rows a packed side's kernel indexes: the padded total ``Tp`` and one more cluster of tiles, the furthest
    a tile may start past a sequence's padded offset."""
    return padded_total(total, batch, layout.pad_rows) + layout.pad_rows


def scale_operand(scale, name: str = "scale"):
    """``scale`` as a float32 scalar operand: a Python real or a floating-point scalar array, traced or not. A value
    this host can see (a Python or numpy scalar, a concrete array) must be finite in float32: ``ValueError`` naming
    ``name`` and the value otherwise. A traced scale is used as it is (a NaN or an infinity gives such gradients),
    checked only under checkify."""
    if isinstance(scale, numbers.Real) and not isinstance(scale, (bool, np.bool_)):
        check_finite_f32(name, scale)
        return jnp.float32(scale)
    dtype = getattr(scale, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a Python float or a floating-point scalar, got {describe(scale)}"
                        + ("" if dtype is None else f" of dtype {dtype}"))
    if np.shape(scale) != ():
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(scale)}")
    if _host_visible(scale):  # numpy, or a concrete jax array (read back from its device)
        check_finite_f32(name, np.asarray(scale).item())
        return jnp.asarray(scale).astype(jnp.float32)
    scale = jnp.asarray(scale).astype(jnp.float32)
    device_check_finite(name, scale)
    return scale


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
