"""Attention in jax.numpy, on every platform: the ``'xla'`` implementation of
:func:`jax_dqpost.dot_product_attention` and what :mod:`jax_dqpost.fa4jax` runs where there is no GPU.

One formula, ``out = softmax(scale * q k^T + bias, masked; sink) v``, with a learnable sink as one more logit per
query head in every row (no value vector), and two conventions that differ where a logit is masked:

- **jax.nn's** (:func:`dot_product_attention`): a masked logit is a large negative number, so a row that sees no
  key averages all values, as ``jax.nn.dot_product_attention(implementation='xla')`` does; causal masks and windows
  align top-left; rows past a query length are zeroed. The same operations in the same order as jax.nn's, so that
  without a sink the two agree to the rounding of a sum's order.
- **FlashAttention's** (:func:`flash_attention`): a masked logit is ``-inf``; a row that sees no key gives 0 and
  its lse is the sink (``-inf`` without one); causal masks and windows align bottom-right (a query's position is
  offset by the key length minus the query length, of each sequence in a packed batch).

The logits are float32 (float64 for float64 inputs): bf16 operands multiply in ``BF16_BF16_F32`` (jax.nn's
precision; on CPU a matrix times a vector upcast to float32 at the highest precision, the same exact products, as
jax 0.10's CPU cannot emit the preset there); fp16 ones upcast likewise on every platform (XLA's CPU has no
``F16_F16_F32``, and its GPU compiler refuses it for some dots); float32 ones at jax's default matmul precision, as
jax.nn's (TF32 on NVIDIA GPUs since Ampere, unless ``jax.default_matmul_precision`` says otherwise). The softmax is
float32; the probabilities are rounded to the values' dtype before they multiply the values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HIGHEST = lax.Precision.HIGHEST


def _batched_dot(a, b, contract: int, *, precision=None, preferred_element_type=None):
    """``a`` ``(B, K, M, X)`` times ``b`` ``(B, K, Y, Z)`` over ``a``'s last axis and ``b``'s axis ``contract``
    (2 or 3), batched over ``(B, K)``: ``(B, K, M, free b)``. Operands and result in these layouts, the rows of the
    ``T * S`` matrix contiguous, XLA's CPU dot runs without a transpose of that matrix (an einsum of the same sum,
    left to pick its layouts, runs 1.5-4x slower on CPU)."""
    return lax.dot_general(a, b, (((3,), (contract,)), ((0, 1), (0, 1))), precision=precision,
                           preferred_element_type=preferred_element_type)


def _scores(query, key, precision=None):
    """``(B, K, G, T, S)`` logits of grouped ``query`` ``(B, T, K, G, H)`` and ``key`` ``(B, S, K, H)``, in
    ``promote(query.dtype, float32)``; ``precision`` (None: jax's default) for the products of float32 and wider
    operands (those of bf16 and fp16 are exact in float32 already)."""
    b, t, heads_kv, g, h = query.shape
    dtype = jnp.promote_types(query.dtype, np.float32)
    q = jnp.transpose(query, (0, 2, 3, 1, 4)).reshape(b, heads_kv, g * t, h)
    k = jnp.transpose(key, (0, 2, 1, 3))

    def product(q, k, precision):
        return _batched_dot(q, k, 3, precision=precision, preferred_element_type=dtype).reshape(
            b, heads_kv, g, t, key.shape[1])

    def upcast(q, k):  # bf16 and fp16 products are exact in float32: the presets' products
        return product(q.astype(dtype), k.astype(dtype), HIGHEST)

    if query.dtype == jnp.bfloat16:
        def preset(q, k):
            return product(q, k, lax.DotAlgorithmPreset.BF16_BF16_F32)

        if 1 in (g * t, key.shape[1]):  # a matrix times a vector: jax 0.10's CPU cannot emit the preset for it
            return lax.platform_dependent(q, k, cpu=upcast, default=preset)
        return preset(q, k)
    if query.dtype == jnp.float16:  # XLA's CPU has no F16_F16_F32, and its GPU compiler refuses it for some dots
        return upcast(q, k)
    return product(q, k, precision)


def _weighted(probs, value, precision=None):
    """``(B, T, K, G, Hv)``: ``probs`` ``(B, K, G, T, S)`` times ``value`` ``(B, S, K, Hv)`` over the keys."""
    b, heads_kv, g, t, s = probs.shape
    out = _batched_dot(probs.reshape(b, heads_kv, g * t, s), jnp.transpose(value, (0, 2, 1, 3)), 2,
                       precision=precision)
    return jnp.transpose(out.reshape(b, heads_kv, g, t, -1), (0, 3, 1, 2, 4))


def _grouped(x, heads_kv: int):
    """A ``(B|1, N|1, T, S)`` bias or mask as ``(B|1, K|1, G|1, T, S)``."""
    if x is None:
        return None
    b, n, t, s = x.shape
    return x[:, :, None] if n == 1 else x.reshape(b, heads_kv, n // heads_kv, t, s)


def attend(query, key, value, *, scale, bias=None, visible=None, sinks=None, empty_rows: str, precision=None):
    """``(out, lse)`` of ``query`` ``(B, T, N, H)`` against ``key`` ``(B, S, K, H)`` and ``value`` ``(B, S, K, Hv)``,
    ``K`` dividing ``N`` (query head ``n`` reads key head ``n // (N // K)``): out ``(B, T, N, Hv)`` in the values'
    dtype, lse ``(B, N, T)`` in the logits' dtype, the natural-log sum of every row's exponentials, the sink's too.

    ``bias`` (added to the scaled logits) and ``visible`` (boolean, False: masked) broadcast to ``(B, N, T, S)`` with
    a heads axis of 1 or N; ``sinks``: ``(N,)`` float32 logits or None. ``empty_rows`` is the convention of a
    masked logit (module docstring): ``"average"`` (jax.nn's large negative number) or ``"zero"``
    (FlashAttention's ``-inf``). ``precision``: None (jax's default) or a ``lax.Precision`` for both products of
    float32 and wider operands."""
    b, t, n, h = query.shape
    heads_kv = key.shape[2]
    logits = _scores(query.reshape(b, t, heads_kv, n // heads_kv, h), key, precision)
    logits *= jnp.array(scale, dtype=logits.dtype)
    if bias is not None:
        logits = (logits + _grouped(bias, heads_kv)).astype(logits.dtype)
    if visible is not None:
        if empty_rows == "average":
            masked = jnp.asarray(-0.7 * min(float(jnp.finfo(logits.dtype).max), float(jnp.finfo(np.float32).max)),
                                 logits.dtype)
        else:
            masked = jnp.asarray(-jnp.inf, logits.dtype)
        logits = jnp.where(_grouped(visible, heads_kv), logits, masked)
    logits = (jnp.real(logits) if jnp.iscomplexobj(logits) else logits).astype(np.float32)  # jax.nn's float32
    if sinks is not None:
        column = sinks.astype(np.float32).reshape(heads_kv, n // heads_kv)[None, :, :, None, None]
        logits = jnp.concatenate([logits, jnp.broadcast_to(column, (*logits.shape[:-1], 1))], axis=-1)
    if empty_rows == "average":
        probs = jax.nn.softmax(logits, axis=-1)
        lse = jax.nn.logsumexp(logits, axis=-1)
    else:
        probs, lse = _softmax_empty_rows_zero(logits)
    if sinks is not None:
        probs = probs[..., :-1]
    out = _weighted(probs.astype(key.dtype), value, precision)
    return out.reshape(b, t, n, value.shape[-1]), lse.reshape(b, n, t)


def _softmax_empty_rows_zero(logits):
    """Softmax and logsumexp over the last axis where a row of ``-inf`` has probabilities 0 and lse ``-inf``, with
    finite gradients (none flows through such a row)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    top = lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    e = jnp.exp(logits - top)
    total = jnp.sum(e, axis=-1, keepdims=True)
    some = total > 0
    safe = jnp.where(some, total, 1.0)
    probs = e / safe
    lse = jnp.where(some, top + jnp.log(safe), -jnp.inf)[..., 0]
    return probs, lse


# ---- jax.nn's masks: top-left --------------------------------------------------------------------------------

def jax_nn_visible(t: int, s: int, *, is_causal: bool, window, q_lengths, kv_lengths, q_positions=None,
                   k_positions=None):
    """jax.nn's ``(B|1, 1, T, S)`` boolean of the logits a query sees (None: all): key ``j`` by query ``i`` where
    ``j <= i`` (causal), ``i - left <= j <= i + right`` (``window``), ``i < q_lengths[b]`` and
    ``j < kv_lengths[b]``; ``i`` and ``j`` are the rows' and keys' positions, integer ``(T,)`` and ``(S,)``
    (None: ``0 .. T-1`` and ``0 .. S-1``)."""
    visible = None

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    i = (jnp.arange(t) if q_positions is None else q_positions)[:, None]
    j = (jnp.arange(s) if k_positions is None else k_positions)[None, :]
    if is_causal:
        visible = both(visible, (j <= i)[None, None])
    if window is not None:
        left, right = window
        visible = both(visible, ((i <= j + left) & (i >= j - right))[None, None])
    if q_lengths is not None or kv_lengths is not None:
        rows = True if q_lengths is None else i[None] < q_lengths[:, None, None]
        cols = True if kv_lengths is None else j[None] < kv_lengths[:, None, None]
        visible = both(visible, jnp.logical_and(rows, cols)[:, None])
    return visible


def dot_product_attention(query, key, value, bias, mask, *, scale, is_causal, q_lengths, kv_lengths, window,
                          sinks, return_residual, precision=None, q_positions=None, k_positions=None):
    """jax.nn's ``dot_product_attention(implementation='xla')`` on 4D arrays, with ``sinks`` (module docstring):
    ``out`` ``(B, T, N, H)``, and with ``return_residual`` the lse ``(B, T, N)`` in the keys' dtype, as a constant
    of differentiation. ``q_positions`` ``(T,)`` and ``k_positions`` ``(S,)``, integer or None: the positions the
    masks and lengths count (:func:`jax_nn_visible`)."""
    t, s = query.shape[1], key.shape[1]
    visible = jax_nn_visible(t, s, is_causal=is_causal, window=window, q_lengths=q_lengths, kv_lengths=kv_lengths,
                             q_positions=q_positions, k_positions=k_positions)
    if mask is not None:
        visible = mask if visible is None else jnp.logical_and(mask, visible)
    out, lse = attend(query, key, value, scale=scale, bias=bias, visible=visible, sinks=sinks, empty_rows="average",
                      precision=precision)
    if q_lengths is not None:
        rows = (jnp.arange(t) if q_positions is None else q_positions)[None, :] < q_lengths[:, None]
        out *= rows[:, :, None, None].astype(out.dtype)
    if return_residual:
        return out, lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)).astype(key.dtype))
    return out


