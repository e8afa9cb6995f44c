"""The ``'xla'`` attention of :mod:`jax_dqpost._attention.xla` (jax.nn's convention, with sinks) in memory that grows
with ``T * block``, not ``T * S``: the keys in blocks of ``block`` columns, in a ``lax.scan``.

The same formula and conventions as :func:`jax_dqpost._attention.xla.dot_product_attention`, to the rounding of a
sum's order: a masked logit is the large negative number ``-0.7 * finfo.max`` (float32's at most), so a row that sees
no key averages all values without a sink and is ~0 with one; causal masks and windows align top-left; rows past a
query length are zeroed; complex logits' imaginary part is dropped. The products at
:func:`~jax_dqpost._attention.xla._scores`' precision (``precision`` for float32 and wider operands), the logits
and the softmax float32 (float64 for float64 and complex128 inputs, where 'xla' rounds them to float32), the
probabilities rounded to the values' dtype before they multiply the values.

Forward: an online softmax over the key blocks, a running max ``m``, sum ``l`` and accumulator ``acc`` of each row,
``m`` and ``l`` starting at the row's sink (``m = sink``, ``l = 1``; without one ``-inf`` and 0); the unnormalised
``exp(logit - m)`` is what is rounded to the values' dtype. The last block, where ``block`` does not divide ``S``,
ends at key ``S``: it overlaps the one before, and its columns already counted are left out (a logit of ``-inf``).
A sink of ``+inf`` gives its limit: the row's output 0, its lse ``+inf``, gradients 0.

Backward (a ``jax.custom_vjp``): each block's probabilities recomputed, ``P = exp(logit - m - log l)`` from the
saved ``m`` and ``log l`` (apart: in a row that sees no key, ``m`` is the masked logit, which absorbs ``log S`` in
their sum), with ``D = rowsum(dO * O)``: ``dS = P (dO V^T - D)`` (0 where masked), ``dQ = scale dS K`` carried
through the scan, each block's ``dK = scale dS^T Q`` and ``dV = P^T dO`` added at its keys, a sink's
``-sum_i P_i,sink D_i``, the bias's ``dS`` summed to its broadcast shape and a traced scale's ``sum(dS * q k^T)``.
It saves the inputs, out, ``m`` and ``log l``: nothing of size ``T * S``.

Memory, beyond the inputs and outputs: a few ``(B, N, T, block)`` arrays of one block and the ``(B, T, N, H)``
accumulators, float32 (a bias's gradient too, of the bias's size). The masks are made per block from the positions,
never at ``(T, S)``, a mask or bias array read a block at a time; grouped-query attention reads each key/value head
once, without copies.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._jax_internals import vary_alike, vary_as, varying_axes
from . import xla
from .xla import HIGHEST, _grouped, _scores

LOGITS_BUDGET = 64 * 2 ** 20
"""Bytes of one block's float32 logits ``(B, N, T, block)`` that :func:`default_block_size` stays under."""


def default_block_size(batch: int, heads: int, queries: int, keys: int) -> int:
    """The keys of a block: the largest power of two from 16 to 512 whose float32 logits
    ``batch * heads * queries * block * 4`` bytes stay within :data:`LOGITS_BUDGET` (16 if none does), at most
    ``keys`` rounded up to a power of two (and to 16)."""
    block = 512
    while block > 16 and batch * heads * queries * block * 4 > LOGITS_BUDGET:
        block //= 2
    return min(block, max(16, 1 << max(keys - 1, 0).bit_length()))


@dataclasses.dataclass(frozen=True)
class _Static:
    """What a call fixes when tracing: ``block`` keys in each of ``blocks`` blocks over ``keys`` keys (the last
    block ends at key ``keys``), the causal mask, the window ``(left, right)`` or None, the scale if a Python
    float (None: an array argument), and the products' precision."""

    block: int
    blocks: int
    keys: int
    is_causal: bool
    window: tuple[int, int] | None
    scale: float | None
    precision: object = None


def _dtypes(query) -> tuple:
    """``(products, softmax)``: the dtype of the products ``q k^T`` and of the accumulator, float32, float64 or
    complex, and the real dtype of the logits and the softmax."""
    products = jnp.promote_types(query.dtype, np.float32)
    return products, np.dtype(jnp.finfo(products).dtype)


