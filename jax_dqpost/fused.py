"""The fused postprocess primitive (dQ, dK, dV and the sink gradient in one launch): every rule (abstract eval,
lowerings, vmap, JVP, transpose, sharding), registered in one block at the end.

Operands and results as :class:`~jax_dqpost.plan.FusedPlan` lists them; its one parameter is ``fplan``, which
every rule asks. As for ``dq_postprocess_p`` (``primitive.py``): ``postprocess_p`` is what the API binds and
lowers through ``custom_partitioning``; each device runs ``_postprocess_shard_p``, which lowers on CUDA to our
FFI target v2 carrying the fused CuTe module (``kernel_fused.py``) and elsewhere to the jax.numpy reference.

Autodiff: linear in the accumulators (their transpose is ``dq_accum_from_dq`` for each tensor) and bilinear in
the scales, as ``dq_postprocess``; ``dsink`` is differentiable in ``learnable_sink``, ``lse`` and ``dpsum``
(its tangent is computed by the float32 reference formula, ``reference.dsink_reference``); the integer operands
are not differentiable.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import ad_util, dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _ffi, arch
from .plan import FusedPlan
from .primitive import _moved
from .reference import accum_from_dq_reference, dsink_reference, fused_reference, gather_accumulator, mul_f32_rn

postprocess_p = Primitive("flash_attention_postprocess")
postprocess_p.multiple_results = True
_postprocess_shard_p = Primitive("flash_attention_postprocess_shard")
_postprocess_shard_p.multiple_results = True

_NOT_MAPPED = None
# The fused kernel's pointer slot of each operand and result (kernel_cache.FUSED_SLOTS).
_ARG_SLOTS = {"acc": (0, 3, 5), "aux": (2, 7), "scales": 8, "sink": (9, 10, 11)}
_OUT_SLOTS = (1, 4, 6)
_DSINK_SLOT = 12


def _abstract_eval(*args, fplan: FusedPlan):
    ops = fplan.split(args)
    for a in ops["acc"]:
        if a.dtype != np.float32:
            raise TypeError(f"the accumulators must be float32, got {a.dtype}")
    for a in ops["aux"]:
        if a.dtype != np.int32 or a.ndim != 1:
            raise TypeError(f"the int32 operands must be 1-D int32, got {a.dtype}{list(a.shape)}")
    if ops["scales"].dtype != np.float32 or ops["scales"].shape != (3,):
        raise TypeError(f"scales must be float32 (3,), got {ops['scales'].dtype}{list(ops['scales'].shape)}")
    if fplan.has_sink:
        if ops["sink"].dtype != fplan.sink_dtype:
            raise TypeError(f"learnable_sink must be {np.dtype(fplan.sink_dtype).name}, got {ops['sink'].dtype}")
        for name in ("lse", "dpsum"):
            if ops[name].dtype != np.float32:
                raise TypeError(f"{name} must be float32, got {ops[name].dtype}")
    return [jax.core.ShapedArray(shape, dtype) for shape, dtype in fplan.result_shapes([a.shape for a in args])]


def _cuda_lowering(ctx, *args, fplan: FusedPlan):
    from . import kernel_cache  # imports cutlass lazily, at the first CUDA lowering (if the disk cache misses)

    avals = fplan.split(ctx.avals_in)
    extents, ctas = fplan.launch([a.shape for a in avals["acc"]])
    kernel = kernel_cache.get_fused_kernel(*fplan.kernel_key)
    if arch.cuda_devices():
        _ffi.register()
    acc_slots = _ARG_SLOTS["acc"][:len(fplan.parts)]
    aux_slots = _ARG_SLOTS["aux"][:2 if fplan.has_kv else 1]
    sink_slots = _ARG_SLOTS["sink"] if fplan.has_sink else ()
    arg_slots = fplan.join(acc_slots, aux_slots, _ARG_SLOTS["scales"], *sink_slots)
    out_slots = list(_OUT_SLOTS[:len(fplan.parts)]) + ([_DSINK_SLOT] if fplan.has_sink else [])
    sizes = [int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in list(ctx.avals_in) + list(ctx.avals_out)]
    return jax.ffi.ffi_lowering(_ffi.FUSED_TARGET_NAME)(
        ctx, *args, module=kernel.module, fingerprint=_ffi.call_fingerprint(kernel.fingerprint),
        slots=np.asarray(arg_slots + out_slots, np.int64), bytes=np.asarray(sizes, np.int64),
        extents=np.asarray(extents, np.int64), ctas=np.int64(ctas))


# ---- sharding: batch and heads shard without any collective (a batch-sharded dsink: one psum) --------
def _shard_fn(*args):
    *args, fplan = args
    return tuple(_postprocess_shard_p.bind(*args, fplan=fplan))


def _specs(fplan: FusedPlan, mesh, acc_spec: tuple, kv_heads: int | None):
    """Partition specs ``(operands, results, batch axes)`` when dq_accum's axes are sharded as ``acc_spec``:
    dQ's batch and heads shard; dK/dV's heads take the query heads' axes when they divide evenly (so a device
    keeps the key/value heads of its query heads), and their batch the same axes as dQ's."""
    q, k = fplan.dq, fplan.dk
    batch, heads = (None, acc_spec[0]) if q.work is not None else (acc_spec[0], acc_spec[1])
    acc = [(heads, None) if q.work is not None else (batch, heads, None)]
    aux = [(batch,) if q.seqused_q else (None,)]
    outs = [(None, heads, None) if q.work is not None else (batch, None, heads, None)]
    if fplan.has_kv:
        kv_heads = heads if _divides(mesh, heads, kv_heads) else None
        k_batch = batch if k.work is None else None
        kv_acc = (kv_heads, None) if k.work is not None else (k_batch, kv_heads, None)
        acc += [kv_acc, kv_acc]
        aux.append((k_batch,) if k.seqused_q else (None,))
        kv_out = (None, kv_heads, None) if k.work is not None else (k_batch, None, kv_heads, None)
        outs += [kv_out, kv_out]
    sink = ()
    if fplan.has_sink:
        rows = (heads, None) if q.work is not None else (batch, heads, None)
        sink = ((heads,), rows, rows)
        outs.append((heads,))
    return fplan.join(acc, aux, (None,), *sink), outs, batch


