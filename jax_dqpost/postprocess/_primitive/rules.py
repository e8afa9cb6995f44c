"""The postprocess primitive: every rule (abstract eval, lowerings, vmap, JVP, transpose, sharding), registered in
one block at the end.

Operands and results in the order of ``_kernel/abi.py``; its one parameter is ``plan`` (:class:`~.plan.Plan`), which
every rule asks. ``dq_postprocess`` binds it with one part, ``flash_attention_postprocess`` with one or three,
and either with a sink.

``postprocess_p`` is what the API binds; it lowers through ``custom_partitioning`` (batch and heads shard, other
axes are gathered). Each device then runs ``_postprocess_shard_p`` on its shards, which lowers on CUDA to a custom
call to our FFI target carrying the CuTe module (``cuda_lowering.py``) and on every other platform to the jax.numpy
reference (``reference.py``), so results are the same bits everywhere.

Autodiff: linear in the accumulators (their transpose is ``dq_accum_from_dq`` for each tensor) and bilinear in
the scales; ``dsink`` is differentiable in ``learnable_sink``, ``lse`` and ``dpsum`` (its tangent is computed by the
float32 reference formula, ``reference.dsink_reference``); the integer operands are not differentiable.
"""

from __future__ import annotations

import dataclasses
import functools
import string

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


from ... import _jax_internals
from . import cuda_lowering
from .plan import Operands, Plan
from .reference import accum_from_dq_reference, dsink_reference, gather_accumulator, mul_f32_rn, postprocess_reference

postprocess_p = Primitive("jax_dqpost_postprocess")
postprocess_p.multiple_results = True
_postprocess_shard_p = Primitive("jax_dqpost_postprocess_shard")
_postprocess_shard_p.multiple_results = True

_NOT_MAPPED = None  # vmap's batch dimension of an unbatched operand


def _moved(x, dim, size):
    """``x`` with its mapped axis first (broadcast to ``size`` if unmapped)."""
    if dim is _NOT_MAPPED:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, dim, 0)


def _abstract_eval(*args, plan: Plan):
    plan.check_dtypes(args)
    shapes = [a.shape for a in args]
    results = plan.result_shapes(shapes)
    plan.launch(plan.group(shapes).acc)  # CUDA's grid limits, on every platform (vmap folds into the batch)
    # Inside jax.shard_map the results vary over the operands' manual axes (one set: _bind casts them to it).
    return [_jax_internals.result_aval(shape, dtype, args) for shape, dtype in results]


def bind(args, plan: Plan) -> list:
    """``postprocess_p`` on ``args``, each made varying over the union of their manual axes of ``jax.shard_map``
    first (``jax.lax.pcast``: a replicated scale, sink or offset meets varying accumulators), as jax.numpy's own
    operations do; the results vary over that union (``_abstract_eval``). Outside ``shard_map``, a plain bind."""
    return postprocess_p.bind(*_jax_internals.vary_alike(*args), plan=plan)


# ---- sharding: batch and heads shard without any collective (a batch-sharded dsink: one psum) --------
def _shard_fn(*args):
    *args, plan = args
    return tuple(_postprocess_shard_p.bind(*args, plan=plan))


def _factors(plan: Plan) -> list[list[str]]:
    """Each buffer's axes (``abi.BUFFERS``) as sharding factors: ``b`` the batch, ``h`` the query heads, ``g`` the
    key/value heads, and a letter of its own for every axis that is never sharded."""
    own = iter(c for c in string.ascii_lowercase if c not in "bhg")
    heads = {"q": "h", "k": "g"}
    return [[a if a == "b" else heads[buffer.side] if a == "h" else next(own)
             for a in buffer.axes[plan.tiling_of(buffer)].split()] for buffer in plan.operands + plan.results]


def _specs(plan: Plan, mesh, acc_spec: tuple, kv_heads: int | None):
    """Partition specs ``(operands, results, batch axes)`` when dq_accum's axes are sharded as ``acc_spec``:
    dQ's batch and heads shard; dK/dV's heads take the query heads' axes when they divide evenly (so a device
    keeps the key/value heads of its query heads), and their batch the same axes as dQ's."""
    factors = _factors(plan)
    axes = {f: s for f, s in zip(factors[0], acc_spec) if f in "bh"}  # dq_accum's batch and heads; the rest gathered
    axes["g"] = axes["h"] if len(plan.parts) > 1 and _divides(mesh, axes["h"], kv_heads) else None
    specs = [tuple(axes.get(f) for f in buffer) for buffer in factors]
    return specs[:plan.num_operands], specs[plan.num_operands:], axes.get("b")