def dot_product_attention(query, key, value, bias, mask, *, scale, is_causal: bool, q_lengths, kv_lengths, window,
                          sinks, return_residual: bool, precision=None, block_size: int | None = None,
                          q_positions=None, k_positions=None):
    """:func:`jax_dqpost._attention.xla.dot_product_attention` in blocks of ``block_size`` keys (module
    docstring; None: :func:`default_block_size`), arguments as checked by the caller: ``query`` ``(B, T, N, H)``,
    ``key`` and ``value`` ``(B, S, K, H)`` of query's dtype, ``K`` dividing ``N`` (query head ``n`` reads key head
    ``n // (N // K)``); ``bias`` (floating) and ``mask`` (boolean, True: seen) 4-D, broadcastable to
    ``(B, N, T, S)`` (heads 1 or N), or None; ``scale`` a Python float or a floating scalar array; ``q_lengths``,
    ``kv_lengths`` integer ``(B,)`` or None; ``window`` ``(left, right)`` or None; ``sinks`` float32 ``(N,)`` or None;
    ``precision`` None (jax's default) or a ``lax.Precision`` for the products of float32 and wider operands;
    ``q_positions`` ``(T,)`` and ``k_positions`` ``(S,)``, integer or None (``0 .. T-1``, ``0 .. S-1``): the
    positions the masks and lengths count, as :func:`jax_dqpost._attention.xla.jax_nn_visible`'s. ``out``
    ``(B, T, N, H)`` of the values' dtype, and with ``return_residual`` the lse ``(B, T, N)`` in the keys' dtype, as
    a constant of differentiation."""
    b, t, n, _ = query.shape
    s = key.shape[1]
    if s == 0:  # no logits, no memory to save: 'xla''s
        return xla.dot_product_attention(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                                          q_lengths=q_lengths, kv_lengths=kv_lengths, window=window, sinks=sinks,
                                          return_residual=return_residual, precision=precision,
                                          q_positions=q_positions, k_positions=k_positions)
    block = default_block_size(b, n, t, s) if block_size is None else int(block_size)
    block = max(1, min(block, s))  # a block of S keys where it would hold more
    static_scale = float(scale) if isinstance(scale, numbers.Real) else None
    cfg = _Static(block, -(-s // block), s, bool(is_causal),
                  None if window is None else (int(window[0]), int(window[1])), static_scale, precision)
    scale_arg = None if static_scale is not None else jnp.asarray(scale).astype(_dtypes(query)[1])
    sinks_arg = None if sinks is None else sinks.astype(np.float32)
    positions = None
    if q_positions is not None or k_positions is not None:
        positions = tuple(jnp.arange(length, dtype=jnp.int32) if x is None else jnp.asarray(x, jnp.int32)
                          for x, length in ((q_positions, t), (k_positions, s)))
    # inside jax.shard_map, every operand varies over the same axes, so that each cotangent has its primal's type (a
    # replicated sink's is then summed over the axes by jax's AD of the cast)
    *operands, q_pos, k_pos = vary_alike(query, key, value, bias, mask, q_lengths, kv_lengths, sinks_arg, scale_arg,
                                         *(positions or (None, None)))
    out, lse = _attention(cfg, *operands, None if positions is None else (q_pos, k_pos))
    if q_lengths is not None:
        rows = (jnp.arange(t) if positions is None else positions[0])[None, :] < q_lengths[:, None]
        out *= rows[:, :, None, None].astype(out.dtype)
    if return_residual:
        lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, n)
        return out, lax.stop_gradient(lse.astype(key.dtype))
    return out


# ---- the blocks ---------------------------------------------------------------------------------------------------

