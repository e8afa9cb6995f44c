"""The ``dq_postprocess`` primitive: abstract evaluation and lowerings, registered in one block below.

Operands: ``dq_accum`` float32 ``(B, H, Sr*Dr)`` and ``scale`` float32 ``()``.
Params: ``seqlen_q``, ``head_dim`` (ints), ``dtype`` (numpy dtype, bf16 or fp16), ``layout`` (AccumLayout).
Result: ``(B, seqlen_q, H, head_dim)`` in ``dtype``.

Lowering: on CUDA, a custom call to our XLA FFI target carrying the CuTe DSL-compiled module; on every
other platform, the jax.numpy reference (``reference.py``), so results are the same bits everywhere.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir

from . import _ffi
from .layout import AccumLayout
from .reference import dq_postprocess_reference

dq_postprocess_p = Primitive("dq_postprocess")


def _abstract_eval(acc, scale, *, seqlen_q: int, head_dim: int, dtype, layout: AccumLayout):
    if acc.dtype != np.float32:
        raise TypeError(f"dq_accum must be float32, got {acc.dtype}")
    if acc.ndim != 3:
        raise ValueError(f"dq_accum must have shape (batch, heads, Sr*Dr), got shape {acc.shape}")
    if scale.dtype != np.float32 or scale.shape != ():
        raise TypeError(f"scale must be a float32 scalar, got {scale.dtype}{list(scale.shape)}")
    batch, heads, flat = acc.shape
    expected = layout.padded_seqlen(seqlen_q) * layout.padded_head_dim(head_dim)
    if flat != expected:
        raise ValueError(
            f"dq_accum.shape[2] must be Sr*Dr = {layout.padded_seqlen(seqlen_q)}*{layout.padded_head_dim(head_dim)}"
            f" = {expected} for seqlen_q={seqlen_q}, head_dim={head_dim} and {layout}; got shape {acc.shape}"
        )
    return jax.core.ShapedArray((batch, seqlen_q, heads, head_dim), dtype)


def _cuda_lowering(ctx, acc, scale, *, seqlen_q: int, head_dim: int, dtype, layout: AccumLayout):
    from . import compile as compile_  # imports cutlass lazily, at the first CUDA lowering

    kernel = compile_.get_kernel(dtype, layout, layout.padded_head_dim(head_dim))
    if _has_cuda_backend():  # lowering for export on a machine without a GPU needs no registration
        _ffi.register()
    return jax.ffi.ffi_lowering(_ffi.TARGET_NAME)(
        ctx,
        acc,
        scale,
        module=kernel.module,
        fingerprint=kernel.fingerprint,
        dtype=compile_.dtype_name(dtype),
        tile_m=np.int64(layout.tile_m),
        tile_hdim=np.int64(layout.padded_head_dim(head_dim)),
    )


@functools.cache
def _has_cuda_backend() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


# ---- registrations: every rule of the primitive, in one place ------------------------------------
dq_postprocess_p.def_impl(functools.partial(dispatch.apply_primitive, dq_postprocess_p))
dq_postprocess_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(dq_postprocess_p, mlir.lower_fun(dq_postprocess_reference, multiple_results=False))
mlir.register_lowering(dq_postprocess_p, _cuda_lowering, platform="cuda")
