"""Public entry points: argument checks with clear errors, then ``bind``."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from .layout import AccumLayout
from .primitive import dq_postprocess_p

_OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def dq_postprocess(dq_accum, scale, *, seqlen_q: int, head_dim: int, dtype=jnp.bfloat16,
                   layout: AccumLayout = AccumLayout()):
    """FlashAttention's backward dQ postprocess: ``dQ = round(scale * dq_accum)`` in natural layout.

    Args:
      dq_accum: float32 array of shape ``(B, H, Sr * Dr)``, the accumulator as the producer described
        by ``layout`` wrote it: ``Sr = ceil(seqlen_q / tile_m) * tile_m`` and
        ``Dr = ceil(head_dim / hdim_multiple_of) * hdim_multiple_of``. Tile ``(b, h, m)`` is
        ``dq_accum[b, h, m*tile_m*Dr : (m+1)*tile_m*Dr]``, in the producer's register order.
      scale: the softmax scale: a Python float or a float32 scalar (traced or not). Converted to
        float32 (round-to-nearest) first; changing it never recompiles the kernel.
      seqlen_q: ``S``, the number of query rows (a Python int).
      head_dim: ``D``, a multiple of 8, at most 256 (a Python int).
      dtype: ``jnp.bfloat16`` or ``jnp.float16``, the type of dQ.
      layout: :class:`AccumLayout` of the producer.

    Returns:
      ``(B, S, H, D)`` array of ``dtype`` with
      ``dQ[b, m*tile_m + i, h, j] = round_to_nearest_even(float32(scale) * acc(b, h, m)[F(i, j)])``.
      Padding rows and columns of the accumulator are never read into the result.
    """
    if not isinstance(layout, AccumLayout):
        raise TypeError(f"layout must be an AccumLayout, got {type(layout).__name__}: {layout!r}")
    seqlen_q = _static_int("seqlen_q", seqlen_q, minimum=0)
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
    return dq_postprocess_p.bind(dq_accum, scale, seqlen_q=seqlen_q, head_dim=head_dim, dtype=out_dtype,
                                 layout=layout)


def _static_int(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a Python int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


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
