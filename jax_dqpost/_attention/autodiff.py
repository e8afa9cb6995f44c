"""FlashAttention's attention, differentiable in both modes, its reverse mode ending in one jax-dqpost launch; with
or without a learnable sink, and through the lse as well as the output.

A producer (:class:`Kernels`: fa4-jax's kernels in :mod:`jax_dqpost._attention.fa4`, a stand-in in the tests)
brings three steps: its forward, ``(out, lse)`` with the sink (if any) in every softmax row; its forward-mode
kernel, the tangents of out and lse for tangents of q, k and v, reading the forward's lse; and its backward up to
the accumulators (the preprocess's ``dpsum = rowsum(out * d_out)``, then the main kernel, which reads the
forward's lse and ``dpsum``).

:func:`attention` is a ``jax.custom_jvp``. Its JVP runs the forward and binds :data:`tangent_p`, linear in the
tangents of q, k, v and the sink. Forward mode (``jax.jvp``, ``jax.jacfwd``) evaluates it: the producer's
forward-mode kernel and the sink's terms. Reverse mode never does: JAX transposes it, and its transpose is the
backward: the producer's two steps, then one :func:`~jax_dqpost.flash_attention_postprocess` launch for dQ (dK and
dV under grouped-query attention) and dsink (``_primitive/backward.py``). One backward, with or without a sink.

Why the kernels need no sink: the sink ``t_h`` is one more logit of row ``i`` with no value vector, so
``P_ij = exp(scale * s_ij - lse_i)`` with the sink-including ``lse_i`` is the whole of what it changes.
Reverse: ``dS_ij = P_ij (dP_ij - D_i)`` with ``D_i = rowsum(dO * O)_i`` (the sink's ``dP`` is 0), and ``d t_h =
sum_i -P_it D_i``, ``P_it = exp(t_h - lse_i)``: the postprocess's dsink. A cotangent ``g`` of the lse adds ``g_i
P_ij`` to ``dS_ij`` and ``g_i P_it`` to ``d t_h``: ``D_i - g_i`` in place of ``D_i`` in both
(:func:`lse_cotangent_rows`). Forward: the kernel's tangents of out and lse for q, k, v are right with the
sink-including lse (the sink's logit has no tangent there); a tangent ``tau`` of the sink adds ``-P_it out_i tau``
to out's and ``P_it tau`` to the lse's (0 in rows whose lse is ``-inf``: rows no sequence uses).

vmap: a dense call with a shared sink folds the mapped axis into the producer's batch (one launch of each kernel;
per-example dsink from the postprocess's own vmap rule); a mapped sink, or a packed batch, runs the producer once
per element (``lax.map``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Hashable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import _jax_internals
from . import context
from ..postprocess._primitive.backward import Side, finish as finish_accumulators
from ..layout import AccumLayout, padded_total


class Kernels(Protocol):
    """A producer's steps (hashable: :class:`AttentionSpec` is a static argument). ``config`` is
    :attr:`AttentionSpec.config`; ``seqlens`` is None (dense) or fa4-jax's ``(cu_seqlens_q, cu_seqlens_k, seqused_q,
    seqused_k)``."""

    def forward(self, config, q, k, v, sink, seqlens):
        """``(out, lse)``: out ``(B, S, H, Dv)`` or ``(T, H, Dv)`` of q's dtype, the float32 natural-log lse
        ``(B, H, S)`` or ``(H, T)``, with the sink (None: none) in every row."""

    def tangent(self, config, q, k, v, out, lse, dq, dk, dv, seqlens):
        """``(t_out, t_lse)``: the tangents of out (q's dtype) and of the float32 lse for tangents ``dq``, ``dk``,
        ``dv`` of q, k, v, the probabilities read from the forward's ``lse``."""

    def accumulators(self, config, q, k, v, out, lse, d_out, dpsum_delta, seqlens):
        """The backward up to the postprocess, ``dpsum - dpsum_delta`` read in place of ``dpsum`` (None: 0): an
        ``Accumulators`` (``dq_accum, dk, dv, dk_accum, dv_accum, dpsum``; dk, dv without grouped-query attention,
        dk_accum, dv_accum with it, the others None)."""

    def context(self, spec, q, k, v):
        """Optional: ``(call, packed)``, the :class:`AttentionSpec` a device runs for its rows ``q`` ``(B, c, N,
        D)`` (each sequence's ``[i c, (i + 1) c)`` on device ``i``) of the dense self-attention ``spec``, every key
        ``k``, ``v`` ``(B, S, K, D|Dv)`` given (shape structs): where its rows read every key (no mask), the dense
        call on them (``packed`` False); else a packed call's, each sequence reading its keys up to its own last
        row, whose bottom-right mask is then ``spec``'s (``packed`` True). None where it has none (the rows are
        then gathered). A producer without it has none."""


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """One attention call, static: the producer, its description of the attention (fa4-jax: its ``AttnConfig``),
    the softmax scale (dQ's and dK's in the postprocess), and the orders of its accumulators (``dkv_layout``:
    grouped-query attention, where dK and dV are accumulated too; None where the main kernel writes them)."""

    kernels: Kernels
    config: Hashable
    scale: float
    dq_layout: AccumLayout
    dkv_layout: AccumLayout | None = None


def attention(spec: AttentionSpec, q, k, v, sink=None, seqlens=None):
    """``(out, lse)`` of the attention ``spec`` describes, with the learnable sink ``sink`` (H,) or None,
    differentiable in q, k, v and the sink, through both outputs, in both modes (module docstring). Inside
    ``jax.shard_map`` (its default check) every operand is cast to the union of their varying manual axes first, so
    that the gradients (which vary as they do) have its primals' types; a replicated sink (or offsets) used with
    batch-sharded q, k, v then gets its gradient summed over the batch's axes by jax's AD."""
    q, k, v, sink, *flat = _jax_internals.vary_alike(q, k, v, sink, *(seqlens or ()))
    return _attention(spec, q, k, v, sink, None if seqlens is None else tuple(flat))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _attention(spec, q, k, v, sink, seqlens):
    return tuple(_forward(spec)(q, k, v, sink, seqlens))


@_attention.defjvp
def _attention_jvp(spec, primals, tangents):
    q, k, v, sink, seqlens = primals
    dq, dk, dv, dsink, _ = tangents
    out, lse = _forward(spec)(q, k, v, sink, seqlens)
    form = _Form(spec, sink is not None, seqlens is not None)
    t_out, t_lse = tangent_p.bind(*form.join(q, k, v, out, lse, sink, seqlens, dq, dk, dv, dsink), form=form)
    return (out, lse), (t_out, t_lse)


# ---- the tangent: a primitive linear in the tangents, whose transpose is the backward ------------------------

tangent_p = Primitive("jax_dqpost_attention_tangent")
tangent_p.multiple_results = True


@dataclasses.dataclass(frozen=True)
class _Form:
    """:data:`tangent_p`'s parameter: the call, and which operands it has. Operands: ``q, k, v, out, lse``, the
    sink (with one), the four ``seqlens`` (packed), then the tangents of q, k, v and (with a sink) the sink's."""

    spec: AttentionSpec
    has_sink: bool
    packed: bool

    def join(self, q, k, v, out, lse, sink, seqlens, dq, dk, dv, dsink) -> list:
        return [q, k, v, out, lse, *([sink] if self.has_sink else []), *(seqlens if self.packed else ()),
                dq, dk, dv, *([dsink] if self.has_sink else [])]

    def split(self, args):
        """``(q, k, v, out, lse, sink, seqlens, (dq, dk, dv, dsink))``, sink, seqlens and dsink None where absent."""
        args = list(args)
        q, k, v, out, lse = args[:5]
        rest = args[5:]
        sink = rest.pop(0) if self.has_sink else None
        seqlens = tuple(rest[:4]) if self.packed else None
        rest = rest[4:] if self.packed else rest
        return q, k, v, out, lse, sink, seqlens, (*rest[:3], rest[3] if self.has_sink else None)

    @property
    def residuals(self) -> int:
        """How many operands come before the tangents."""
        return 5 + self.has_sink + 4 * self.packed

    def shared(self) -> list[int]:
        """The operands with no batch axis: the sink, the offsets, the sink's tangent."""
        first = 5 + self.has_sink + 4 * self.packed
        return [i for i in range(first + 3 + self.has_sink)
                if (5 <= i < first) or (self.has_sink and i == first + 3)]


def _tangent_abstract(*args, form: _Form):
    out, lse = args[3], args[4]
    return [_jax_internals.result_aval(out.shape, out.dtype, args),
            _jax_internals.result_aval(lse.shape, lse.dtype, args)]


def _tangent_impl(*args, form: _Form):
    """Forward mode: the producer's kernel for q, k, v's tangents, plus the sink's terms (module docstring)."""
    q, k, v, out, lse, sink, seqlens, (dq, dk, dv, dsink) = form.split(args)
    spec = form.spec
    t_out, t_lse = _tangent(spec)(q, k, v, out, lse, dq, dk, dv, seqlens)
    if not form.has_sink:
        return t_out, t_lse
    rows = (slice(None), None) if form.packed else (None, slice(None), None)  # lse (H, T) or (B, H, S)
    p_sink = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(sink.astype(jnp.float32)[rows] - lse))
    p_tau = p_sink * dsink.astype(jnp.float32)[rows]
    p_tau_out = jnp.moveaxis(p_tau, -2, -1)[..., None]  # as out: (T, H, 1) or (B, S, H, 1)
    t_out = (t_out.astype(jnp.float32) - p_tau_out * out.astype(jnp.float32)).astype(t_out.dtype)
    return t_out, t_lse + p_tau