def _divides(mesh, axes, size) -> bool:
    if axes is None:
        return True
    names = axes if isinstance(axes, tuple) else (axes,)
    return size % int(np.prod([mesh.shape[n] for n in names])) == 0


def _operand_specs(plan, mesh, arg_shapes):
    """:func:`_specs` for dq_accum's sharding as the partitioner gives it."""
    sharding = arg_shapes[0].sharding
    ndim = len(arg_shapes[0].shape)
    spec = tuple(getattr(sharding, "spec", ())) if sharding is not None else ()
    return _specs(plan, mesh, spec + (None,) * (ndim - len(spec)), _kv_heads(plan, arg_shapes))


def _infer(plan, mesh, arg_shapes, result_shape):
    """The results' shardings (GSPMD asks for them before it partitions)."""
    return tuple(NamedSharding(mesh, P(*s)) for s in _operand_specs(plan, mesh, arg_shapes)[1])


def _partition(plan, mesh, arg_shapes, result_shape):
    arg_specs, out_specs, batch = _operand_specs(plan, mesh, arg_shapes)
    arg_shardings = tuple(NamedSharding(mesh, P(*s)) for s in arg_specs)
    out_shardings = [NamedSharding(mesh, P(*s)) for s in out_specs]
    if plan.has_sink and batch is not None:
        # Each batch shard sums its own sequences: float32 partial sums, added across shards, then rounded.
        partial = dataclasses.replace(plan, dsink_dtype=np.dtype(np.float32))

        def lower(*args):
            *outs, dsink = _postprocess_shard_p.bind(*args, plan=partial)
            return (*outs, jax.lax.psum(dsink, batch).astype(plan.dsink_dtype))
    else:
        def lower(*args):
            return tuple(_postprocess_shard_p.bind(*args, plan=plan))
    return mesh, lower, tuple(out_shardings), arg_shardings


def _kv_heads(plan: Plan, arg_shapes):
    if len(plan.parts) == 1:
        return None
    return plan.parts[1].heads(plan.group(arg_shapes).acc[1].shape)


def _rule(plan: Plan) -> tuple[str, tuple[str, ...]]:
    """Shardy's einsum-like rule (:func:`_factors`): batch ``b``, query heads ``h`` and key/value heads ``g`` may
    shard; every other factor needs replication."""
    factors = [" ".join(f) for f in _factors(plan)]
    rule = ", ".join(factors[:plan.num_operands]) + " -> " + ", ".join(factors[plan.num_operands:])
    replicated = tuple(dict.fromkeys(f for f in rule if f.isalpha() and f not in "bhg"))  # in order of appearance
    return rule, replicated


@functools.cache
def _partitioned(plan: Plan):
    """custom_partitioning of the op for one plan (its Shardy rule depends on the plan's tilings)."""
    fn = custom_partitioning(_shard_fn, static_argnums=(plan.num_operands,))
    rule, replicated = _rule(plan)
    fn.def_partition(_partition, infer_sharding_from_operands=_infer, sharding_rule=rule,
                     need_replication_factors=replicated)
    return fn


def _partitioned_impl(*args, plan: Plan):
    return list(_partitioned(plan)(*args, plan))


def _unpartitioned_impl(*args, plan: Plan):
    return list(_postprocess_shard_p.bind(*args, plan=plan))


EXPORT_RECIPE = (
    "export jax.jit(jax.shard_map(f, mesh=mesh, in_specs=..., out_specs=...)) instead, with the batch and heads axes "
    "sharded: each device then runs the op on its own shards, and the artifact serializes (docs/postprocess.md, "
    "\"Inside JAX\")")
"""How to export a sharded program that calls the op (``jax.export`` cannot serialize ``custom_partitioning``)."""


def _lowering(ctx, *args, plan: Plan):
    """Through ``custom_partitioning``, which needs the program's devices. jax hands a lowering the devices only when
    the program's jaxpr holds a primitive that asks for them, as ours does (so a top-level jit, export or
    ``shard_map`` never takes the other branch); bound inside another primitive's own lowering (fa4-jax's backward,
    lowered with ``mlir.lower_fun``), the op finds none, and lowers unpartitioned: one device's program as is; in an
    automatically partitioned program XLA treats it as it treats the custom calls around it. ``jax.export`` of a
    program partitioned over several devices would carry custom_partitioning's host callback, which it cannot
    serialize: that raises here, with the recipe that works."""
    nested = _jax_internals.lowered_without_devices(ctx)
    devices = 0 if nested or not _jax_internals.lowered_for_export(ctx) else _jax_internals.partitioned_over(ctx)
    if devices > 1:
        raise ValueError(f"jax_dqpost: jax.export cannot serialize a program that partitions the op over {devices} "
                         f"devices (jax's custom_partitioning is a host callback); {EXPORT_RECIPE}")
    impl = _unpartitioned_impl if nested else _partitioned_impl
    return mlir.lower_fun(impl, multiple_results=True)(ctx, *args, plan=plan)