def _divides(mesh, axes, size) -> bool:
    if axes is None:
        return True
    names = axes if isinstance(axes, tuple) else (axes,)
    return size % int(np.prod([mesh.shape[n] for n in names])) == 0


def _partition(fplan, mesh, arg_shapes, result_shape):
    sharding = arg_shapes[0].sharding
    ndim = len(arg_shapes[0].shape)
    spec = tuple(getattr(sharding, "spec", ())) if sharding is not None else ()
    arg_specs, out_specs, batch = _specs(fplan, mesh, spec + (None,) * (ndim - len(spec)), _kv_heads(fplan, arg_shapes))
    arg_shardings = tuple(NamedSharding(mesh, P(*s)) for s in arg_specs)
    out_shardings = [NamedSharding(mesh, P(*s)) for s in out_specs]
    if fplan.has_sink and batch is not None:
        # Each batch shard sums its own sequences: float32 partial sums, added across shards, then rounded.
        partial = dataclasses.replace(fplan, dsink_dtype=np.dtype(np.float32))

        def lower(*args):
            *outs, dsink = _postprocess_shard_p.bind(*args, fplan=partial)
            return (*outs, jax.lax.psum(dsink, batch).astype(fplan.dsink_dtype))
    else:
        def lower(*args):
            return tuple(_postprocess_shard_p.bind(*args, fplan=fplan))
    return mesh, lower, tuple(out_shardings), arg_shardings


def _kv_heads(fplan: FusedPlan, arg_shapes):
    if not fplan.has_kv:
        return None
    dk = fplan.split(arg_shapes)["acc"][1]
    return dk.shape[0] if fplan.dk.work is not None else dk.shape[1]


def _rule(fplan: FusedPlan) -> tuple[str, tuple[str, ...]]:
    """Shardy's einsum-like rule: batch ``b``, query heads ``h`` and key/value heads ``g`` may shard; every other
    factor needs replication."""
    q, k = fplan.dq, fplan.dk
    acc = ["h l" if q.work is not None else "b h l"]
    aux = ["k" if q.work is not None else ("b" if q.seqused_q else "z")]
    outs = ["t h d" if q.work is not None else "b s h d"]
    if fplan.has_kv:
        acc += ["g m", "g n"] if k.work is not None else ["b g m", "b g n"]
        aux.append("w" if k.work is not None else ("b" if k.seqused_q else "y"))
        outs += ["u g e", "u g f"] if k.work is not None else ["b u g e", "b u g f"]
    sink = ()
    if fplan.has_sink:
        sink = ("h", "h t", "h r") if q.work is not None else ("h", "b h t", "b h r")
        outs.append("h")
    operands = fplan.join(acc, aux, "c", *sink)
    factors = "".join(operands + outs).replace(" ", "")
    replicated = tuple(dict.fromkeys(f for f in factors if f not in "bhg"))  # in order of appearance
    return ", ".join(operands) + " -> " + ", ".join(outs), replicated


@functools.cache
def _partitioned(fplan: FusedPlan):
    """custom_partitioning of the op for one plan (its Shardy rule depends on the plan's tilings)."""
    fn = custom_partitioning(_shard_fn, static_argnums=(fplan.num_operands,))
    rule, replicated = _rule(fplan)
    fn.def_partition(_partition, sharding_rule=rule, need_replication_factors=replicated)
    return fn