def _tangent_transpose(cts, *args, form: _Form):
    """Reverse mode: the backward (module docstring), the cotangents of the tangents that are undefined."""
    q, k, v, out, lse, sink, seqlens, tangents = form.split(args)
    ct_out, ct_lse = cts
    d_out = jnp.zeros_like(out) if type(ct_out) is ad.Zero else ct_out  # (varying as out is, inside shard_map)
    d_lse = None if type(ct_lse) is ad.Zero else ct_lse
    grads = _backward(form.spec, d_lse is not None, sink is not None)(q, k, v, out, lse, d_out.astype(q.dtype), d_lse,
                                                                       sink, seqlens)
    cotangents = [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, tangents) if t is not None]
    return [None] * form.residuals + cotangents


def _tangent_batch(args, dims, *, form: _Form):
    """Fold the mapped axis into the batch where every shared operand is unmapped and the call is dense; else one
    bind per element."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    shared = set(form.shared())
    if not form.packed and all(dims[i] is None for i in shared):
        folded = []
        for i, (a, d) in enumerate(zip(args, dims)):
            if i in shared:
                folded.append(a)
                continue
            a = jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
            folded.append(a.reshape(size * a.shape[1], *a.shape[2:]))
        outs = tangent_p.bind(*folded, form=form)
        return [o.reshape(size, -1, *o.shape[1:]) for o in outs], [0, 0]
    mapped = [i for i, d in enumerate(dims) if d is not None]

    def one(xs):
        full = list(args)
        for i, x in zip(mapped, xs):
            full[i] = x
        return tuple(tangent_p.bind(*full, form=form))

    outs = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped])
    return list(outs), [0, 0]


_jax_internals.def_impl(tangent_p)
tangent_p.def_abstract_eval(_tangent_abstract)
mlir.register_lowering(tangent_p, mlir.lower_fun(_tangent_impl, multiple_results=True))
_jax_internals.require_devices_during_lowering(tangent_p)  # its kernel's custom_partitioning needs them
ad.primitive_transposes[tangent_p] = _tangent_transpose
batching.primitive_batchers[tangent_p] = _tangent_batch


# ---- the backward: the producer's steps, then one postprocess launch -----------------------------------------

def backward(spec: AttentionSpec, q, k, v, out, lse, d_out, d_lse, sink, seqlens):
    """``(dq, dk, dv, dsink)`` for the cotangents ``d_out`` of out and ``d_lse`` (None: 0) of the lse: the
    producer's accumulators, ``dpsum`` less the lse's cotangent (:func:`lse_cotangent_rows`), then :func:`finish`
    (dsink None without a sink)."""
    delta = None if d_lse is None else lse_cotangent_rows(d_lse, spec.dq_layout, seqlens)
    acc = _accumulators(spec, delta is not None)(q, k, v, out, lse, d_out, delta, seqlens)
    return finish(acc, q, k, v, seqlens, scale=spec.scale, dq_layout=spec.dq_layout, dkv_layout=spec.dkv_layout,
                  sink=sink, lse=lse)


# ---- the backward's last step, and the lse's cotangent -------------------------------------------------------

def finish(acc, q, k, v, seqlens, *, scale, dq_layout, dkv_layout, sink=None, lse=None):
    """One postprocess launch for what the producer's backward left (``acc``): ``(dq, dk, dv, dsink)``, dk and dv
    the main kernel's where it wrote them (``dkv_layout`` None), dsink with a sink (``sink``, the forward's
    ``lse``, ``acc.dpsum``), else None."""
    if seqlens is None:
        q_side, k_side = Side(q.shape[1]), Side(k.shape[1])
    else:
        cu_q, cu_k, used_q, used_k = seqlens
        q_side, k_side = Side(q.shape[0], cu_q, used_q), Side(k.shape[0], cu_k, used_k)
    sink_operands = None if sink is None else (sink, lse, acc.dpsum)
    common = dict(dtype=q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1], dq_layout=dq_layout,
                  q_side=q_side, sink=sink_operands)
    if dkv_layout is None:  # the main kernel wrote dK and dV itself
        dq, _, _, dsink = finish_accumulators(acc.dq_accum, None, None, scale, dkv_layout=None, **common)
        return dq, acc.dk, acc.dv, dsink
    return finish_accumulators(acc.dq_accum, acc.dk_accum, acc.dv_accum, scale, dkv_layout=dkv_layout,
                               k_side=k_side, **common)


def lse_cotangent_rows(d_lse, dq_layout: AccumLayout, seqlens=None):
    """The lse's cotangent in ``dpsum``'s rows, to subtract from ``dpsum`` (module docstring): dense ``(B, H, S)``
    -> ``(B, H, Sr)``, zero in the padding rows; packed ``(H, T)`` -> ``(H, Tp)``, sequence ``b``'s row ``r`` (under
    its used length) at ``(cu[b] + b P) // P * P + r`` (FlashAttention's allocation, ``P = dq_layout.pad_rows``),
    zero elsewhere. Traced offsets are read on the device."""
    d_lse = d_lse.astype(jnp.float32)
    pad = dq_layout.pad_rows
    if seqlens is None:
        s = d_lse.shape[-1]
        return jnp.pad(d_lse, [(0, 0), (0, 0), (0, dq_layout.padded_seqlen(s) - s)])
    cu, _, used, _ = seqlens
    heads, total = d_lse.shape
    batch = cu.shape[0] - 1
    rows_out = padded_total(total, batch, pad)
    t = jnp.arange(total, dtype=jnp.int32)
    # the last sequence starting at or before t (unrolled: no loop in the program, as varlen.WorkList.build)
    b = jnp.clip(jnp.searchsorted(cu, t, side="right", method="scan_unrolled") - 1, 0, batch - 1)
    start, r = cu[b], t - cu[b]
    inside = (t >= start) & (t < cu[b + 1]) & (r < used[b])
    rows = jnp.where(inside, (start + b * pad) // pad * pad + r, rows_out)  # rows_out: dropped
    return jnp.zeros((heads, rows_out), jnp.float32).at[:, rows].set(d_lse, mode="drop")


# ---- the producer's steps: each device runs its share of sharded batches, heads and rows; vmap folds or maps ---

def _forward(spec: AttentionSpec):
    def forward(q, k, v, sink, seqlens):
        step = _Step("forward", spec, sink is not None, seqlens is not None, own_rows=_own_rows_run(spec, q, k, v,
                                                                                                    seqlens))
        return _sharded(step)(q, k, v, sink, seqlens)

    return _folding(forward, per_batch=3)


def _accumulators(spec: AttentionSpec, with_delta: bool):
    def accumulators(q, k, v, out, lse, d_out, delta, seqlens):
        step = _Step("accumulators", spec, with_delta, seqlens is not None)
        return _sharded(step)(q, k, v, out, lse, d_out, delta if with_delta else None, seqlens)

    return _folding(accumulators, per_batch=7)


def _tangent(spec: AttentionSpec):
    def tangent(q, k, v, out, lse, dq, dk, dv, seqlens):
        return _sharded(_Step("tangent", spec, False, seqlens is not None))(q, k, v, out, lse, dq, dk, dv, seqlens)

    return tangent


def _backward(spec: AttentionSpec, with_d_lse: bool, with_sink: bool):
    """:func:`backward` as one step (so that a device given some of the rows runs their whole backward:
    :func:`_own_rows`); under ``jax.vmap``, :func:`backward`'s own steps and their rules."""

    def run(q, k, v, out, lse, d_out, d_lse, sink, seqlens):
        step = _Step("backward", spec, with_d_lse, seqlens is not None, with_sink,
                     own_rows=_own_rows_run(spec, q, k, v, seqlens))
        return _sharded(step)(q, k, v, out, lse, d_out, d_lse, sink, seqlens)

    @jax.custom_batching.custom_vmap
    def f(*args):
        return run(*args)

    @f.def_vmap
    def rule(size, in_batched, *args):
        axes = [None if a is None else tuple(0 if m else None for m in b) if isinstance(a, tuple) else
                (0 if b else None) for a, b in zip(args, in_batched)]
        out = jax.vmap(functools.partial(backward, spec), in_axes=axes)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return f


