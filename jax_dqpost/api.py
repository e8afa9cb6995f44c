"""Public entry points: argument checks with clear errors, then ``bind``."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from . import varlen
from .layout import AccumLayout
from .primitive import dq_postprocess_p
from .reference import accum_from_dq_reference

_OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


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
    if not isinstance(layout, AccumLayout):
        raise TypeError(f"layout must be an AccumLayout, got {type(layout).__name__}: {layout!r}")
    head_dim = _static_int("head_dim", head_dim, minimum=1)
    layout.check_head_dim(head_dim)
    try:
        out_dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be jnp.bfloat16 or jnp.float16, got {dtype!r}") from None
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be bfloat16 or float16, got {out_dtype}")
    dq_accum = jnp.asarray(dq_accum)
    scale = _scale_operand(scale)
    aux, mode, rows, num_tiles = _work(layout, seqlen_q, total_q, cu_seqlens_q, seqused_q)
    return dq_postprocess_p.bind(dq_accum, scale, aux, mode=mode, rows=rows, num_tiles=num_tiles, head_dim=head_dim,
                                 dtype=out_dtype, layout=layout)


def dq_accum_from_dq(dq, scale, *, layout: AccumLayout = AccumLayout(), cu_seqlens_q=None, seqused_q=None):
    """The transpose of :func:`dq_postprocess`: build the float32 accumulator a producer would have written.

    Dense: ``dq`` ``(B, S, H, D)`` -> ``(B, H, Sr * Dr)``. Varlen (``cu_seqlens_q`` given): ``dq`` ``(T, H, D)``
    -> ``(H, Tp * Dr)``. Every position that ``dq_postprocess`` reads element ``(i, j)`` from holds
    ``float32(scale) * float32(dq[i, j])`` (one fp32 multiply); every other entry (padding rows and columns,
    rows past ``seqused_q``, rows no sequence covers) is 0. With ``scale = 1`` it inverts
    ``dq_postprocess`` on bf16/fp16 values; it is also how to build an accumulator in a given order.
    ``cu_seqlens_q`` / ``seqused_q``: as in :func:`dq_postprocess` (static ints or traced int32 arrays).
    """
    if not isinstance(layout, AccumLayout):
        raise TypeError(f"layout must be an AccumLayout, got {type(layout).__name__}: {layout!r}")
    dq = jnp.asarray(dq)
    if not jnp.issubdtype(dq.dtype, jnp.floating):
        raise TypeError(f"dq must be a floating-point array, got {dq.dtype}")
    varlen_mode = cu_seqlens_q is not None
    if dq.ndim != (3 if varlen_mode else 4):
        want = "(T, H, D) with cu_seqlens_q" if varlen_mode else "(B, S, H, D)"
        raise ValueError(f"dq must have shape {want}, got shape {dq.shape}")
    head_dim = int(dq.shape[-1])
    layout.check_head_dim(head_dim)
    scale = _scale_operand(scale)
    if varlen_mode:
        aux, mode, rows, num_tiles = _work(layout, None, int(dq.shape[0]), cu_seqlens_q, seqused_q)
        heads, batch = int(dq.shape[1]), varlen.batch_from_meta(aux.shape[0], num_tiles)
    else:
        aux, mode, rows, num_tiles = _work(layout, int(dq.shape[1]), None, None, seqused_q)
        heads, batch = int(dq.shape[2]), int(dq.shape[0])
        if mode == "dense_seqused" and aux.shape != (batch,):
            raise ValueError(f"seqused_q must have shape ({batch},), got {aux.shape}")
    return accum_from_dq_reference(dq, scale, aux, mode=mode, rows=rows, head_dim=head_dim, layout=layout,
                                   num_tiles=num_tiles, heads=heads, batch=batch)


def _work(layout, seqlen_q, total_q, cu_seqlens_q, seqused_q):
    """(aux operand, mode, rows, num_tiles) for the primitive, with the checks of dq_postprocess."""
    if cu_seqlens_q is None:
        if total_q is not None:
            raise ValueError(f"total_q={total_q} is only for variable-length batches (with cu_seqlens_q)")
        if seqlen_q is None:
            raise ValueError("seqlen_q is required for dense batches (or pass cu_seqlens_q and total_q)")
        seqlen_q = _static_int("seqlen_q", seqlen_q, minimum=0)
        if seqused_q is None:
            return jnp.zeros((0,), jnp.int32), "dense", seqlen_q, 0
        if _is_static(seqused_q):
            used = _static_ints("seqused_q", seqused_q)
            bad = [(b, u) for b, u in enumerate(used) if not 0 <= u <= seqlen_q]
            if bad:
                raise ValueError(f"seqused_q[{bad[0][0]}]={bad[0][1]} must be in [0, seqlen_q={seqlen_q}]")
            return jnp.asarray(np.asarray(used, np.int32).reshape(-1)), "dense_seqused", seqlen_q, 0
        return _int_array("seqused_q", seqused_q), "dense_seqused", seqlen_q, 0

    if seqlen_q is not None:
        raise ValueError(f"seqlen_q={seqlen_q} is only for dense batches; variable-length batches take total_q")
    if total_q is None:
        raise ValueError("total_q (rows of the packed dq) is required with cu_seqlens_q")
    total_q = _static_int("total_q", total_q, minimum=0)
    static = _is_static(cu_seqlens_q) and (seqused_q is None or _is_static(seqused_q))
    if static:
        cu = _static_ints("cu_seqlens_q", cu_seqlens_q)
        used = None if seqused_q is None else _static_ints("seqused_q", seqused_q)
        varlen.check_static(cu, used, total_q)
        _check_int32_range(total_q, len(cu) - 1, layout.tile_m)
        meta, num_tiles = varlen.work_list(np, np.asarray(cu), None if used is None else np.asarray(used),
                                           total_q=total_q, tile_m=layout.tile_m)
        return jnp.asarray(meta), "varlen", total_q, num_tiles
    cu = _int_array("cu_seqlens_q", _static_as_array(cu_seqlens_q))
    if cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q must have at least 2 entries (batch + 1), got shape {cu.shape}")
    batch = cu.shape[0] - 1
    used = None if seqused_q is None else _int_array("seqused_q", _static_as_array(seqused_q))
    if used is not None and used.shape != (batch,):
        raise ValueError(f"seqused_q must have shape ({batch},) to match cu_seqlens_q, got {used.shape}")
    _check_int32_range(total_q, batch, layout.tile_m)
    num_tiles = varlen.max_tiles(total_q, batch, layout.tile_m)
    meta, _ = varlen.work_list(jnp, cu, used, total_q=total_q, tile_m=layout.tile_m, num_tiles=num_tiles)
    return meta, "varlen", total_q, num_tiles


def _static_int(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a Python int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _is_static(x) -> bool:
    """Python sequences of ints and numpy arrays are static; jax arrays (and tracers) are device data."""
    return isinstance(x, (list, tuple, range, np.ndarray))


def _static_ints(name: str, x) -> list[int]:
    arr = np.asarray(x)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{name} must be a 1-D sequence of ints, got {x!r}")
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
    if total_q + (batch + 2) * tile_m > varlen.INT32_MAX:
        raise ValueError(f"total_q={total_q} with batch={batch} overflows the int32 row offsets")


def _scale_operand(scale):
    if isinstance(scale, bool):
        raise TypeError(f"scale must be a float or a float32 scalar, got {scale!r}")
    if isinstance(scale, numbers.Real):
        return jnp.float32(scale)
    shape, dtype = np.shape(scale), getattr(scale, "dtype", None)
    if shape != ():
        raise ValueError(f"scale must be a scalar, got shape {shape}")
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"scale must be a float or a floating-point scalar, got dtype {dtype}")
    return jnp.asarray(scale).astype(jnp.float32)