def _partitioned_impl(*args, fplan: FusedPlan):
    return list(_partitioned(fplan)(*args, fplan))


# ---- autodiff --------------------------------------------------------------------------------------
def _jvp(primals, tangents, *, fplan: FusedPlan):
    outs = postprocess_p.bind(*primals, fplan=fplan)
    ops, dots = fplan.split(primals), fplan.split(tangents)
    linear = fplan.without_sink()
    terms = []
    acc_dots = [None if type(t) is ad_util.Zero else t for t in dots["acc"]]
    if any(t is not None for t in acc_dots):
        acc_dots = [jnp.zeros(a.shape, a.dtype) if t is None else t for a, t in zip(ops["acc"], acc_dots)]
        terms.append(postprocess_p.bind(*linear.join(acc_dots, _aux(ops, fplan), ops["scales"]), fplan=linear))
    if type(dots["scales"]) is not ad_util.Zero:
        terms.append(postprocess_p.bind(*linear.join(ops["acc"], _aux(ops, fplan), dots["scales"]), fplan=linear))
    n = len(fplan.parts)
    if terms:
        out_dots = [terms[0][i] if len(terms) == 1 else terms[0][i] + terms[1][i] for i in range(n)]
    else:
        out_dots = [ad_util.p2tz(o) for o in outs[:n]]
    if fplan.has_sink:
        sink_dot = _dsink_tangent(ops, dots, fplan)
        out_dots.append(ad_util.p2tz(outs[n]) if sink_dot is None else sink_dot.astype(outs[n].dtype))
    return outs, out_dots


def _aux(ops, fplan: FusedPlan):
    return (ops["aux"][0], ops["aux"][1]) if fplan.has_kv else (ops["aux"][0],)


def _dsink_tangent(ops, dots, fplan: FusedPlan):
    """The tangent of dsink, from the float32 formula (``reference.dsink_reference``), or None if it is zero."""
    names = ("sink", "lse", "dpsum")
    if all(type(dots[n]) is ad_util.Zero for n in names):
        return None
    primals = tuple(ops[n] for n in names)
    tangents = tuple(jnp.zeros(ops[n].shape, ops[n].dtype) if type(dots[n]) is ad_util.Zero else dots[n]
                     for n in names)
    aux = ops["aux"][0]
    return jax.jvp(lambda *xs: dsink_reference(*xs, aux, fplan.dq), primals, tangents)[1]


def _transpose(cts, *args, fplan: FusedPlan):
    """The accumulators' cotangents are the scatters back into accumulator order (``dq_accum_from_dq``); the
    scales' are the sums of cotangent times the accumulator values read. (The JVP transposes only the linear,
    sink-free form.)"""
    if fplan.has_sink:
        raise ValueError("flash_attention_postprocess: the op with a sink is transposed through its JVP only")
    ops = fplan.split(args)
    if any(ad.is_undefined_primal(a) for a in ops["aux"]):
        raise ValueError("flash_attention_postprocess is not differentiable in its integer operands")
    undefined_acc = [ad.is_undefined_primal(a) for a in ops["acc"]]
    scales = ops["scales"]
    acc_cts = [None] * len(fplan.parts)
    scales_ct = None
    if ad.is_undefined_primal(scales):
        if any(undefined_acc):
            raise ValueError("flash_attention_postprocess is bilinear in (accumulators, scales); transpose one at a "
                             "time")
        bars = []
        for i, (p, acc, aux) in enumerate(zip(fplan.parts, ops["acc"], ops["aux"])):
            ct = cts[i]
            if type(ct) is ad_util.Zero:
                bars.append(jnp.zeros((), jnp.float32))
                continue
            x, keep = gather_accumulator(acc, aux, p)
            bars.append(jnp.sum(jnp.where(keep, ct.astype(np.float32) * x, 0.0)))
        scales_ct = jnp.stack(bars + [jnp.zeros((), jnp.float32)] * (3 - len(bars))).astype(scales.aval.dtype)
    else:
        for i, (p, acc, aux) in enumerate(zip(fplan.parts, ops["acc"], ops["aux"])):
            if not undefined_acc[i]:
                continue
            ct = cts[i]
            if type(ct) is ad_util.Zero:
                acc_cts[i] = None
            else:
                acc_cts[i] = accum_from_dq_reference(ct, scales[i], aux, p)
    aux_none = (None, None) if fplan.has_kv else (None,)
    return fplan.join(acc_cts, aux_none, scales_ct)


