"""The ``dq_postprocess`` primitive: every rule (abstract eval, lowerings, vmap, JVP, transpose, sharding),
registered in one block at the end.

Operands: ``dq_accum`` float32, ``scale`` float32 ``()``, ``aux`` int32 1-D. Params: ``mode``, ``rows``,
``head_dim``, ``dtype`` (numpy dtype, bf16 or fp16), ``layout`` (AccumLayout), ``num_tiles``.

==================  ====================  =======================  ====================  ==================
mode                dq_accum              aux                      rows                  result
==================  ====================  =======================  ====================  ==================
``dense``           ``(B, H, Sr*Dr)``     ``(0,)``                 ``S``                 ``(B, S, H, D)``
``dense_seqused``   ``(B, H, Sr*Dr)``     ``seqused_q (B,)``       ``S``                 ``(B, S, H, D)``
``varlen``          ``(H, Tp*Dr)``        work list (varlen.py)    ``T`` (total_q)       ``(T, H, D)``
==================  ====================  =======================  ====================  ==================

``num_tiles`` is the varlen launch grid per head (0 otherwise).

Two primitives: ``dq_postprocess_p`` is what users bind; it carries the vmap, JVP and transpose rules and
lowers through ``custom_partitioning`` (batch and heads shard, other axes are gathered). Each device then runs
``_dq_postprocess_shard_p`` on its shards, which lowers on CUDA to a custom call to our XLA FFI target
carrying the CuTe DSL-compiled module, and on every other platform to the jax.numpy reference
(``reference.py``), so results are the same bits everywhere.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax._src import ad_util, dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _ffi, varlen
from .layout import AccumLayout
from .reference import accum_from_dq_reference, dq_postprocess_reference, gather_accumulator, mul_f32_rn

dq_postprocess_p = Primitive("dq_postprocess")
# The same op once partitioned: what each device runs on its shards (lowers to the kernel or reference).
_dq_postprocess_shard_p = Primitive("dq_postprocess_shard")

MODES = ("dense", "dense_seqused", "varlen")
_NOT_MAPPED = None  # vmap's batch dimension of an unbatched operand


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


def _check_launch_grid(mode: str, acc_shape, rows: int, layout: AccumLayout, num_tiles: int) -> None:
    """The kernel's grid is (heads * CTAs per head, 1, batch): x < 2^31, batch <= 65535 (CUDA's limits)."""
    if mode == "varlen":
        heads, per_head, batch = acc_shape[0], num_tiles, 1
    else:
        batch, heads = acc_shape[0], acc_shape[1]
        per_head = layout.padded_seqlen(rows) // layout.tile_m
    if batch > 65535:
        raise ValueError(f"dq_postprocess on CUDA: batch (with any vmapped axes folded in) must be <= 65535, "
                         f"got {batch}")
    if heads * per_head > varlen.INT32_MAX or rows > varlen.INT32_MAX:
        raise ValueError(f"dq_postprocess on CUDA: heads * ceil(rows / tile_m) must be < 2^31, got heads={heads}, "
                         f"{per_head} tiles per head ({rows} rows)")


def _cuda_lowering(ctx, acc, scale, aux, *, mode: str, rows: int, head_dim: int, dtype, layout: AccumLayout,
                   num_tiles: int):
    from . import compile as compile_  # imports cutlass lazily, at the first CUDA lowering

    _check_launch_grid(mode, ctx.avals_in[0].shape, rows, layout, num_tiles)

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


# ---- sharding: batch and heads shard without any collective; other axes are gathered ---------------
def _partition_spec(sharding, ndim):
    spec = tuple(getattr(sharding, "spec", ())) if sharding is not None else ()
    return spec + (None,) * (ndim - len(spec))


def _make_partitioned(mode: str):
    """custom_partitioning of the op for one mode, with a Shardy rule: batch (dense) and heads factors
    shard; sequence, head-dim and work-list factors need replication (Shardy all-gathers them)."""

    def shard_fn(acc, scale, aux, params):
        return _dq_postprocess_shard_p.bind(acc, scale, aux, **dict(params))

    fn = custom_partitioning(shard_fn, static_argnums=(3,))

    def partition(params, mesh, arg_shapes, result_shape):
        acc_spec = _partition_spec(arg_shapes[0].sharding, len(arg_shapes[0].shape))
        if mode == "varlen":  # (H, Tp*Dr) -> (T, H, D): heads only
            heads = acc_spec[0]
            acc_s, aux_s, out_s = P(heads, None), P(None), P(None, heads, None)
        else:  # (B, H, Sr*Dr) -> (B, S, H, D): batch and heads
            batch, heads = acc_spec[0], acc_spec[1]
            acc_s, out_s = P(batch, heads, None), P(batch, None, heads, None)
            aux_s = P(batch) if mode == "dense_seqused" else P(None)
        arg_shardings = tuple(NamedSharding(mesh, spec) for spec in (acc_s, P(), aux_s))
        lower = functools.partial(shard_fn, params=params)  # the same op on each device's shards
        return mesh, lower, NamedSharding(mesh, out_s), arg_shardings

    rule, replicated = {
        "dense": ("b h l, , z -> b s h d", ("l", "z", "s", "d")),  # factors in order of appearance
        "dense_seqused": ("b h l, , b -> b s h d", ("l", "s", "d")),
        "varlen": ("h l, , k -> t h d", ("l", "k", "t", "d")),
    }[mode]
    fn.def_partition(partition, sharding_rule=rule, need_replication_factors=replicated)
    return fn


def _partitioned_impl(acc, scale, aux, **params):
    return _PARTITIONED[params["mode"]](acc, scale, aux, tuple(sorted(params.items(), key=lambda kv: kv[0])))


# ---- autodiff: the op is linear in dq_accum (and in scale) ------------------------------------------
def _jvp(primals, tangents, **params):
    acc, scale, aux = primals
    acc_dot, scale_dot, _ = tangents
    out = dq_postprocess_p.bind(acc, scale, aux, **params)
    terms = []
    if type(acc_dot) is not ad_util.Zero:
        terms.append(dq_postprocess_p.bind(acc_dot, scale, aux, **params))
    if type(scale_dot) is not ad_util.Zero:
        terms.append(dq_postprocess_p.bind(acc, scale_dot, aux, **params))
    if not terms:
        return out, ad_util.p2tz(out)
    return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _transpose(ct, acc, scale, aux, *, mode, rows, head_dim, dtype, layout, num_tiles):
    """dq_accum's cotangent is the scatter back into accumulator order (``dq_accum_from_dq``); scale's is
    the sum of cotangent times the accumulator values the op read."""
    params = dict(mode=mode, rows=rows, head_dim=head_dim, layout=layout, num_tiles=num_tiles)
    if ad.is_undefined_primal(aux):
        raise ValueError("dq_postprocess is not differentiable in its integer operand")
    if ad.is_undefined_primal(acc) and ad.is_undefined_primal(scale):
        raise ValueError("dq_postprocess is bilinear in (dq_accum, scale); transpose one at a time")
    if type(ct) is ad_util.Zero:
        return [None, None, None]
    if ad.is_undefined_primal(acc):
        shape = acc.aval.shape
        heads, batch = (shape[0], varlen.batch_from_meta(aux.shape[0], num_tiles)) if mode == "varlen" else (
            shape[1], shape[0])
        return [accum_from_dq_reference(ct, scale, aux, heads=heads, batch=batch, **params), None, None]
    x, keep = gather_accumulator(acc, aux, **params)
    scale_bar = jax.numpy.sum(jax.numpy.where(keep, ct.astype(np.float32) * x, 0.0))
    return [None, scale_bar.astype(scale.aval.dtype), None]


# ---- vmap: fold the mapped axis into the kernel's batch where the layout allows it ---------------
def _batch(args, dims, *, mode, rows, head_dim, dtype, layout, num_tiles):
    params = dict(mode=mode, rows=rows, head_dim=head_dim, dtype=dtype, layout=layout, num_tiles=num_tiles)
    acc, scale, aux = args
    acc_dim, scale_dim, aux_dim = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    acc = _moved(acc, acc_dim, size)
    if scale_dim is not _NOT_MAPPED:
        # A per-element scale: apply it first (the same single fp32 multiply), then convert with 1.
        s = jax.numpy.moveaxis(scale, scale_dim, 0).reshape((size,) + (1,) * (acc.ndim - 1))
        acc, scale = mul_f32_rn(acc, s), jax.numpy.float32(1.0)
    if mode == "varlen":
        if aux_dim is _NOT_MAPPED:
            # The same offsets for every element: (N, H, L) is (N*H, L), one call; the result (T, N*H, D)
            # is (T, N, H, D) with the mapped axis at 1 (no transpose here; JAX moves it if needed).
            n, h = acc.shape[0], acc.shape[1]
            out = dq_postprocess_p.bind(acc.reshape((n * h,) + acc.shape[2:]), scale, aux, **params)
            return out.reshape((out.shape[0], n, h) + out.shape[2:]), 1
        meta = _moved(aux, aux_dim, size)  # per-element offsets: one call each
        out = jax.lax.map(lambda xs: dq_postprocess_p.bind(xs[0], scale, xs[1], **params), (acc, meta))
        return out, 0
    # Dense: (N, B, H, L) is (N*B, H, L); seqused_q (N, B) is (N*B,).
    n, b = acc.shape[0], acc.shape[1]
    acc = acc.reshape((n * b,) + acc.shape[2:])
    if mode == "dense_seqused":
        aux = _moved(aux, aux_dim, size).reshape(n * b)
    out = dq_postprocess_p.bind(acc, scale, aux, **params)
    return out.reshape((n, b) + out.shape[1:]), 0


def _moved(x, dim, size):
    """``x`` with its mapped axis first (broadcast to ``size`` if unmapped)."""
    if dim is _NOT_MAPPED:
        return jax.numpy.broadcast_to(x, (size,) + x.shape)
    return jax.numpy.moveaxis(x, dim, 0)


@functools.cache
def _has_cuda_backend() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


# ---- registrations: every rule of the primitives, in one place -----------------------------------
# dq_postprocess_p: what users bind; autodiff and vmap rules; lowers through custom partitioning (which
# needs the devices while lowering).
dq_postprocess_p.def_impl(functools.partial(dispatch.apply_primitive, dq_postprocess_p))
dq_postprocess_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(dq_postprocess_p, mlir.lower_fun(_partitioned_impl, multiple_results=False))
dispatch.prim_requires_devices_during_lowering.add(dq_postprocess_p)
# _dq_postprocess_shard_p: one device's shards; the CUDA kernel, or the jax.numpy reference elsewhere.
_dq_postprocess_shard_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_dq_postprocess_shard_p, mlir.lower_fun(dq_postprocess_reference, multiple_results=False))
mlir.register_lowering(_dq_postprocess_shard_p, _cuda_lowering, platform="cuda")
_PARTITIONED = {mode: _make_partitioned(mode) for mode in MODES}
ad.primitive_jvps[dq_postprocess_p] = _jvp
ad.primitive_transposes[dq_postprocess_p] = _transpose
batching.primitive_batchers[dq_postprocess_p] = _batch