# ---- autodiff --------------------------------------------------------------------------------------
def _jvp(primals, tangents, *, plan: Plan):
    outs = bind(primals, plan)
    ops, dots = plan.group(primals), plan.group(tangents)
    linear = plan.without_sink()
    terms = []
    acc_dots = [None if type(t) is ad.Zero else t for t in dots.acc]
    if any(t is not None for t in acc_dots):
        acc_dots = tuple(jnp.zeros(a.shape, a.dtype) if t is None else t for a, t in zip(ops.acc, acc_dots))
        terms.append(bind(linear.join(ops._replace(acc=acc_dots)), linear))
    if type(dots.scales) is not ad.Zero:
        terms.append(bind(linear.join(ops._replace(scales=dots.scales)), linear))
    n = len(plan.parts)
    if terms:
        out_dots = [terms[0][i] if len(terms) == 1 else terms[0][i] + terms[1][i] for i in range(n)]
    else:
        out_dots = [_zero_tangent(o) for o in outs[:n]]
    if plan.has_sink:
        sink_dot = _dsink_tangent(ops, dots, plan)
        out_dots.append(_zero_tangent(outs[n]) if sink_dot is None else sink_dot.astype(outs[n].dtype))
    return outs, out_dots


def _zero_tangent(x):
    return ad.Zero(jax.typeof(x).to_tangent_aval())


def _dsink_tangent(ops, dots, plan: Plan):
    """The tangent of dsink, from the float32 formula (``reference.dsink_reference``), or None if it is zero."""
    if all(type(t) is ad.Zero for t in dots.sink):
        return None
    tangents = tuple(jnp.zeros_like(x) if type(t) is ad.Zero else t for x, t in zip(ops.sink, dots.sink))
    return jax.jvp(lambda *xs: dsink_reference(*xs, ops.aux[0], plan.dq), ops.sink, tangents)[1]


def _transpose(cts, *args, plan: Plan):
    """The accumulators' cotangents are the scatters back into accumulator order (``dq_accum_from_dq``); the
    scales' are the sums of cotangent times the accumulator values read. (The JVP transposes only the linear,
    sink-free form.)"""
    if plan.has_sink:
        raise ValueError("jax_dqpost: the op with a sink is transposed through its JVP only")
    ops = plan.group(args)
    if any(ad.is_undefined_primal(a) for a in ops.aux):
        raise ValueError("jax_dqpost: the postprocess is not differentiable in its integer operands")
    undefined_acc = [ad.is_undefined_primal(a) for a in ops.acc]
    scales = ops.scales
    acc_cts = [None] * len(plan.parts)
    scales_ct = None
    if ad.is_undefined_primal(scales):
        if any(undefined_acc):
            raise ValueError("jax_dqpost: the postprocess is bilinear in (accumulators, scales); transpose one at a "
                             "time")
        bars = []
        for i, (p, acc, aux) in enumerate(zip(plan.parts, ops.acc, plan.part_aux(ops))):
            ct = cts[i]
            if type(ct) is ad.Zero:
                bars.append(jnp.zeros((), jnp.float32))
                continue
            x, keep = gather_accumulator(acc, aux, p)
            bars.append(jnp.sum(jnp.where(keep, ct.astype(np.float32) * x, 0.0)))
        scales_ct = _jax_internals.vary_as(jnp.stack(bars).astype(scales.aval.dtype),
                                           _jax_internals.varying_axes(scales.aval))
    else:
        for i, (p, acc, aux) in enumerate(zip(plan.parts, ops.acc, plan.part_aux(ops))):
            if not undefined_acc[i]:
                continue
            ct = cts[i]
            if type(ct) is ad.Zero:
                acc_cts[i] = None
            else:
                acc_cts[i] = accum_from_dq_reference(ct, scales[i], aux, p)
    return plan.join(Operands(tuple(acc_cts), (None,) * len(ops.aux), scales_ct))