def _dot(spec: str, a, b, inputs, dtype, precision=None):
    """``einsum(spec, a, b)`` in ``dtype`` with the products :func:`~jax_dqpost._attention.xla._scores` makes of
    operands of dtype ``inputs`` (an operand of another dtype is rounded to ``inputs`` first, as the preset would
    round it): exact float32 products of the bf16 or fp16 values (``BF16_BF16_F32`` on GPUs); ``precision`` for
    float32 and wider ones."""
    def exact(a, b):  # bf16 and fp16 products are exact in float32: the presets' products
        return jnp.einsum(spec, a.astype(inputs).astype(dtype), b.astype(inputs).astype(dtype), precision=HIGHEST,
                          preferred_element_type=dtype)

    if inputs == jnp.bfloat16:  # the preset where the platform compiles it for these dots (jax 0.10's CPU does not)
        def preset(a, b):
            return jnp.einsum(spec, a.astype(inputs), b.astype(inputs), precision=lax.DotAlgorithmPreset.BF16_BF16_F32,
                              preferred_element_type=dtype)

        return lax.platform_dependent(a, b, cpu=exact, default=preset)
    if inputs == jnp.float16:  # XLA's GPU compiler refuses F16_F16_F32 for some of these dots
        return exact(a, b)
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=dtype)


def _columns(x, start, cfg: _Static):
    """Block ``start .. start + block`` of a grouped bias or mask's last axis (all of it if 1)."""
    return x if x is None or x.shape[-1] == 1 else lax.dynamic_slice_in_dim(x, start, cfg.block, axis=-1)


def _add_columns(acc, start, x, axis: int):
    """``acc`` with ``x`` added at ``start ..`` of ``axis``."""
    here = lax.dynamic_slice_in_dim(acc, start, x.shape[axis], axis=axis)
    return lax.dynamic_update_slice_in_dim(acc, here + x, start, axis=axis)


def _blocks(cfg: _Static, query, key, value, bias, mask, q_lengths, kv_lengths, scale, positions=None):
    """``(qg, at)``: the query grouped ``(B, T, K, G, H)``, and ``at(i)``: key block ``i``'s ``(start, keys, values,
    raw, logits, seen)``: its first key, its ``(B, block, K, H)`` keys and values, the ``(B, K, G, T, block)``
    products ``q k^T`` and real logits (scaled, biased, masked; columns of the block before: ``-inf``) and where a
    logit is seen (broadcastable to the logits; None: everywhere). ``positions``: int32 ``(T,)`` and ``(S,)``, the
    rows' and keys' positions that the masks and lengths count, or None (``0 .. T-1``, ``0 .. S-1``)."""
    b, t, n, h = query.shape
    heads_kv = key.shape[2]
    qg = query.reshape(b, t, heads_kv, n // heads_kv, h)
    bias_g, mask_g = _grouped(bias, heads_kv), _grouped(mask, heads_kv)
    dtype, real = _dtypes(query)
    factor = jnp.asarray(cfg.scale if cfg.scale is not None else scale, real)
    masked = jnp.asarray(-0.7 * min(float(jnp.finfo(real).max), float(jnp.finfo(np.float32).max)), real)
    rows = (jnp.arange(t, dtype=jnp.int32) if positions is None else positions[0])[:, None]

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    def at(i):
        start = jnp.minimum(i * cfg.block, cfg.keys - cfg.block).astype(jnp.int32)
        keys = lax.dynamic_slice_in_dim(key, start, cfg.block, axis=1)
        values = lax.dynamic_slice_in_dim(value, start, cfg.block, axis=1)
        raw = _scores(qg, keys, cfg.precision)
        logits = raw * factor
        if bias_g is not None:
            logits = (logits + _columns(bias_g, start, cfg)).astype(dtype)
        logits = jnp.real(logits)
        local = start + jnp.arange(cfg.block, dtype=jnp.int32)[None, :]
        cols = local if positions is None else lax.dynamic_slice_in_dim(positions[1], start, cfg.block)[None, :]
        seen = _columns(mask_g, start, cfg)
        if cfg.is_causal:
            seen = both(seen, cols <= rows)
        if cfg.window is not None:
            left, right = cfg.window
            seen = both(seen, (rows <= cols + left) & (rows >= cols - right))
        if q_lengths is not None:
            seen = both(seen, rows < q_lengths[:, None, None, None, None])
        if kv_lengths is not None:
            seen = both(seen, cols < kv_lengths[:, None, None, None, None])
        if seen is not None:
            logits = jnp.where(seen, logits, masked)
        logits = jnp.where(local >= i * cfg.block, logits, -jnp.inf)
        return start, keys, values, raw, logits, seen

    return qg, at


def _varying(carry, *inputs):
    """A scan's initial ``carry`` (a pytree) made varying over the manual axes of ``jax.shard_map`` over which any
    of ``inputs`` varies, as the carry of a step computed from them does (the scan wants the two of one type);
    unchanged outside ``shard_map``."""
    axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(inputs)))
    return jax.tree.map(lambda c: vary_as(c, axes), carry)


