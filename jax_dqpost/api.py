"""Public entry points: argument checks with clear errors, the call's :class:`~jax_dqpost.plan.Plan`, then
``bind``."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from . import _validate
from ._validate import describe
from .layout import AccumLayout
from .plan import OUT_DTYPES, Plan
from .primitive import dq_postprocess_p
from .reference import accum_from_dq_reference
from .varlen import INT32_MAX, WorkList, check_static


def dq_postprocess(dq_accum, scale, *, head_dim: int, seqlen_q: int | None = None, total_q: int | None = None,
                   cu_seqlens_q=None, seqused_q=None, dtype=jnp.bfloat16, layout: AccumLayout = AccumLayout()):
    """FlashAttention's backward dQ postprocess: ``dQ = round(scale * dq_accum)`` in natural layout.

    Dense batches (``seqlen_q`` given)::

        dq_accum: float32 (B, H, Sr * Dr)  ->  dq: (B, S, H, D)

    with ``Sr = ceil(S / tile_m) * tile_m`` and ``Dr = ceil(D / hdim_multiple_of) * hdim_multiple_of``. Tile
    ``(b, h, m)`` is ``dq_accum[b, h, m*tile_m*Dr : (m+1)*tile_m*Dr]`` in the producer's register order.
    With ``seqused_q`` (B,), rows ``>= seqused_q[b]`` of batch ``b`` are zero.

    Variable-length batches (``cu_seqlens_q`` (B+1,) and ``total_q`` given)::

        dq_accum: float32 (H, Tp * Dr)  ->  dq: (T, H, D),   Tp = ceil((T + B*tile_m) / tile_m) * tile_m

    Sequence ``b`` is dq rows ``cu[b] .. cu[b] + len_b`` with ``len_b = seqused_q[b]`` if given, else
    ``cu[b+1] - cu[b]``; its accumulator starts at padded row ``(cu[b] + b*tile_m) // tile_m * tile_m``
    (FlashAttention's allocation). Rows no sequence covers are zero.

    Args:
      dq_accum: the accumulator as the producer described by ``layout`` wrote it (shapes above).
      scale: the softmax scale: a Python float or a floating-point scalar, traced or not; converted to
        float32 (round-to-nearest) first. Changing it never recompiles the kernel.
      head_dim: ``D``, a multiple of 8, at most 256.
      seqlen_q: ``S`` (dense).
      total_q: ``T``, rows of the packed output (varlen).
      cu_seqlens_q: varlen offsets: a sequence of Python ints (static: validated now, exact launch grid) or
        an int32 array (traced: new values never retrace or recompile; corrupt values are clamped into a
        partition of the rows, never read or written out of bounds).
      seqused_q: lengths actually used, ``(B,)``: static ints or an int32 array, like ``cu_seqlens_q``.
      dtype: ``jnp.bfloat16`` or ``jnp.float16``, the type of dQ.
      layout: :class:`AccumLayout` of the producer.

    Returns:
      dq of ``dtype``, every element defined: ``round_to_nearest_even(float32(scale) * acc[F(i, j)])`` for
      covered rows, 0 elsewhere.
    """
    _check_layout(layout)
    head_dim = _validate.head_dim(head_dim)
    layout.check_head_dim(head_dim)
    out_dtype = _out_dtype(dtype)
    dq_accum = jnp.asarray(dq_accum)
    scale = _scale_operand(scale)
    plan, aux = _plan(layout, head_dim, out_dtype, seqlen_q, total_q, cu_seqlens_q, seqused_q)
    return dq_postprocess_p.bind(dq_accum, scale, aux, plan=plan)


def dq_accum_from_dq(dq, scale, *, layout: AccumLayout = AccumLayout(), cu_seqlens_q=None, seqused_q=None):
    """The transpose of :func:`dq_postprocess`: build the float32 accumulator a producer would have written.

    Dense: ``dq`` ``(B, S, H, D)`` -> ``(B, H, Sr * Dr)``. Varlen (``cu_seqlens_q`` given): ``dq`` ``(T, H, D)``
    -> ``(H, Tp * Dr)``. Every position that ``dq_postprocess`` reads element ``(i, j)`` from holds
    ``float32(scale) * float32(dq[i, j])`` (one fp32 multiply); every other entry (padding rows and columns,
    rows past ``seqused_q``, rows no sequence covers) is 0. With ``scale = 1`` it inverts
    ``dq_postprocess`` on bf16/fp16 values; it is also how to build an accumulator in a given order.
    ``cu_seqlens_q`` / ``seqused_q``: as in :func:`dq_postprocess` (static ints or traced int32 arrays).
    """
    _check_layout(layout)
    dq = jnp.asarray(dq)
    if not jnp.issubdtype(dq.dtype, jnp.floating):
        raise TypeError(f"dq must be a floating-point array, got dtype {dq.dtype}")
    packed = cu_seqlens_q is not None
    if dq.ndim != (3 if packed else 4):
        want = "(T, H, D) with cu_seqlens_q" if packed else "(B, S, H, D)"
        raise ValueError(f"dq must have shape {want}, got shape {dq.shape}")
    head_dim = int(dq.shape[-1])
    layout.check_head_dim(head_dim)
    scale = _scale_operand(scale)
    if packed:
        plan, aux = _plan(layout, head_dim, dq.dtype, None, int(dq.shape[0]), cu_seqlens_q, seqused_q)
    else:
        plan, aux = _plan(layout, head_dim, dq.dtype, int(dq.shape[1]), None, None, seqused_q)
        if aux.shape != plan.aux_shape(dq.shape[0]):
            raise ValueError(f"seqused_q must have shape {plan.aux_shape(dq.shape[0])}, got {aux.shape}")
    return accum_from_dq_reference(dq, scale, aux, plan)


def _plan(layout, head_dim, dtype, seqlen_q, total_q, cu_seqlens_q, seqused_q) -> tuple[Plan, object]:
    """The call's plan and its int32 aux operand (empty, seqused_q or the work list), with the checks of
    dq_postprocess."""
    if cu_seqlens_q is None:
        if total_q is not None:
            raise ValueError(f"total_q={total_q!r} is only for variable-length batches (with cu_seqlens_q)")
        if seqlen_q is None:
            raise ValueError("seqlen_q is required for dense batches (or pass cu_seqlens_q and total_q)")
        plan = Plan(layout, head_dim, dtype, seqlen_q=_validate.static_int("seqlen_q", seqlen_q, minimum=0),
                    seqused_q=seqused_q is not None)
        if seqused_q is None:
            return plan, jnp.zeros((0,), jnp.int32)
        if _is_static(seqused_q):
            used = _static_ints("seqused_q", seqused_q)
            bad = [(b, u) for b, u in enumerate(used) if not 0 <= u <= plan.seqlen_q]
            if bad:
                raise ValueError(f"seqused_q[{bad[0][0]}]={bad[0][1]} must be in [0, seqlen_q={plan.seqlen_q}]")
            return plan, jnp.asarray(np.asarray(used, np.int32).reshape(-1))
        return plan, _int_array("seqused_q", seqused_q)

    if seqlen_q is not None:
        raise ValueError(f"seqlen_q={seqlen_q!r} is only for dense batches; variable-length batches take total_q")
    if total_q is None:
        raise ValueError("total_q (rows of the packed dq) is required with cu_seqlens_q")
    total_q = _validate.static_int("total_q", total_q, minimum=0)
    tile_m = layout.tile_m
    if _is_static(cu_seqlens_q) and (seqused_q is None or _is_static(seqused_q)):
        cu = _static_ints("cu_seqlens_q", cu_seqlens_q)
        used = None if seqused_q is None else _static_ints("seqused_q", seqused_q)
        check_static(cu, used, total_q)
        _check_int32_range(total_q, len(cu) - 1, tile_m)
        work, meta = WorkList.build(np, np.asarray(cu), None if used is None else np.asarray(used),
                                    total_q=total_q, tile_m=tile_m)
        return Plan(layout, head_dim, dtype, work=work), jnp.asarray(meta)
    cu = _int_array("cu_seqlens_q", _static_as_array(cu_seqlens_q))
    if cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q must have at least 2 entries (batch + 1), got shape {cu.shape}")
    batch = cu.shape[0] - 1
    used = None if seqused_q is None else _int_array("seqused_q", _static_as_array(seqused_q))
    if used is not None and used.shape != (batch,):
        raise ValueError(f"seqused_q must have shape ({batch},) to match cu_seqlens_q, got {used.shape}")
    _check_int32_range(total_q, batch, tile_m)
    work, meta = WorkList.build(jnp, cu, used, total_q=total_q, tile_m=tile_m,
                                num_tiles=WorkList.max_tiles(total_q, batch, tile_m))
    return Plan(layout, head_dim, dtype, work=work), meta


def _check_layout(layout) -> None:
    if not isinstance(layout, AccumLayout):
        raise TypeError(f"layout must be an AccumLayout, got {describe(layout)}")


def _out_dtype(dtype) -> np.dtype:
    """dQ's dtype: bfloat16 or float16 (``None`` is not float64 here)."""
    try:
        out = None if dtype is None else np.dtype(dtype)
    except TypeError:
        out = None
    if out is None:
        raise TypeError(f"dtype must be jnp.bfloat16 or jnp.float16, got {describe(dtype)}")
    if out not in OUT_DTYPES:
        raise ValueError(f"dtype must be jnp.bfloat16 or jnp.float16, got {out.name}")
    return out


def _is_static(x) -> bool:
    """Python sequences of ints and numpy arrays are static; jax arrays (and tracers) are device data."""
    return isinstance(x, (list, tuple, range, np.ndarray))


def _static_ints(name: str, x) -> list[int]:
    arr = np.asarray(x)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{name} must be a 1-D sequence of ints, got {describe(x)}")
    return [int(v) for v in arr]


def _static_as_array(x):
    return np.asarray(x) if isinstance(x, (list, tuple, range)) else x


def _int_array(name: str, x):
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array or a sequence of Python ints, got {type(x).__name__} "
                        f"of dtype {dtype}")
    if np.ndim(x) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {np.shape(x)}")
    return jnp.asarray(x).astype(jnp.int32)


def _check_int32_range(total_q: int, batch: int, tile_m: int) -> None:
    if total_q + (batch + 2) * tile_m > INT32_MAX:
        raise ValueError(f"total_q={total_q} with batch={batch} overflows the int32 row offsets")


def _scale_operand(scale):
    """scale as a float32 scalar operand: a Python real or a floating-point scalar array (traced or not)."""
    if isinstance(scale, numbers.Real) and not isinstance(scale, (bool, np.bool_)):
        return jnp.float32(scale)
    dtype = getattr(scale, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"scale must be a Python float or a floating-point scalar, got {describe(scale)}"
                        + ("" if dtype is None else f" of dtype {dtype}"))
    if np.shape(scale) != ():
        raise ValueError(f"scale must be a scalar, got shape {np.shape(scale)}")
    return jnp.asarray(scale).astype(jnp.float32)
