"""The reference and the bound of the GPU gradient tests (``test_gradients.py``, ``test_fa4jax_sinks.py``): plain
attention and its gradients by torch autograd (``fa4_peer.attention_grads``), each packed sequence apart, and
FlashAttention's rule for one tensor: its error against the high-precision reference at most ``rtol`` times the error
of the same computation in the inputs' low precision, plus a rounding term at the reference's magnitude.

Shapes as those tests use them: dense q ``(B, S, H, D)``, k and v ``(B, Sk, Hkv, D)``, lse ``(B, H, S)``; packed q
``(T, H, D)``, k and v ``(Tk, Hkv, D)``, lse ``(H, T)``. Importing it imports no torch: :func:`reference` does, and
:func:`judge` reads torch tensors where torch is already imported.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

import fa4_peer
from support import cu_seqlens

RULES = ("flash_attention", "magnitude")
"""The bounds :func:`judge` takes.

``"flash_attention"``: FlashAttention's tests' own (``tests/cute/test_flash_attn.py``), the one
``tests/data/producer_gradients.json`` was measured with: differences taken in the reference's dtype, and the rounding
term twice ``max|(r + 0.3 - 0.3) - r|`` there, the reference's rounding at ``max(|r|, 0.3)``.

``"magnitude"``: differences in float64, and the rounding term ``max|r| * (2 eps_float32 + eps)``, ``eps`` the
result's own where it is 16-bit (0 otherwise): a 16-bit out, lse or dsink is rounded once more than the float32
computation it comes from, by up to its own ulp at the reference's magnitude.

Neither bound is within the other: the first is absolute for a small reference (about 2^-24 in float32, 2^-53 in
float64), the second relative to the reference's largest value."""


def sequences(lens_q, lens_k=None, used_q=None, used_k=None) -> list:
    """Each packed sequence's ``(q rows, k rows)``, two slices of the packed rows: ``lens_q`` (``lens_k``; None: the
    same) rows apiece, of which the first ``used_q`` (``used_k``; None: all)."""
    lens_k = lens_q if lens_k is None else lens_k
    used_q = lens_q if used_q is None else used_q
    used_k = lens_k if used_k is None else used_k
    return [(slice(int(a), int(a) + n), slice(int(b), int(b) + m))
            for a, b, n, m in zip(cu_seqlens(lens_q)[:-1], cu_seqlens(lens_k)[:-1], used_q, used_k)]


def used_rows(lens, used) -> np.ndarray:
    """``(T,)`` bool: the packed rows a sequence uses, the first ``used`` of each sequence of ``lens`` rows."""
    mask = np.zeros(sum(lens), bool)
    for start, n in zip(cu_seqlens(lens)[:-1], used):
        mask[start:start + n] = True
    return mask


def reference(q, k, v, d_out, *, causal: bool, scale: float, dtype, window=(None, None), sink=None, d_lse=None,
              packed=None) -> dict:
    """``fa4_peer.attention_grads`` of torch tensors in ``dtype``: ``{"out", "lse", "dq", "dk", "dv"[, "dsink"]}``.

    Dense (``packed`` None): q ``(B, S, H, D)``, k ``(B, Sk, Hkv, D)``, v ``(B, Sk, Hkv, Dv)``, d_out
    ``(B, S, H, Dv)``, d_lse ``(B, H, S)`` or None; out and the gradients in the inputs' shapes, lse ``(B, H, S)``.
    Packed (``packed`` the slices of :func:`sequences`): q ``(T, H, D)``, k ``(Tk, Hkv, D)``, v ``(Tk, Hkv, Dv)``,
    d_out ``(T, H, Dv)``, d_lse ``(H, T)`` or None; each sequence with rows attends alone, out, dq, dk and dv in the
    inputs' shapes and lse ``(H, T)`` on the rows it uses, 0 on the others. dsink ``(H,)`` (with a sink) summed
    over the sequences."""
    import torch

    kw = dict(causal=causal, scale=scale, sink=sink, dtype=dtype, window=window)
    if packed is None:
        return fa4_peer.attention_grads(q, k, v, d_out, d_lse=d_lse, **kw)
    out = {name: torch.zeros_like(x, dtype=dtype) for name, x in (("out", d_out), ("dq", q), ("dk", k), ("dv", v))}
    out["lse"] = torch.zeros((q.shape[1], q.shape[0]), dtype=dtype, device=q.device)
    if sink is not None:
        out["dsink"] = 0
    for rq, rk in packed:
        if rq.stop == rq.start:
            continue
        part = fa4_peer.attention_grads(q[rq][None], k[rk][None], v[rk][None], d_out[rq][None],
                                        d_lse=None if d_lse is None else d_lse[:, rq][None], **kw)
        for name, rows in (("out", rq), ("dq", rq), ("dk", rk), ("dv", rk)):
            out[name][rows] = part[name][0]
        out["lse"][:, rq] = part["lse"][0]
        if sink is not None:
            out["dsink"] = out["dsink"] + part["dsink"]
    return out


def _numpy(x) -> np.ndarray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return fa4_peer.to_numpy(x)
    return np.asarray(x)


def _max_abs(x) -> float:
    return float(np.max(np.abs(x), initial=0))


def judge(got, ref, low, rtol: float, *, rule: str, rows=None, lse: bool = False, finite: bool = False) -> tuple:
    """``(error, tolerance)`` of one tensor as Python floats: ``error = max|got - ref|``, ``tolerance = rtol *
    max|low - ref| + atol``, ``atol`` by ``rule`` (:data:`RULES`).

    ``got`` the result (a jax, numpy or torch array), ``ref`` the high-precision reference (float32 or float64) and
    ``low`` the same computation in the inputs' precision, all of one shape. ``rows``: a bool mask of the packed rows
    to judge, on the first axis (the last with ``lse``: ``(H, T)``); None: all. ``finite``: only where the reference
    is finite and, with ``lse``, above -1e3 (a row that sees only a -inf sink, taken as -1e4 by the reference)."""
    if rule not in RULES:
        raise ValueError(f"rule {rule!r} is not one of {RULES}")
    g, r, lo = (_numpy(x) for x in (got, ref, low))
    result_dtype = g.dtype
    if rows is not None:  # before any cast: rows no sequence uses may hold anything
        g, r, lo = (x[..., rows] if lse else x[rows] for x in (g, r, lo))
    work = np.dtype(np.float64) if rule == "magnitude" else r.dtype
    g, r, lo = (x.astype(work) for x in (g, r, lo))
    if finite:
        keep = np.isfinite(r) & ((r > -1e3) if lse else True)
        g, r, lo = g[keep], r[keep], lo[keep]
    if rule == "magnitude":
        eps = float(ml_dtypes.finfo(result_dtype).eps) if result_dtype.itemsize == 2 else 0
        atol = _max_abs(r) * (2 * float(np.finfo(np.float32).eps) + eps)
        return _max_abs(g - r), rtol * _max_abs(lo - r) + atol
    with np.errstate(invalid="ignore"):  # as torch computes it: an infinite reference gives NaN, not a warning
        point3 = work.type(0.3)
        atol = 2 * _max_abs((r + point3 - point3) - r)
        return _max_abs(g - r), rtol * _max_abs(lo - r) + atol