def _own_rows_run(spec: AttentionSpec, q, k, v, seqlens) -> bool:
    """Whether a device can run its own rows of this call where its sequence is sharded: a dense self-attention (as
    many keys as rows) that the producer's ``context`` runs (asked here for the whole sequence's shapes;
    :func:`_own_rows` asks again for a device's). Else the rows are gathered."""
    context = getattr(spec.kernels, "context", None)
    if seqlens is not None or context is None or q.shape[1] != k.shape[1]:
        return False
    return context(spec, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))) is not None


@dataclasses.dataclass(frozen=True)
class _Step:
    """One of the producer's steps, static: ``kind`` (``"forward"``, ``"accumulators"``, ``"tangent"``, or
    ``"backward"``: the accumulators and the postprocess), the call, whether its optional operand is there (the
    forward's sink, the accumulators' ``dpsum_delta``, the backward's lse cotangent), whether the batch is packed,
    whether the backward has a sink, and (forward and backward) whether a device runs its own rows where the
    sequence is sharded (:func:`_own_rows_run`; else the rows are gathered)."""

    kind: str
    spec: AttentionSpec
    optional: bool
    packed: bool
    sink: bool = False
    own_rows: bool = False

    def run(self, args):
        """The step on ``args`` (its operands, the optional ones and the offsets None where absent)."""
        kernels, config = self.spec.kernels, self.spec.config
        if self.kind == "forward":
            return tuple(kernels.forward(config, *args))
        if self.kind == "accumulators":
            return kernels.accumulators(config, *args)
        if self.kind == "backward":
            return tuple(backward(self.spec, *args))
        return tuple(kernels.tangent(config, *args))

    # Each operand's and result's axes: "b" the batch, "n" the query heads, "k" the key/value heads, "s" the rows
    # (and, in the backward's dK and dV, the keys: as many) where a device may run its own (:attr:`own_rows`), "."
    # an axis that is never sharded (the keys, the head dim, an accumulator's rows). Packed: no batch axis.
    def roles(self, results: list) -> tuple[list[str], list[str]]:
        s = "s" if self.kind in ("forward", "backward") and not self.packed else "."
        q = ". n ." if self.packed else f"b {s} n ."
        kv = ". k ." if self.packed else "b . k ."
        rows = "n ." if self.packed else f"b n {s}"  # the lse, dpsum, an accumulator of the query heads
        kv_rows = "k ." if self.packed else "b k ."
        offsets = ["."] * (4 if self.packed else 0)
        if self.kind == "forward":
            ins = [q, kv, kv] + (["n"] if self.optional else []) + offsets
            outs = [q, rows]
        elif self.kind == "accumulators":
            ins = [q, kv, kv, q, rows, q] + ([rows] if self.optional else []) + offsets
            outs = [{"dq_accum": rows, "dk": kv, "dv": kv, "dk_accum": kv_rows, "dv_accum": kv_rows,
                     "dpsum": rows}[name] for name in results]
        elif self.kind == "backward":
            d_kv = ". k ." if self.packed else f"b {s} k ."
            ins = [q, kv, kv, q, rows, q] + ([rows] if self.optional else []) + (["n"] if self.sink else []) + offsets
            outs = [q, d_kv, d_kv] + (["n"] if self.sink else [])
        else:
            ins = [q, kv, kv, q, rows, q, kv, kv] + offsets
            outs = [q, rows]
        return ins, outs


