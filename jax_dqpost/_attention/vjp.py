"""Attention whose backward ends in one jax-dqpost launch, for what a producer's own differentiation cannot carry:
a learnable sink, and the lse's cotangent.

A producer (:class:`Kernels`: fa4-jax's in :mod:`jax_dqpost.fa4jax`, a stand-in in the tests) brings two steps: its
forward, ``(out, lse)`` with the sink in every softmax row, and its backward up to the accumulators (the
preprocess's ``dpsum = rowsum(out * d_out)``, then the main kernel, which reads the forward's lse and ``dpsum``).
:func:`attention` is the ``jax.custom_vjp`` around them whose backward ends in one
:func:`~jax_dqpost.flash_attention_postprocess` launch: dQ (dK and dV under grouped-query attention) and dsink.

Why the backward kernels need no sink: the sink ``t_h`` is one more logit of row ``i`` with no value vector, so
``P_ij = exp(scale * s_ij - lse_i)`` with the sink-including ``lse_i`` is the whole of what it changes; ``dS_ij =
P_ij (dP_ij - D_i)`` with ``D_i = rowsum(dO * O)_i`` (the sink's ``dP`` is 0), and ``d t_h = sum_i -P_it D_i``,
``P_it = exp(t_h - lse_i)``: the postprocess's dsink. A cotangent ``g`` of the lse adds ``g_i P_ij`` to ``dS_ij``
and ``g_i P_it`` to ``d t_h``: ``D_i - g_i`` in place of ``D_i`` in both (:func:`lse_cotangent_rows`).

vmap: a dense call with a shared sink folds the mapped axis into the producer's batch (one launch of each kernel;
per-example dsink from the postprocess's own vmap rule); a mapped sink, or a packed batch, runs the producer once
per element (``lax.map``). Forward-mode autodiff is refused (a ``TypeError`` naming the sink).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Hashable, Protocol

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from .. import _jax_internals
from ..api import flash_attention_postprocess
from ..layout import AccumLayout
from .._kernel.varlen import padded_total


class Kernels(Protocol):
    """A producer's two steps (hashable: :class:`AttentionSpec` is a static argument). ``config`` is
    :attr:`AttentionSpec.config`; ``seqlens`` is None (dense) or fa4-jax's ``(cu_seqlens_q, cu_seqlens_k, seqused_q,
    seqused_k)``."""

    def forward(self, config, q, k, v, sink, seqlens):
        """``(out, lse)``: out ``(B, S, H, Dv)`` or ``(T, H, Dv)`` of q's dtype, the float32 natural-log lse
        ``(B, H, S)`` or ``(H, T)`` with the sink in every row."""

    def accumulators(self, config, q, k, v, out, lse, d_out, dpsum_delta, seqlens):
        """The backward up to the postprocess, ``dpsum - dpsum_delta`` read in place of ``dpsum`` (None: 0): an
        ``Accumulators`` (``dq_accum, dk, dv, dk_accum, dv_accum, dpsum``; dk, dv without grouped-query attention,
        dk_accum, dv_accum with it, the others None)."""


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


FORWARD_MODE = ("forward-mode autodiff (jax.jvp, jax.jacfwd) of attention with learnable_sink is not supported: its "
                "backward is reverse mode only (jax.grad, jax.vjp, jax.jacrev)")


def attention(spec: AttentionSpec, q, k, v, sink, seqlens=None):
    """``(out, lse)`` of the attention ``spec`` describes with the learnable sink ``sink`` (H,), differentiable in
    q, k, v and the sink, and through both outputs (module docstring). Inside ``jax.shard_map`` (its default
    check) every operand is cast to the union of their varying manual axes first, so that the backward's gradients
    (which vary as they do) have its primals' types; a replicated sink (or offsets) used with batch-sharded q, k, v
    then gets its gradient summed over the batch's axes by jax's AD."""
    q, k, v, sink, *flat = _jax_internals.vary_alike(q, k, v, sink, *(seqlens or ()))
    seqlens = None if seqlens is None else type(seqlens)(flat)
    try:
        return _attention(spec, q, k, v, sink, seqlens)
    except TypeError as e:
        if "forward-mode autodiff" in str(e) and "custom_vjp" in str(e):
            raise TypeError(FORWARD_MODE) from None
        raise


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec, q, k, v, sink, seqlens):
    return _forward(spec)(q, k, v, sink, seqlens)


def _attention_fwd(spec, *primals):
    q, k, v, sink, seqlens = jax.tree.map(lambda p: p.value, primals, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))
    out, lse = _forward(spec)(q, k, v, sink, seqlens)
    return (out, lse), (q, k, v, sink, seqlens, out, lse)


def _attention_bwd(spec, res, cts):
    q, k, v, sink, seqlens, out, lse = res
    d_out, d_lse = cts
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros_like(out)  # (varying as out is, inside shard_map)
    delta = None if isinstance(d_lse, SymbolicZero) else lse_cotangent_rows(d_lse, spec.dq_layout, seqlens)
    acc = _accumulators(spec, delta is not None)(q, k, v, out, lse, d_out.astype(q.dtype), delta, seqlens)
    grads = finish(acc, q, k, v, seqlens, scale=spec.scale, dq_layout=spec.dq_layout, dkv_layout=spec.dkv_layout,
                   sink=sink, lse=lse)
    return grads.dq, grads.dk, grads.dv, grads.dsink, None


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def finish(acc, q, k, v, seqlens, *, scale, dq_layout, dkv_layout, sink=None, lse=None):
    """One :func:`~jax_dqpost.flash_attention_postprocess` launch for what the producer's backward left (``acc``):
    its :class:`~jax_dqpost.Gradients`, dk and dv the main kernel's where it wrote them (``dkv_layout`` None), dsink
    with a sink (``sink``, the forward's ``lse``, ``acc.dpsum``)."""
    if seqlens is None:
        q_side, k_side = dict(seqlen_q=q.shape[1]), dict(seqlen_k=k.shape[1])
    else:
        cu_q, cu_k, used_q, used_k = seqlens
        q_side = dict(total_q=q.shape[0], cu_seqlens_q=cu_q, seqused_q=used_q)
        k_side = dict(total_k=k.shape[0], cu_seqlens_k=cu_k, seqused_k=used_k)
    common = dict(head_dim=q.shape[-1], dtype=q.dtype, dq_layout=dq_layout, **q_side)
    if sink is not None:
        common.update(learnable_sink=sink, lse=lse, dpsum=acc.dpsum)
    if dkv_layout is None:  # the main kernel wrote dK and dV itself
        grads = flash_attention_postprocess(acc.dq_accum, None, None, scale, **common)
        return grads._replace(dk=acc.dk, dv=acc.dv)
    return flash_attention_postprocess(acc.dq_accum, acc.dk_accum, acc.dv_accum, scale, **common, **k_side,
                                       head_dim_v=v.shape[-1], dkv_layout=dkv_layout)


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


# ---- vmap: the producer's kernels run on a batch; fold a mapped axis into it, or map -----------------------------

def _forward(spec: AttentionSpec):
    return _folding(lambda q, k, v, sink, seqlens: spec.kernels.forward(spec.config, q, k, v, sink, seqlens),
                    per_batch=3)


def _accumulators(spec: AttentionSpec, with_delta: bool):
    def accumulators(q, k, v, out, lse, d_out, delta, seqlens):
        return spec.kernels.accumulators(spec.config, q, k, v, out, lse, d_out, delta if with_delta else None,
                                         seqlens)

    return _folding(accumulators, per_batch=7)


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