# ---- FlashAttention's masks: bottom-right ---------------------------------------------------------------------

def flash_window(causal: bool, window_size) -> tuple:
    """``(left, right)`` of FlashAttention's interface (None: unbounded): causal bounds the right side at 0, and a
    window whose sides sum below 0 is no window."""
    left, right = window_size if window_size is not None else (None, None)
    left = None if left is None else int(left)
    right = None if right is None else int(right)
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    return left, right


def _band(i, j, offset, window):
    """Where ``-right <= i + offset - j <= left`` (None sides unbounded); None if both are."""
    left, right = window
    d = i + offset - j
    ok = None
    if left is not None:
        ok = d <= left
    if right is not None:
        ok = (d >= -right) if ok is None else ok & (d >= -right)
    return ok


def flash_attention(q, k, v, *, scale, window, sinks=None, seqlens=None):
    """FlashAttention's attention in jax.numpy: ``(out, lse)`` with fa4-jax's shapes. Dense: q ``(B, S, H, D)``,
    k ``(B, Sk, Hkv, D)``, v ``(B, Sk, Hkv, Dv)``; out ``(B, S, H, Dv)``, lse ``(B, H, S)``. Packed
    (``seqlens`` = ``(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)``, int32): q ``(T, H, D)``, out
    ``(T, H, Dv)``, lse ``(H, T)``; a row no sequence uses (past its used length, or between sequences) gives out 0
    and lse ``-inf``. ``window``: ``(left, right)`` of :func:`flash_window`, bottom-right aligned on each sequence's
    used lengths."""
    if seqlens is None:
        s, s_k = q.shape[1], k.shape[1]
        i, j = jnp.arange(s)[:, None], jnp.arange(s_k)[None, :]
        band = _band(i, j, s_k - s, window)
        visible = None if band is None else band[None, None]
        out, lse = attend(q, k, v, scale=scale, visible=visible, sinks=sinks, empty_rows="zero")
        return out.astype(q.dtype), lse.astype(np.float32)
    cu_q, cu_k, used_q, used_k = seqlens
    rows_q, seq_q, pos_q = _packed_rows(cu_q, used_q, q.shape[0])
    rows_k, seq_k, pos_k = _packed_rows(cu_k, used_k, k.shape[0])
    visible = rows_q[:, None] & rows_k[None, :] & (seq_q[:, None] == seq_k[None, :])
    offset = (used_k[seq_q] - used_q[seq_q])[:, None]
    band = _band(pos_q[:, None], pos_k[None, :], offset, window)
    if band is not None:
        visible &= band
    out, lse = attend(q[None], k[None], v[None], scale=scale, visible=visible[None, None], sinks=sinks,
                      empty_rows="zero")
    out = jnp.where(rows_q[:, None, None], out[0], 0).astype(q.dtype)
    lse = jnp.where(rows_q[None, :], lse[0], -jnp.inf).astype(np.float32)
    return out, lse


def _packed_rows(cu, used, total: int):
    """For each of ``total`` packed rows: whether a sequence uses it, that sequence, and the row's position in it
    (sequence ``b`` holds rows ``cu[b] .. cu[b + 1]``, the first ``used[b]`` of them used)."""
    t = jnp.arange(total, dtype=jnp.int32)
    batch = cu.shape[0] - 1
    seq = jnp.clip(jnp.searchsorted(cu, t, side="right", method="scan_unrolled") - 1, 0, batch - 1)
    pos = t - cu[seq]
    return (t >= cu[seq]) & (t < cu[seq + 1]) & (pos < used[seq]), seq, pos