def _result_names(step: _Step) -> list[str]:
    """The names of the step's array results, in order: out and the lse (their tangents), the gradients, or the
    accumulators: dQ's, dK and dV written by the main kernel or, under grouped-query attention (``dkv_layout``),
    their accumulators, and ``dpsum``."""
    if step.kind == "backward":
        return ["dq", "dk", "dv"] + (["dsink"] if step.sink else [])
    if step.kind != "accumulators":
        return ["out", "lse"]
    if step.spec.dkv_layout is None:
        return ["dq_accum", "dk", "dv", "dpsum"]
    return ["dq_accum", "dk_accum", "dv_accum", "dpsum"]


def _sharded(step: _Step):
    """The step as a ``custom_partitioning``: where XLA partitions it over several devices (``jax.jit`` with
    sharded inputs), each device runs it on its own batch and heads, sharded as the query is (the key/value heads on
    the same mesh axes, so that each query head's key head stays on its device; where they do not divide the
    key/value heads, the heads are gathered), and, where the query's rows are sharded and the step has a
    :attr:`~_Step.own_rows`, on its own rows (:func:`_own_rows`); every other axis gathered. On one device, or inside
    ``jax.shard_map``, the step as it is. Arrays the step closes over are operands of their own, replicated."""

    def sharded(*args):
        leaves = _flatten(args)
        call, constants = _jax_internals.hoisting_constants(lambda *l: step.run(_unflatten(step, l)), *leaves)
        fn = custom_partitioning(call)
        count = len(leaves)
        fn.def_partition(functools.partial(_partition, step, count),
                         infer_sharding_from_operands=functools.partial(_infer, step, count),
                         sharding_rule=functools.partial(_rule, step, count))
        return fn(*leaves, *constants)

    return sharded


