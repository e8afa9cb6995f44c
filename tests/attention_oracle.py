"""Attention in float64 numpy, written apart from jax_dqpost and jax: the forward and its gradients by their
formulas (no automatic differentiation), with learnable sinks, for the attention tests.

``visible`` says which logits take part, ``(B|1, N|1, T, S)``; the two conventions of a masked logit are jax.nn's
(``"average"``: a large finite number, so a row that sees nothing averages every value) and FlashAttention's
(``"zero"``: such a row gives 0, its lse the sink or ``-inf``). Query head ``n`` reads key head ``n // (N // K)``.
"""

from __future__ import annotations

import numpy as np

LARGE_NEGATIVE = -0.7 * float(np.finfo(np.float32).max)  # jax.nn's masked logit (float32 logits)


# ---- which keys a query sees --------------------------------------------------------------------------------

def top_left(t, s, *, causal=False, window=None):
    """jax.nn's ``(T, S)``: key ``j`` by query ``i`` where ``j <= i`` (causal) and ``i - left <= j <= i + right``."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    ok = np.ones((t, s), bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (j >= i - window[0]) & (j <= i + window[1])
    return ok


def bottom_right(t, s, *, causal=False, window=(None, None)):
    """FlashAttention's ``(T, S)``: ``-right <= i + S - T - j <= left`` (None sides unbounded; causal: right 0;
    sides summing below 0: no window)."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    d = np.arange(t)[:, None] + s - t - np.arange(s)[None, :]
    ok = np.ones((t, s), bool)
    if left is not None:
        ok &= d <= left
    if right is not None:
        ok &= d >= -right
    return ok


def lengths_mask(t, s, q_lengths=None, kv_lengths=None):
    """``(B, 1, T, S)``: rows under the query length see keys under the key length (None: all)."""
    batch = len(q_lengths if q_lengths is not None else kv_lengths)
    rows = np.ones((batch, t), bool) if q_lengths is None else np.arange(t)[None] < np.asarray(q_lengths)[:, None]
    cols = np.ones((batch, s), bool) if kv_lengths is None else np.arange(s)[None] < np.asarray(kv_lengths)[:, None]
    return (rows[:, :, None] & cols[:, None, :])[:, None]


# ---- attention and its gradients ----------------------------------------------------------------------------

def _expand(k, heads):
    """``(B, S, K, H)`` -> ``(B, S, N, H)``: each key head repeated for its query heads."""
    return np.repeat(np.asarray(k, np.float64), heads // k.shape[2], axis=2)


def forward(q, k, v, *, scale, visible=None, bias=None, sinks=None, empty="average"):
    """``(out (B, T, N, Hv), lse (B, N, T), p (B, N, T, S), p_sink (B, N, T) or None)`` in float64."""
    q = np.asarray(q, np.float64)
    b, t, n, _ = q.shape
    kk, vv = _expand(k, n), _expand(v, n)
    logits = np.einsum("btnh,bsnh->bnts", q, kk) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    if visible is not None:
        logits = np.where(visible, logits, LARGE_NEGATIVE if empty == "average" else -np.inf)
    if sinks is not None:
        column = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (*logits.shape[:3], 1))
        logits = np.concatenate([logits, column], axis=-1)
    top = logits.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(logits - top)
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(total > 0, e / total, 0.0)
        lse = np.where(total > 0, top + np.log(total), -np.inf)[..., 0]
    p_sink = p[..., -1] if sinks is not None else None
    p = p[..., :-1] if sinks is not None else p
    out = np.einsum("bnts,bsnh->btnh", p, vv)
    return out, lse, p, p_sink


def gradients(q, k, v, d_out, *, scale, visible=None, bias=None, sinks=None, empty="average"):
    """``(dq, dk, dv, dsink or None)`` of ``sum(out * d_out)`` in float64, by the formulas: ``dP = dO V^T``,
    ``D_i = sum(dO_i O_i)``, ``dS = P (dP - D)`` on the visible logits (masked ones are constants), ``dq = scale dS
    K``, ``dk = scale dS^T Q``, ``dv = P^T dO``, ``dsink_n = -sum_i P_sink,i D_i``."""
    q64, d_out = np.asarray(q, np.float64), np.asarray(d_out, np.float64)
    b, t, n, _ = q64.shape
    heads_kv = k.shape[2]
    out, _, p, p_sink = forward(q, k, v, scale=scale, visible=visible, bias=bias, sinks=sinks, empty=empty)
    kk, vv = _expand(k, n), _expand(v, n)
    dp = np.einsum("btnh,bsnh->bnts", d_out, vv)
    rows = np.einsum("btnh,btnh->bnt", d_out, out)
    ds = p * (dp - rows[..., None])
    if visible is not None:
        ds = np.where(visible, ds, 0.0)
    dq = scale * np.einsum("bnts,bsnh->btnh", ds, kk)
    dk = scale * np.einsum("bnts,btnh->bsnh", ds, q64)
    dv = np.einsum("bnts,btnh->bsnh", p, d_out)
    group = n // heads_kv
    dk = dk.reshape(*dk.shape[:2], heads_kv, group, -1).sum(3)
    dv = dv.reshape(*dv.shape[:2], heads_kv, group, -1).sum(3)
    dsink = None if sinks is None else -(p_sink * rows).sum(axis=(0, 2))
    return dq, dk, dv, dsink