# ---- vmap: fold the mapped axis into each tensor's batch (dense) or heads -----------------------------
def _batch(args, dims, *, fplan: FusedPlan):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    ops, ds = fplan.split(args), fplan.split(dims)
    q_heads_fold = fplan.dq.work is not None or fplan.has_sink
    k_heads_fold = fplan.has_kv and (fplan.dk.work is not None or (q_heads_fold and fplan.dq.work is None))
    folds = [q_heads_fold] + [k_heads_fold] * (len(fplan.parts) - 1)
    # Per-element offsets (or lengths that cannot fold): one call per element.
    aux_mapped = [d is not _NOT_MAPPED for d in ds["aux"]]
    if any(m and (fold or p.work is not None) for m, fold, p in zip(aux_mapped, folds, fplan.parts)):
        moved = [_moved(a, d, size) for a, d in zip(args, dims)]
        outs = jax.lax.map(lambda xs: tuple(postprocess_p.bind(*xs, fplan=fplan)), moved)
        return list(outs), [0] * len(outs)
    accs = [_moved(a, d, size) for a, d in zip(ops["acc"], ds["acc"])]
    scales = ops["scales"]
    if ds["scales"] is not _NOT_MAPPED:
        # Per-element scales: apply them first (the same single fp32 multiply), then convert with 1.
        s = jnp.moveaxis(scales, ds["scales"], 0)
        accs = [mul_f32_rn(a, s[:, i].reshape((size,) + (1,) * (a.ndim - 1))) for i, a in enumerate(accs)]
        scales = jnp.ones((3,), jnp.float32)
    new_acc, new_aux = [], []
    for i, (p, a, fold) in enumerate(zip(fplan.parts, accs, folds)):
        if p.work is not None:  # (N, H, L) -> (N*H, L)
            new_acc.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
        elif fold:  # (N, B, H, L) -> (B, N*H, L)
            a = jnp.moveaxis(a, 0, 1)
            new_acc.append(a.reshape((a.shape[0], size * a.shape[2]) + a.shape[3:]))
        else:  # (N, B, H, L) -> (N*B, H, L)
            new_acc.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
    for j, (aux, d) in enumerate(zip(ops["aux"], ds["aux"])):
        p = fplan.parts[0 if j == 0 else 1]
        if p.work is None and p.seqused_q and not folds[0 if j == 0 else 1]:
            aux = _moved(aux, d, size).reshape(-1)
        new_aux.append(aux)
    sink = ()
    if fplan.has_sink:
        s_, lse, dpsum = (_moved(ops[n], ds[n], size) for n in ("sink", "lse", "dpsum"))
        if fplan.dq.work is not None:  # (N, H, X) -> (N*H, X)
            lse, dpsum = (x.reshape((size * x.shape[1],) + x.shape[2:]) for x in (lse, dpsum))
        else:  # (N, B, H, X) -> (B, N*H, X)
            lse, dpsum = (jnp.moveaxis(x, 0, 1) for x in (lse, dpsum))
            lse, dpsum = (x.reshape((x.shape[0], size * x.shape[2]) + x.shape[3:]) for x in (lse, dpsum))
        sink = (s_.reshape(-1), lse, dpsum)
    outs = postprocess_p.bind(*fplan.join(new_acc, new_aux, scales, *sink), fplan=fplan)
    result, out_dims = [], []
    for p, o, fold in zip(fplan.parts, outs, folds):
        if p.work is not None:  # (T, N*H, D) -> (T, N, H, D)
            result.append(o.reshape((o.shape[0], size, o.shape[1] // size) + o.shape[2:]))
            out_dims.append(1)
        elif fold:  # (B, S, N*H, D) -> (B, S, N, H, D)
            result.append(o.reshape(o.shape[:2] + (size, o.shape[2] // size) + o.shape[3:]))
            out_dims.append(2)
        else:  # (N*B, S, H, D) -> (N, B, S, H, D)
            result.append(o.reshape((size, o.shape[0] // size) + o.shape[1:]))
            out_dims.append(0)
    if fplan.has_sink:
        result.append(outs[-1].reshape(size, -1))
        out_dims.append(0)
    return result, out_dims


# ---- registrations: every rule of the primitives, in one place -----------------------------------
postprocess_p.def_impl(functools.partial(dispatch.apply_primitive, postprocess_p))
postprocess_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(postprocess_p, mlir.lower_fun(_partitioned_impl, multiple_results=True))
dispatch.prim_requires_devices_during_lowering.add(postprocess_p)
ad.primitive_jvps[postprocess_p] = _jvp
ad.primitive_transposes[postprocess_p] = _transpose
batching.primitive_batchers[postprocess_p] = _batch
_postprocess_shard_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_postprocess_shard_p, mlir.lower_fun(fused_reference, multiple_results=True))
mlir.register_lowering(_postprocess_shard_p, _cuda_lowering, platform="cuda")