def _flatten(args) -> list:
    """The step's operands without the absent ones (None), the offsets spread."""
    out = []
    for a in args:
        if isinstance(a, tuple):
            out.extend(a)
        elif a is not None:
            out.append(a)
    return out


def _unflatten(step: _Step, leaves) -> list:
    """The step's arguments back from :func:`_flatten`'s leaves."""
    leaves = list(leaves)
    seqlens = tuple(leaves[-4:]) if step.packed else None
    body = leaves[:-4] if step.packed else leaves
    if step.kind == "forward":
        q, k, v, *rest = body
        return [q, k, v, rest[0] if step.optional else None, seqlens]
    if step.kind == "accumulators":
        q, k, v, out, lse, d_out, *rest = body
        return [q, k, v, out, lse, d_out, rest[0] if step.optional else None, seqlens]
    if step.kind == "backward":
        q, k, v, out, lse, d_out, *rest = body
        d_lse = rest.pop(0) if step.optional else None
        return [q, k, v, out, lse, d_out, d_lse, rest[0] if step.sink else None, seqlens]
    return [*body, seqlens]


def _axes(spec, index: int):
    """The mesh axes of ``spec``'s entry ``index`` (None: not sharded)."""
    return (tuple(spec) + (None,) * (index + 1 - len(spec)))[index]


