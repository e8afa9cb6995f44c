"""The ``dq_postprocess`` primitive: every rule (abstract eval, lowerings, vmap, JVP, transpose, sharding),
registered in one block at the end.

Operands: ``dq_accum`` float32, ``scale`` float32 ``()``, ``aux`` int32 1-D (empty, ``seqused_q`` or the varlen
work list). One parameter: ``plan``, the :class:`~jax_dqpost.plan.Plan` of the call, which every rule asks for
shapes, the kernel, the FFI attributes and the sharding rule (``plan.py`` has the table of operands).

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
from jax._src import ad_util, dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _ffi, arch
from .plan import Plan
from .reference import accum_from_dq_reference, dq_postprocess_reference, gather_accumulator, mul_f32_rn

dq_postprocess_p = Primitive("dq_postprocess")
# The same op once partitioned: what each device runs on its shards (lowers to the kernel or reference).
_dq_postprocess_shard_p = Primitive("dq_postprocess_shard")

_NOT_MAPPED = None  # vmap's batch dimension of an unbatched operand


def _abstract_eval(acc, scale, aux, *, plan: Plan):
    if acc.dtype != np.float32:
        raise TypeError(f"dq_accum must be float32, got {acc.dtype}")
    if scale.dtype != np.float32 or scale.shape != ():
        raise TypeError(f"scale must be a float32 scalar, got {scale.dtype}{list(scale.shape)}")
    if aux.dtype != np.int32 or aux.ndim != 1:
        raise TypeError(f"the int32 operand must be 1-D int32, got {aux.dtype}{list(aux.shape)}")
    return jax.core.ShapedArray(plan.result_shape(acc.shape, aux.shape), plan.dtype)


def _cuda_lowering(ctx, acc, scale, aux, *, plan: Plan):
    from . import kernel_cache  # imports cutlass lazily, at the first CUDA lowering (if the disk cache misses)

    plan.launch_extents(ctx.avals_in[0].shape)  # CUDA's grid limits, checked before any compile
    kernel = kernel_cache.get_kernel(*plan.kernel_key)
    if arch.cuda_devices():  # lowering for export on a machine without a GPU needs no registration
        _ffi.register()
    return jax.ffi.ffi_lowering(_ffi.TARGET_NAME)(
        ctx, acc, scale, aux, module=kernel.module, fingerprint=_ffi.call_fingerprint(kernel.fingerprint),
        **plan.ffi_attributes())


# ---- sharding: batch and heads shard without any collective; other axes are gathered ---------------
def _shard_fn(acc, scale, aux, plan):
    return _dq_postprocess_shard_p.bind(acc, scale, aux, plan=plan)


def _partition(plan, mesh, arg_shapes, result_shape):
    sharding = arg_shapes[0].sharding
    ndim = len(arg_shapes[0].shape)
    spec = tuple(getattr(sharding, "spec", ())) if sharding is not None else ()
    acc_s, aux_s, out_s = plan.shard_specs(spec + (None,) * (ndim - len(spec)))
    arg_shardings = tuple(NamedSharding(mesh, P(*s)) for s in (acc_s, (), aux_s))
    lower = functools.partial(_shard_fn, plan=plan)  # the same op on each device's shards
    return mesh, lower, NamedSharding(mesh, P(*out_s)), arg_shardings


@functools.cache
def _partitioned(rule: tuple[str, tuple[str, ...]]):
    """custom_partitioning of the op for one Shardy rule (``Plan.sharding_rule``): batch and heads factors
    shard; sequence, head-dim and work-list factors need replication (Shardy all-gathers them)."""
    fn = custom_partitioning(_shard_fn, static_argnums=(3,))
    fn.def_partition(_partition, sharding_rule=rule[0], need_replication_factors=rule[1])
    return fn


def _partitioned_impl(acc, scale, aux, *, plan: Plan):
    return _partitioned(plan.sharding_rule())(acc, scale, aux, plan)


# ---- autodiff: the op is linear in dq_accum (and in scale) ------------------------------------------
def _jvp(primals, tangents, *, plan: Plan):
    acc, scale, aux = primals
    acc_dot, scale_dot, _ = tangents
    out = dq_postprocess_p.bind(acc, scale, aux, plan=plan)
    terms = []
    if type(acc_dot) is not ad_util.Zero:
        terms.append(dq_postprocess_p.bind(acc_dot, scale, aux, plan=plan))
    if type(scale_dot) is not ad_util.Zero:
        terms.append(dq_postprocess_p.bind(acc, scale_dot, aux, plan=plan))
    if not terms:
        return out, ad_util.p2tz(out)
    return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _transpose(ct, acc, scale, aux, *, plan: Plan):
    """dq_accum's cotangent is the scatter back into accumulator order (``dq_accum_from_dq``); scale's is
    the sum of cotangent times the accumulator values the op read."""
    if ad.is_undefined_primal(aux):
        raise ValueError("dq_postprocess is not differentiable in its integer operand")
    if ad.is_undefined_primal(acc) and ad.is_undefined_primal(scale):
        raise ValueError("dq_postprocess is bilinear in (dq_accum, scale); transpose one at a time")
    if type(ct) is ad_util.Zero:
        return [None, None, None]
    if ad.is_undefined_primal(acc):
        return [accum_from_dq_reference(ct, scale, aux, plan), None, None]
    x, keep = gather_accumulator(acc, aux, plan)
    scale_bar = jax.numpy.sum(jax.numpy.where(keep, ct.astype(np.float32) * x, 0.0))
    return [None, scale_bar.astype(scale.aval.dtype), None]


# ---- vmap: fold the mapped axis into the kernel's batch (dense) or heads (varlen) ---------------------
def _batch(args, dims, *, plan: Plan):
    acc, scale, aux = args
    acc_dim, scale_dim, aux_dim = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    acc = _moved(acc, acc_dim, size)
    if scale_dim is not _NOT_MAPPED:
        # A per-element scale: apply it first (the same single fp32 multiply), then convert with 1.
        s = jax.numpy.moveaxis(scale, scale_dim, 0).reshape((size,) + (1,) * (acc.ndim - 1))
        acc, scale = mul_f32_rn(acc, s), jax.numpy.float32(1.0)
    n = acc.shape[0]
    if plan.work is not None:
        if aux_dim is _NOT_MAPPED:
            # The same offsets for every element: (N, H, L) is (N*H, L), one call; the result (T, N*H, D)
            # is (T, N, H, D) with the mapped axis at 1 (no transpose here; JAX moves it if needed).
            h = acc.shape[1]
            out = dq_postprocess_p.bind(acc.reshape((n * h,) + acc.shape[2:]), scale, aux, plan=plan)
            return out.reshape((out.shape[0], n, h) + out.shape[2:]), 1
        meta = _moved(aux, aux_dim, size)  # per-element offsets: one call each
        out = jax.lax.map(lambda xs: dq_postprocess_p.bind(xs[0], scale, xs[1], plan=plan), (acc, meta))
        return out, 0
    # Dense: (N, B, H, L) is (N*B, H, L); seqused_q (N, B) is (N*B,).
    b = acc.shape[1]
    acc = acc.reshape((n * b,) + acc.shape[2:])
    if plan.seqused_q:
        aux = _moved(aux, aux_dim, size).reshape(n * b)
    out = dq_postprocess_p.bind(acc, scale, aux, plan=plan)
    return out.reshape((n, b) + out.shape[1:]), 0


def _moved(x, dim, size):
    """``x`` with its mapped axis first (broadcast to ``size`` if unmapped)."""
    if dim is _NOT_MAPPED:
        return jax.numpy.broadcast_to(x, (size,) + x.shape)
    return jax.numpy.moveaxis(x, dim, 0)


# ---- registrations: every rule of the primitives, in one place -----------------------------------
# dq_postprocess_p: what users bind; autodiff and vmap rules; lowers through custom partitioning (which
# needs the devices while lowering).
dq_postprocess_p.def_impl(functools.partial(dispatch.apply_primitive, dq_postprocess_p))
dq_postprocess_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(dq_postprocess_p, mlir.lower_fun(_partitioned_impl, multiple_results=False))
dispatch.prim_requires_devices_during_lowering.add(dq_postprocess_p)
ad.primitive_jvps[dq_postprocess_p] = _jvp
ad.primitive_transposes[dq_postprocess_p] = _transpose
batching.primitive_batchers[dq_postprocess_p] = _batch
# _dq_postprocess_shard_p: one device's shards; the CUDA kernel, or the jax.numpy reference elsewhere.
_dq_postprocess_shard_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_dq_postprocess_shard_p, mlir.lower_fun(dq_postprocess_reference, multiple_results=False))
mlir.register_lowering(_dq_postprocess_shard_p, _cuda_lowering, platform="cuda")