def _sink_rows(sinks, heads_kv: int, dtype):
    """``(sink, infinite)``: the sinks as ``(1, K, G, 1)`` of ``dtype`` with ``+inf`` replaced by 0, and where a sink
    is ``+inf``."""
    column = sinks.astype(dtype).reshape(1, heads_kv, -1, 1)
    infinite = column == jnp.inf
    return jnp.where(infinite, 0, column), infinite


# ---- the custom_vjp -----------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, query, key, value, bias, mask, q_lengths, kv_lengths, sinks, scale, positions=None):
    """``(out, lse)``: out ``(B, T, N, Hv)`` in the values' dtype, before the query lengths' zeroing; the natural-log
    lse ``(B, K, G, T)`` of the softmax's dtype, the sink's term in it."""
    out, m, log_l = _forward(cfg, query, key, value, bias, mask, q_lengths, kv_lengths, sinks, scale, positions)
    return out, m + log_l


def _forward(cfg, query, key, value, bias, mask, q_lengths, kv_lengths, sinks, scale, positions=None):
    """``(out, m, log l)``: out as :func:`_attention`'s, each row's max logit ``m`` and ``log l``, ``l`` its sum of
    ``exp(logit - m)``, ``(B, K, G, T)`` (``m = +inf`` where the sink is)."""
    b, t, n, _ = query.shape
    heads_kv, hv = key.shape[2], value.shape[-1]
    dtype, real = _dtypes(query)
    _, at = _blocks(cfg, query, key, value, bias, mask, q_lengths, kv_lengths, scale, positions)
    rows = (b, heads_kv, n // heads_kv, t)
    if sinks is None:
        m, l, infinite = jnp.full(rows, -jnp.inf, real), jnp.zeros(rows, real), None
    else:
        sink, infinite = _sink_rows(sinks, heads_kv, real)
        m, l = jnp.broadcast_to(sink, rows), jnp.ones(rows, real)

    def step(carry, i):
        m, l, acc = carry
        _, _, values, _, logits, _ = at(i)
        top = jnp.maximum(m, jnp.max(logits, axis=-1))
        alpha = jnp.exp(m - top)
        p = jnp.exp(logits - top[..., None])
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + _dot("bkgts,bskh->bkgth", p.astype(value.dtype), values, value.dtype, dtype,
                                            cfg.precision)
        return (top, l, acc), None

    carry = _varying((m, l, jnp.zeros((*rows, hv), dtype)), query, key, value, bias, mask, q_lengths, kv_lengths,
                     sinks, scale, positions)
    (m, l, acc), _ = lax.scan(step, carry, jnp.arange(cfg.blocks, dtype=jnp.int32))
    out = acc / l[..., None]
    if infinite is not None:
        out = jnp.where(infinite[..., None], 0, out)
        m = jnp.where(infinite, jnp.inf, m)
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, hv).astype(value.dtype)
    return out, m, jnp.log(l)


def _attention_fwd(cfg, query, key, value, bias, mask, q_lengths, kv_lengths, sinks, scale, positions=None):
    out, m, log_l = _forward(cfg, query, key, value, bias, mask, q_lengths, kv_lengths, sinks, scale, positions)
    return (out, m + log_l), (query, key, value, bias, mask, q_lengths, kv_lengths, sinks, scale, positions, out, m,
                              log_l)