def _names(axes) -> tuple:
    return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def _size(mesh, axes) -> int:
    return int(np.prod([mesh.shape[n] for n in _names(axes)]))


def _choice(step: _Step, mesh, arg_shapes):
    """``(batch axes, heads axes, rows axes)``: the query's; its heads' where they divide both head counts, its
    rows' where the step may run them (:attr:`~_Step.own_rows`) and they divide the rows (else None)."""
    q = arg_shapes[0]
    sharding = q.sharding
    spec = tuple(getattr(sharding, "spec", ()) or ()) if sharding is not None else ()
    batch = None if step.packed else _axes(spec, 0)
    heads = _axes(spec, 1 if step.packed else 2)
    kv_heads = arg_shapes[1].shape[-2]
    if heads is not None and (kv_heads % _size(mesh, heads) or q.shape[-2] % _size(mesh, heads)):
        heads = None
    rows = _axes(spec, 1) if step.own_rows else None
    if rows is not None and q.shape[1] % _size(mesh, rows):
        rows = None
    return batch, heads, rows


def _specs(roles: list[str], batch, heads, rows=None) -> list:
    return [P(*[{"b": batch, "n": heads, "k": heads, "s": rows}.get(r) for r in role.split()]) for role in roles]


def _infer(step: _Step, count: int, mesh, arg_shapes, result_shape):
    _, outs = step.roles(_result_names(step))
    shardings = [NamedSharding(mesh, s) for s in _specs(outs, *_choice(step, mesh, arg_shapes))]
    return jax.tree.unflatten(jax.tree.structure(result_shape), shardings)


