"""The ``dq_postprocess`` primitive: abstract evaluation and lowerings, registered in one block below.

Operands: ``dq_accum`` float32, ``scale`` float32 ``()``, ``aux`` int32 1-D. Params: ``mode``, ``rows``,
``head_dim``, ``dtype`` (numpy dtype, bf16 or fp16), ``layout`` (AccumLayout), ``num_tiles``.

==================  ====================  =======================  ====================  ==================
mode                dq_accum              aux                      rows                  result
==================  ====================  =======================  ====================  ==================
``dense``           ``(B, H, Sr*Dr)``     ``(0,)``                 ``S``                 ``(B, S, H, D)``
``dense_seqused``   ``(B, H, Sr*Dr)``     ``seqused_q (B,)``       ``S``                 ``(B, S, H, D)``
``varlen``          ``(H, Tp*Dr)``        work list (varlen.py)    ``T`` (total_q)       ``(T, H, D)``
==================  ====================  =======================  ====================  ==================

``num_tiles`` is the varlen launch grid per head (0 otherwise). Lowering: on CUDA, a custom call to our XLA
FFI target carrying the CuTe DSL-compiled module; on every other platform, the jax.numpy reference
(``reference.py``), so results are the same bits everywhere.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir

from . import _ffi, varlen
from .layout import AccumLayout
from .reference import dq_postprocess_reference

dq_postprocess_p = Primitive("dq_postprocess")

MODES = ("dense", "dense_seqused", "varlen")


def _abstract_eval(acc, scale, aux, *, mode: str, rows: int, head_dim: int, dtype, layout: AccumLayout,
                   num_tiles: int):
    if acc.dtype != np.float32:
        raise TypeError(f"dq_accum must be float32, got {acc.dtype}")
    if scale.dtype != np.float32 or scale.shape != ():
        raise TypeError(f"scale must be a float32 scalar, got {scale.dtype}{list(scale.shape)}")
    if aux.dtype != np.int32 or aux.ndim != 1:
        raise TypeError(f"the int32 operand must be 1-D int32, got {aux.dtype}{list(aux.shape)}")
    dr = layout.padded_head_dim(head_dim)
    if mode == "varlen":
        batch = varlen.batch_from_meta(aux.shape[0], num_tiles)
        if batch is None or batch < 1:
            raise ValueError(f"work list of size {aux.shape[0]} does not fit num_tiles={num_tiles}")
        tp = varlen.padded_total(rows, batch, layout.tile_m)
        if acc.ndim != 2 or acc.shape[1] != tp * dr:
            raise ValueError(
                f"dq_accum must have shape (heads, Tp*Dr) = (heads, {tp}*{dr}) for total_q={rows}, batch={batch}, "
                f"head_dim={head_dim} and {layout} (Tp = ceil((total_q + batch*tile_m) / tile_m) * tile_m); "
                f"got shape {acc.shape}")
        return jax.core.ShapedArray((rows, acc.shape[0], head_dim), dtype)
    if acc.ndim != 3:
        raise ValueError(f"dq_accum must have shape (batch, heads, Sr*Dr), got shape {acc.shape}")
    batch, heads, flat = acc.shape
    expected = layout.padded_seqlen(rows) * dr
    if flat != expected:
        raise ValueError(
            f"dq_accum.shape[2] must be Sr*Dr = {layout.padded_seqlen(rows)}*{dr} = {expected} for seqlen_q={rows}, "
            f"head_dim={head_dim} and {layout}; got shape {acc.shape}")
    want_aux = (batch,) if mode == "dense_seqused" else (0,)
    if aux.shape != want_aux:
        raise ValueError(f"seqused_q must have shape {want_aux}, got {aux.shape}")
    return jax.core.ShapedArray((batch, rows, heads, head_dim), dtype)


def _cuda_lowering(ctx, acc, scale, aux, *, mode: str, rows: int, head_dim: int, dtype, layout: AccumLayout,
                   num_tiles: int):
    from . import compile as compile_  # imports cutlass lazily, at the first CUDA lowering

    kernel = compile_.get_kernel(dtype, layout, layout.padded_head_dim(head_dim), mode)
    if _has_cuda_backend():  # lowering for export on a machine without a GPU needs no registration
        _ffi.register()
    return jax.ffi.ffi_lowering(_ffi.TARGET_NAME)(
        ctx, acc, scale, aux,
        module=kernel.module,
        fingerprint=kernel.fingerprint,
        dtype=compile_.dtype_name(dtype),
        mode=np.int64(MODES.index(mode)),
        tile_m=np.int64(layout.tile_m),
        tile_hdim=np.int64(layout.padded_head_dim(head_dim)),
        num_tiles=np.int64(num_tiles),
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