def _attention_bwd(cfg, residuals, cotangents):
    query, key, value, bias, mask, q_lengths, kv_lengths, sinks, scale, positions, out, m, log_l = residuals
    d_out, d_lse = cotangents
    b, t, n, h = query.shape
    s, heads_kv, hv = key.shape[1], key.shape[2], value.shape[-1]
    g = n // heads_kv
    dtype, real = _dtypes(query)
    qg, at = _blocks(cfg, query, key, value, bias, mask, q_lengths, kv_lengths, scale, positions)
    factor = jnp.asarray(cfg.scale if cfg.scale is not None else scale, real)
    # the rows of a key head as (G, T), as the logits': no transpose of a (T, block) matrix in the scan
    q_rows = jnp.transpose(qg, (0, 2, 3, 1, 4))
    d_out_rows = jnp.transpose(d_out.reshape(b, t, heads_kv, g, hv), (0, 2, 3, 1, 4))
    # D_i - g_i: an lse cotangent g_i adds g_i P_ij to dS_ij and g_i P_i,sink to the sink's. Complex: jax's
    # cotangents, transposes without conjugates; a real probability's is the real part.
    delta = jnp.real(jnp.sum(d_out.astype(dtype) * out.astype(dtype), axis=-1)).reshape(b, t, heads_kv, g)
    delta = jnp.transpose(delta, (0, 2, 3, 1)) - d_lse.astype(real)
    bias_shape = None if bias is None else _grouped(bias, heads_kv).shape

    def step(carry, i):
        dq, dk, dv, d_bias, d_scale = carry
        start, keys, values, raw, logits, seen = at(i)
        p = jnp.exp(logits - m[..., None] - log_l[..., None])
        dp = jnp.real(_dot("bkgth,bskh->bkgts", d_out_rows, values, value.dtype, dtype, cfg.precision))
        ds = p * (dp - delta[..., None])
        if seen is not None:
            ds = jnp.where(seen, ds, 0)
        scaled = ds * factor
        dq = dq + _dot("bkgts,bskh->bkgth", scaled, keys, query.dtype, dtype, cfg.precision)
        dk = _add_columns(dk, start, _dot("bkgts,bkgth->bskh", scaled, q_rows, query.dtype, dtype, cfg.precision),
                          axis=1)
        dv = _add_columns(dv, start, _dot("bkgts,bkgth->bskh", p.astype(value.dtype), d_out_rows, value.dtype, dtype,
                                          cfg.precision), axis=1)
        if d_bias is not None:
            axes = tuple(a for a in range(4) if bias_shape[a] == 1 and ds.shape[a] != 1)
            part = jnp.sum(ds, axis=axes, keepdims=True)
            if bias_shape[4] == 1:
                d_bias = d_bias + jnp.sum(part, axis=4, keepdims=True)
            else:
                d_bias = _add_columns(d_bias, start, part, axis=4)
        if d_scale is not None:
            d_scale = d_scale + jnp.sum(ds * jnp.real(raw))
        return (dq, dk, dv, d_bias, d_scale), None

    carry = (jnp.zeros((b, heads_kv, g, t, h), dtype), jnp.zeros((b, s, heads_kv, h), dtype),
             jnp.zeros((b, s, heads_kv, hv), dtype), None if bias is None else jnp.zeros(bias_shape, real),
             None if scale is None else jnp.zeros((), real))
    carry = _varying(carry, residuals, cotangents)
    (dq, dk, dv, d_bias, d_scale), _ = lax.scan(step, carry, jnp.arange(cfg.blocks, dtype=jnp.int32))
    d_sinks = None
    if sinks is not None:
        sink, infinite = _sink_rows(sinks, heads_kv, real)
        p_sink = jnp.where(infinite, 1, jnp.exp(sink - m - log_l))
        d_sinks = (-jnp.sum(p_sink * delta, axis=(0, 3))).reshape(n).astype(sinks.dtype)
    dq = jnp.transpose(dq, (0, 3, 1, 2, 4)).reshape(b, t, n, h)
    return (dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype),
            None if bias is None else d_bias.reshape(bias.shape).astype(bias.dtype), None, None, None, d_sinks,
            None if scale is None else d_scale.astype(scale.dtype), None)


_attention.defvjp(_attention_fwd, _attention_bwd)