# ---- vmap: fold the mapped axis into each tensor's batch (dense) or heads -----------------------------
def _batch(args, dims, *, plan: Plan):
    # The shapes of one element first, so that a mistake is reported in the shapes the user wrote, not folded ones.
    _abstract_eval(*(a if d is _NOT_MAPPED else jax.core.ShapedArray(a.shape[:d] + a.shape[d + 1:], a.dtype)
                     for a, d in zip(args, dims)), plan=plan)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    ops, ds = plan.group(args), plan.group(dims)
    q_heads_fold = plan.dq.work is not None or plan.has_sink
    k_heads_fold = len(plan.parts) > 1 and (plan.parts[1].work is not None or (q_heads_fold and plan.dq.work is None))
    folds = [q_heads_fold] + [k_heads_fold] * (len(plan.parts) - 1)
    # Per-element offsets (or lengths that cannot fold): one call per element.
    aux_mapped = [d is not _NOT_MAPPED for d in plan.part_aux(ds)]
    if any(m and (fold or p.work is not None) for m, fold, p in zip(aux_mapped, folds, plan.parts)):
        moved = [_moved(a, d, size) for a, d in zip(args, dims)]
        outs = jax.lax.map(lambda xs: tuple(bind(xs, plan)), moved)
        return list(outs), [0] * len(outs)
    accs = [_moved(a, d, size) for a, d in zip(ops.acc, ds.acc)]
    scales = ops.scales
    if ds.scales is not _NOT_MAPPED:
        # Per-element scales: apply them first (the same single fp32 multiply), then convert with 1.
        s = jnp.moveaxis(scales, ds.scales, 0)
        accs = [mul_f32_rn(a, s[:, i].reshape((size,) + (1,) * (a.ndim - 1))) for i, a in enumerate(accs)]
        scales = jnp.ones((len(plan.parts),), jnp.float32)
    new_acc, new_aux = [], []
    for i, (p, a, fold) in enumerate(zip(plan.parts, accs, folds)):
        if p.work is not None:  # (N, H, L) -> (N*H, L)
            new_acc.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
        elif fold:  # (N, B, H, L) -> (B, N*H, L)
            a = jnp.moveaxis(a, 0, 1)
            new_acc.append(a.reshape((a.shape[0], size * a.shape[2]) + a.shape[3:]))
        else:  # (N, B, H, L) -> (N*B, H, L)
            new_acc.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
    for aux, d, p, fold in zip(ops.aux, ds.aux, plan.side_parts, folds):  # one per side
        if p.work is None and p.seqused and not fold:
            aux = _moved(aux, d, size).reshape(-1)
        new_aux.append(aux)
    sink = ()
    if plan.has_sink:
        s_, lse, dpsum = (_moved(x, d, size) for x, d in zip(ops.sink, ds.sink))
        if plan.dq.work is not None:  # (N, H, X) -> (N*H, X)
            lse, dpsum = (x.reshape((size * x.shape[1],) + x.shape[2:]) for x in (lse, dpsum))
        else:  # (N, B, H, X) -> (B, N*H, X)
            lse, dpsum = (jnp.moveaxis(x, 0, 1) for x in (lse, dpsum))
            lse, dpsum = (x.reshape((x.shape[0], size * x.shape[2]) + x.shape[3:]) for x in (lse, dpsum))
        sink = (s_.reshape(-1), lse, dpsum)
    outs = bind(plan.join(Operands(tuple(new_acc), tuple(new_aux), scales, *sink)), plan)
    result, out_dims = [], []
    for p, o, fold in zip(plan.parts, outs, folds):
        if p.work is not None:  # (T, N*H, D) -> (T, N, H, D)
            result.append(o.reshape((o.shape[0], size, o.shape[1] // size) + o.shape[2:]))
            out_dims.append(1)
        elif fold:  # (B, S, N*H, D) -> (B, S, N, H, D)
            result.append(o.reshape(o.shape[:2] + (size, o.shape[2] // size) + o.shape[3:]))
            out_dims.append(2)
        else:  # (N*B, S, H, D) -> (N, B, S, H, D)
            result.append(o.reshape((size, o.shape[0] // size) + o.shape[1:]))
            out_dims.append(0)
    if plan.has_sink:
        result.append(outs[-1].reshape(size, -1))
        out_dims.append(0)
    return result, out_dims


# ---- registrations: every rule of the primitives, in one place -----------------------------------
_jax_internals.def_impl(postprocess_p)
postprocess_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(postprocess_p, _lowering)
_jax_internals.require_devices_during_lowering(postprocess_p)
ad.primitive_jvps[postprocess_p] = _jvp
ad.primitive_transposes[postprocess_p] = _transpose
batching.primitive_batchers[postprocess_p] = _batch
_postprocess_shard_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_postprocess_shard_p, mlir.lower_fun(postprocess_reference, multiple_results=True))
mlir.register_lowering(_postprocess_shard_p, cuda_lowering.lower, platform="cuda")