def _partition(step: _Step, count: int, mesh, arg_shapes, result_shape):
    batch, heads, rows = _choice(step, mesh, arg_shapes)
    ins, outs = step.roles(_result_names(step))
    constants = [" ".join(["."] * len(x.shape)) for x in arg_shapes[count:]]
    arg_shardings = tuple(NamedSharding(mesh, s) for s in _specs(ins + constants, batch, heads, rows))
    out_shardings = jax.tree.unflatten(jax.tree.structure(result_shape),
                                       [NamedSharding(mesh, s) for s in _specs(outs, batch, heads, rows)])

    summed = _names(batch) + _names(rows)
    sum_dsink = step.kind == "backward" and step.sink and bool(summed)

    def lower(*operands):  # the constants, traced again for the shards' shapes, are the step's own
        args = _unflatten(step, operands[:count])
        if sum_dsink:  # each device's share of dsink in float32, summed, then rounded once
            sink_dtype = args[7].dtype
            args[7] = args[7].astype(jnp.float32)
        if rows is None:
            results = step.run(args)
        else:
            results = _own_rows(step, args, jax.lax.axis_index(rows), _size(mesh, rows))
        if rows is not None and step.kind == "backward":  # every key's dK and dV: each device keeps its own keys'
            dq, dk, dv, dsink = results
            dk, dv = (jax.lax.psum_scatter(x.astype(jnp.float32), rows, scatter_dimension=1, tiled=True)
                      .astype(x.dtype) for x in (dk, dv))
            results = (dq, dk, dv, dsink)
        if sum_dsink:
            results = (*results[:3], jax.lax.psum(results[3], summed).astype(sink_dtype))
        return results

    return mesh, lower, out_shardings, arg_shardings


def _own_rows(step: _Step, args, index, devices: int):
    """The forward's ``(out, lse)`` or the backward's ``(dq, dk, dv, dsink)`` of device ``index``'s rows (an int or
    a traced ``axis_index``) of ``devices``: the ``c`` rows ``[index c, (index + 1) c)`` of each sequence, every key
    given. Without a mask the call as it is; else each sequence's rows one sequence of a packed batch reading its
    keys up to its own last row, so that the producer's bottom-right mask is the whole sequence's
    (:func:`context.flash_chunks`). The backward's dK and dV are this device's share of every key's ``(B, S, K,
    D|Dv)``, and dsink its rows' share."""
    q, k, v = args[:3]
    b, c, s = q.shape[0], q.shape[1], k.shape[1]
    own = step.spec.kernels.context(step.spec, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)))
    if own is None:  # the producer took the whole sequence's shapes (_own_rows_run) and not its rows'
        raise RuntimeError(f"the producer runs the whole sequence {k.shape} and not a device's rows {q.shape}")
    spec, packed = own
    if not packed:
        return dataclasses.replace(step, spec=spec).run(args)
    used_k = jnp.tile(context.flash_chunks("contiguous", c, devices, index), b)
    seqlens = (jnp.arange(b + 1, dtype=jnp.int32) * c, jnp.arange(b + 1, dtype=jnp.int32) * s,
               jnp.full((b,), c, jnp.int32), used_k)

    def rows(x):  # (B, c|S, ...) -> (B c|S, ...)
        return x.reshape(b * x.shape[1], *x.shape[2:])

    def lse_rows(x):  # (B, N, c) -> (N, B c)
        return None if x is None else x.transpose(1, 0, 2).reshape(x.shape[1], b * c)

    if step.kind == "forward":
        q, k, v, sink, _ = args
        out, lse = spec.kernels.forward(spec.config, rows(q), rows(k), rows(v), sink, seqlens)
        return out.reshape(b, c, *out.shape[1:]), lse.reshape(-1, b, c).transpose(1, 0, 2)
    q, k, v, out, lse, d_out, d_lse, sink, _ = args
    dq, dk, dv, dsink = backward(spec, rows(q), rows(k), rows(v), rows(out), lse_rows(lse), rows(d_out),
                                 lse_rows(d_lse), sink, seqlens)
    return (*(x.reshape(b, -1, *x.shape[1:]) for x in (dq, dk, dv)), dsink)


def _rule(step: _Step, count: int, mesh, operand_types, result_types):
    """Shardy's rule: the batch ``b``, the key/value heads ``k`` with the query heads ``(k g)``, and, where the
    step may run a device's own rows, the rows ``s``, may shard; every other axis is a factor of its own that needs
    replication."""
    heads = operand_types[0].shape[-2]
    kv_heads = operand_types[1].shape[-2]
    names = iter(f"x{i}" for i in range(10_000))
    replicated = []

    groups = heads // kv_heads
    # the query heads: the key/value heads' factor, each with its group (Shardy takes no compound factor of size
    # 1); one key/value head does not shard
    query_heads = "k" if groups == 1 else "n" if kv_heads == 1 else "(k g)"
    if kv_heads == 1:
        replicated.extend(["k", "n"])

    def factors(role: str) -> str:
        out = []
        for r in role.split():
            if r == "." or (r == "s" and not step.own_rows):
                out.append(next(names))
                replicated.append(out[-1])
            else:
                out.append({"b": "b", "k": "k", "n": query_heads, "s": "s"}[r])
        return " ".join(out)

    ins, outs = step.roles(_result_names(step))
    ins = ins + [" ".join(["."] * len(t.shape)) for t in operand_types[count:]]
    rule = ", ".join(map(factors, ins)) + " -> " + ", ".join(map(factors, outs))
    sizes = dict(g=groups) if query_heads == "(k g)" else {}
    order = dict.fromkeys(re.findall(r"\w+", rule))  # Shardy numbers the factors as they first appear
    return rule, dict(need_replication_factors=tuple(f for f in order if f in set(replicated)), **sizes)


def _folding(fn, per_batch: int):
    """``fn`` with a vmap rule: its first ``per_batch`` arguments and all its results lead with the batch axis; a
    mapped axis folds into it when the rest (the sink, the offsets) is not mapped and there are no offsets (dense),
    else ``fn`` runs once per element."""

    @jax.custom_batching.custom_vmap
    def f(*args):
        return fn(*args)

    @f.def_vmap
    def rule(size, in_batched, *args):
        shared_mapped = any(jax.tree.leaves(in_batched[per_batch:]))
        if args[-1] is None and not shared_mapped:
            folded = [(x if m else jnp.broadcast_to(x, (size, *x.shape))).reshape(-1, *x.shape[1 + m:])
                      if x is not None else None for x, m in zip(args[:per_batch], in_batched[:per_batch])]
            out = f(*folded, *args[per_batch:])
            return jax.tree.map(lambda o: o.reshape(size, -1, *o.shape[1:]), out), jax.tree.map(lambda _: True, out)
        leaves, tree = jax.tree.flatten(args)
        mapped = [m for m in jax.tree.leaves(in_batched)]
        xs = [x for x, m in zip(leaves, mapped) if m]

        def one(xs):
            it = iter(xs)
            return f(*jax.tree.unflatten(tree, [next(it) if m else x for x, m in zip(leaves, mapped)]))

        out = jax.lax.map(one, xs)
        return out, jax.tree.map(lambda _: True, out)

    return f
