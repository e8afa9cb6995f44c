"""The ``'xla_chunked'`` attention (jax_dqpost/_attention/xla_chunked.py): ``'xla'`` in blocks of keys, against
``'xla'`` itself with many blocks and a partial last one (out, residual, the gradients of query, key, value, sinks,
bias, a traced scale and the lse inside, within bounds from float64 sums of each result's terms); a sink of ``+inf``
at its limit; vmap, jit and checkpoint; head dim 0, complex inputs, float64 against float64 formulas; the precision;
its memory at 16k tokens, from XLA's buffer assignment."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_oracle as oracle64
from jax_dqpost._attention import xla, xla_chunked
from support import assert_within_roundings, ulp

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
BLOCKS = (1, 3, 4, 8, None)  # None: the default, one block at these sizes
ARGNAMES = ("dq", "dk", "dv", "dbias", "dsinks")


def unit(dtype) -> float:
    """One rounding of ``dtype`` (of its real and imaginary parts) counted in float32 roundings, the unit of
    ``assert_within_roundings``' terms."""
    return float(ulp(1.0, jnp.finfo(dtype).dtype) / ulp(1.0, np.float32))


def _broadcast_shape(rng, full):
    """``full`` with each axis 1 or full, at random."""
    return tuple(int(d) if rng.random() < 0.5 else 1 for d in full)


def _case(rng, dtype, *, sinks=True):
    """Random inputs and keywords of one call of the internal signature: GQA or not, T != S or not, a causal mask, a
    window, lengths, a boolean mask and a bias of random broadcast shapes, a scale, sinks (some ``-inf``), each or
    not; up to 19 keys, so that blocks of 1 to 8 keys make many blocks and a partial last one."""
    b = int(rng.integers(1, 3))
    t, s = (int(x) for x in rng.integers(3, 20, 2))
    heads_kv = int(rng.choice([1, 2]))
    n = heads_kv * int(rng.choice([1, 2, 3]))
    h = int(rng.choice([8, 16]))
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, s, heads_kv, h)), dtype) for _ in range(2))
    kw = dict(bias=None, mask=None, scale=h ** -0.5, is_causal=bool(rng.random() < 0.5), q_lengths=None,
              kv_lengths=None, window=None, sinks=None)
    if rng.random() < 0.5:
        kw["window"] = (int(rng.integers(0, 6)), int(rng.integers(0, 6)))
    if rng.random() < 0.5:
        kw["q_lengths"] = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32)
    if rng.random() < 0.5:
        kw["kv_lengths"] = jnp.asarray(rng.integers(1, s + 1, b), jnp.int32)
    if rng.random() < 0.4:
        kw["mask"] = jnp.asarray(rng.random(_broadcast_shape(rng, (b, n, t, s))) < 0.8)
    if rng.random() < 0.6:
        kw["bias"] = jnp.asarray(rng.standard_normal(_broadcast_shape(rng, (b, n, t, s))), dtype)
    if rng.random() < 0.5:
        kw["scale"] = float(rng.uniform(0.1, 0.5))
    if sinks and rng.random() < 0.7:
        values = rng.standard_normal(n) * 2
        kw["sinks"] = jnp.asarray(np.where(rng.random(n) < 0.25, -np.inf, values), jnp.float32)
    return (q, k, v), kw


# Both programs of a comparison compiled with LLVM's optimisations off: a random configuration compiles in about a
# third of the time (the file's time is mostly compiling); the bounds assume no order of a sum.
FAST = {"xla_backend_optimization_level": 0}


def _grads(impl, kw, weights, **extra):
    """``f(q, k, v, bias, sinks) -> ((dq, dk, dv, dbias, dsinks), (out, residual))``: ``impl``'s gradients of
    ``sum(out * weights)`` (None where there is no bias or sink), its out and residual."""
    fixed = {name: kw[name] for name in ("mask", "scale", "is_causal", "q_lengths", "kv_lengths", "window")}

    def loss(q, k, v, bias, sinks):
        out, res = impl(q, k, v, bias, sinks=sinks, return_residual=True, **fixed, **extra)
        return jnp.sum(jnp.real(out.astype(jnp.promote_types(out.dtype, jnp.float32)) * weights)), (out, res)

    return jax.grad(loss, argnums=tuple(range(5)), has_aux=True)


def _both(q, k, v, kw, weights, block_size):
    """``(got, want)``: 'xla_chunked''s and 'xla''s ``(out, residual, (dq, dk, dv, dbias, dsinks))``, one compile."""
    chunked = _grads(xla_chunked.dot_product_attention, kw, weights, block_size=block_size)
    reference = _grads(xla.dot_product_attention, kw, weights)
    args = (q, k, v, kw["bias"], kw["sinks"])
    results = jax.jit(lambda *a: (chunked(*a), reference(*a))).lower(*args).compile(FAST)(*args)
    return tuple((out, res, grads) for grads, (out, res) in results)


def _compare(got, want, mags, counts, dtype, what):
    """Out, residual and gradients of ``got`` within roundings of ``want``: one rounding of its dtype, and
    ``counts`` float32 terms at ``mags``."""
    names = ("out", "residual") + ARGNAMES
    for name, g, w in zip(names, (*got[:2], *got[2]), (*want[:2], *want[2])):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        with np.errstate(invalid="ignore"):  # inf - inf where both are: a masked row's fp16 residual, -inf
            for part in (np.real, np.imag) if jnp.iscomplexobj(w) else (np.asarray,):
                assert_within_roundings(part(g), part(w), f"{name} {what}", terms=counts[name],
                                        magnitude=mags[name])


def _visible(t, s, kw):
    """The oracle's ``(B|1, N|1, T, S)`` of what a query sees."""
    vis = oracle64.top_left(t, s, causal=kw["is_causal"], window=kw["window"])[None, None]
    if kw["q_lengths"] is not None or kw["kv_lengths"] is not None:
        vis = vis & oracle64.lengths_mask(t, s, kw["q_lengths"], kw["kv_lengths"])
    if kw["mask"] is not None:
        vis = vis & np.asarray(kw["mask"])
    return vis


def _reduce_to(x, shape):
    """``x`` summed over the axes where ``shape`` is 1 (a broadcast operand's gradient)."""
    axes = tuple(a for a, d in enumerate(shape) if d == 1 and x.shape[a] != 1)
    return x.sum(axis=axes, keepdims=True)


def _real_logits(q, k):
    """``(q, k)``, or where complex, real ``(q', k')`` whose products ``q' k'^T`` are ``q k^T``'s real part."""
    if not jnp.iscomplexobj(q):
        return q, k
    q, k = np.asarray(q), np.asarray(k)
    return np.concatenate([q.real, -q.imag], -1), np.concatenate([k.real, k.imag], -1)


def _magnitudes(q, k, v, kw, weights, lse_weights=None, zeroed=True):
    """Float64 sums of the absolute values of each result's terms, the scale of what rounding and reordering move:
    ``{"out", "residual", "dq", "dk", "dv", "dbias", "dsinks", "dscale"}`` (``out``'s: ``sum_j P_ij |v_j|``; a
    gradient's: its sum over ``|dS_ij|``'s terms ``P_ij (|dO_i| |v_j| + |dO_i| |O_i|)`` times ``|k_j|``, ``|q_i|``,
    or alone, ``|O_i|`` bounded by ``sum_j P_ij |v_j|``; the residual's: the largest ``|logit|`` of its row, and 1
    for the log of its sum; moduli of complex numbers). ``lse_weights``
    ``(B, N, T)``: an lse's cotangent too, ``g_i P_ij`` in ``dS_ij``; ``zeroed``: the output's rows past the
    query lengths are zeroed (not yet inside the ``custom_vjp``)."""
    b, t, n, h = q.shape
    s, heads_kv = k.shape[1], k.shape[2]
    scale = float(kw["scale"])
    vis = _visible(t, s, kw)
    bias = None if kw["bias"] is None else np.asarray(kw["bias"], np.float64)
    sinks = None if kw["sinks"] is None else np.asarray(kw["sinks"], np.float64)
    wide = np.complex128 if jnp.iscomplexobj(q) else np.float64
    va = np.abs(np.asarray(v).astype(wide))
    out, _, p, p_sink = oracle64.forward(*_real_logits(q, k), va, scale=scale, visible=vis, bias=bias, sinks=sinks)
    rows = np.ones((b, t), bool) if kw["q_lengths"] is None or not zeroed else \
        np.arange(t)[None] < np.asarray(kw["q_lengths"])[:, None]
    d_out = np.abs(np.asarray(weights).astype(wide)) * rows[:, :, None, None]
    qa = np.abs(np.asarray(q).astype(wide))
    ka, va = (np.repeat(np.abs(np.asarray(x).astype(wide)), n // heads_kv, axis=2) for x in (k, v))
    raw = np.einsum("btnh,bsnh->bnts", qa, ka)  # |q| |k|: the products' terms
    logits = scale * raw + (0 if bias is None else np.abs(bias))
    terms = p * (np.einsum("btnh,bsnh->bnts", d_out, va) + np.einsum("btnh,btnh->bnt", d_out, out)[..., None])
    g = 0.0 if lse_weights is None else np.abs(np.asarray(lse_weights, np.float64))
    terms = np.where(vis, terms + p * np.asarray(g)[..., None], 0.0)
    group = n // heads_kv

    def kv_heads(x):
        return x.reshape(b, s, heads_kv, group, -1).sum(3)

    return {
        "out": out,
        "residual": (np.where(np.broadcast_to(vis, logits.shape), logits, 0).max(-1) + 1).transpose(0, 2, 1),
        "dq": scale * np.einsum("bnts,bsnh->btnh", terms, ka),
        "dk": kv_heads(scale * np.einsum("bnts,btnh->bsnh", terms, qa)),
        "dv": kv_heads(np.einsum("bnts,btnh->bsnh", p, d_out)),
        "dbias": None if bias is None else _reduce_to(terms, bias.shape),
        "dsinks": None if sinks is None else
        (p_sink * (np.einsum("btnh,btnh->bnt", d_out, out) + g)).sum(axis=(0, 2)),
        "dscale": (terms * raw).sum(),
    }


def _counts(dtype, q_shape, k_shape, bias_shape=None) -> dict:
    """``terms`` of each result: the float32 sums that the two programs may order otherwise, and the roundings of
    ``dtype`` at which they differ, each counted in float32 roundings (``unit``). The logits are the same products
    in both (``xla._scores``).

    A probability: the softmax's sum over S keys, and its running max and sum rescaled once a block (at most S
    blocks): 2 S. out: its sum over S, and the probabilities rounded to the dtype, normalised ('xla') or not (here):
    2 roundings. residual: the softmax's sum and its rescalings, 2 S. dS: a probability, ``dO V^T`` and ``D =
    rowsum(dO O)`` of H terms each, ``dO V^T`` rounded to the dtype in 'xla' (bf16, fp16) and not here, O rounded
    to it in D, and ``scale dS`` rounded to it, of other values, for the products: 3 roundings. Then dq sums S of
    them, dk the T G query rows of a key head, dv as many probabilities (one rounding each), a sink B T rows, the
    bias the elements its broadcast sums, and the scale all B N T S."""
    b, t, n, h = q_shape
    s, heads_kv = k_shape[1], k_shape[2]
    r = unit(dtype)
    p = 2 * s
    ds = p + 2 * h + 3 * r
    rows = t * (n // heads_kv)
    return {"out": p + s + 2 * r, "residual": p, "dq": ds + s, "dk": ds + rows, "dv": p + r + rows,
            "dbias": None if bias_shape is None else ds + b * n * t * s // int(np.prod(bias_shape)),
            "dsinks": ds + b * t, "dscale": ds + b * n * t * s}


# ---- against 'xla' ---------------------------------------------------------------------------------------------

def _description(kw, block_size, q, k):
    shown = {n: (x.shape if hasattr(x, "shape") else x) for n, x in kw.items() if x is not None and x is not False}
    return f"q {q.shape} k {k.shape} block {block_size} {shown}"


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_chunked_is_xla(rng, dtype):
    """Out, residual and the gradients of query, key, value, bias and sinks: 'xla''s, within its roundings, for
    random masks, lengths, windows, biases of every broadcast, sinks and grouped heads, with blocks of 1, 3, 4, 8
    keys (many, the last partial) and the default."""
    for i in range(8):
        (q, k, v), kw = _case(rng, dtype)
        block_size = BLOCKS[i % len(BLOCKS)]
        weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        got, want = _both(q, k, v, kw, weights, block_size)
        counts = _counts(dtype, q.shape, k.shape, None if kw["bias"] is None else kw["bias"].shape)
        _compare(got, want, _magnitudes(q, k, v, kw, weights), counts, dtype, _description(kw, block_size, q, k))


def test_an_infinite_sink_is_its_limit(rng):
    """A sink of ``+inf``: its head's rows are 0, their residual ``+inf``, every gradient finite (the sink's 0), and
    all else 'xla''s with that sink at 10^4, where exp underflows to the limit ('xla' itself gives NaN at
    ``+inf``)."""
    (q, k, v), kw = _case(rng, jnp.float32, sinks=False)
    n = q.shape[2]
    heads = np.arange(n) % 2 == 0  # half the query heads, of each key head where a group has two
    kw["sinks"] = jnp.asarray(np.where(heads, np.inf, rng.standard_normal(n)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    got, _ = _both(q, k, v, kw, weights, 3)
    out, res, grads = got
    assert not np.asarray(out)[:, :, heads].any() and (heads.all() or np.asarray(out)[:, :, ~heads].any())
    assert np.isposinf(np.asarray(res)[:, :, heads]).all() and np.isfinite(np.asarray(res)[:, :, ~heads]).all()
    for name, g in zip(ARGNAMES, grads):
        assert g is None or np.isfinite(np.asarray(g)).all(), name
    assert not np.asarray(grads[4])[heads].any()
    limit = dict(kw, sinks=jnp.where(jnp.asarray(heads), 1e4, kw["sinks"]))
    _, want = _both(q, k, v, limit, weights, 3)
    want = (want[0], jnp.where(jnp.asarray(heads), jnp.inf, want[1]), want[2])
    counts = _counts(jnp.float32, q.shape, k.shape, None if kw["bias"] is None else kw["bias"].shape)
    _compare(got, want, _magnitudes(q, k, v, limit, weights), counts, jnp.float32, _description(kw, 3, q, k))


def test_a_traced_scale_and_its_gradient(rng):
    """A scale passed to jit as an array: out and the gradients of the scale, query and bias are 'xla''s."""
    (q, k, v), kw = _case(rng, jnp.float32)
    kw["bias"] = jnp.asarray(rng.standard_normal((1, q.shape[2], q.shape[1], k.shape[1])), jnp.float32)
    kw["scale"] = 0.3
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    fixed = {n: kw[n] for n in ("mask", "is_causal", "q_lengths", "kv_lengths", "window", "sinks")}

    def grads(impl, **extra):
        def loss(q, bias, scale):
            out = impl(q, k, v, bias, scale=scale, return_residual=False, **fixed, **extra)
            return jnp.sum(out * weights), out
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, kw["bias"], jnp.float32(kw["scale"]))

    (got, got_out), (want, want_out) = grads(xla_chunked.dot_product_attention, block_size=4), \
        grads(xla.dot_product_attention)
    mags = _magnitudes(q, k, v, kw, weights)
    counts = _counts(jnp.float32, q.shape, k.shape, kw["bias"].shape)
    assert got[2].dtype == jnp.float32 and got[2].shape == ()
    assert_within_roundings(got_out, want_out, "out", terms=counts["out"], magnitude=mags["out"])
    for name, g, w in zip(("dq", "dbias", "dscale"), got, want):
        assert_within_roundings(g, w, name, terms=counts[name], magnitude=mags[name])


def test_the_lse_is_differentiable_inside(rng):
    """The residual is a constant of differentiation, but the lse of the ``custom_vjp`` inside is not: its
    cotangent's gradients (with the output's) are those of 'xla''s lse (``xla.attend``)."""
    (q, k, v), kw = _case(rng, jnp.float32)
    b, t, n, _ = q.shape
    s, heads_kv = k.shape[1], k.shape[2]
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    lse_weights = jnp.asarray(rng.standard_normal((b, n, t)), jnp.float32)
    window = None if kw["window"] is None else tuple(kw["window"])
    static = xla_chunked._Static(3, -(-s // 3), s, kw["is_causal"], window, kw["scale"])
    visible = xla.jax_nn_visible(t, s, is_causal=kw["is_causal"], window=kw["window"], q_lengths=kw["q_lengths"],
                                 kv_lengths=kw["kv_lengths"])
    if kw["mask"] is not None:
        visible = kw["mask"] if visible is None else visible & kw["mask"]

    def chunked(q, k, v, bias, sinks):
        out, lse = xla_chunked._attention(static, q, k, v, bias, kw["mask"], kw["q_lengths"], kw["kv_lengths"],
                                          sinks, None)
        return out, jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, n).transpose(0, 2, 1)

    def reference(q, k, v, bias, sinks):
        return xla.attend(q, k, v, scale=kw["scale"], bias=bias, visible=visible, sinks=sinks, empty_rows="average")

    def grads(impl):
        def loss(*args):
            out, lse = impl(*args)
            return jnp.sum(out * weights) + jnp.sum(lse * lse_weights)
        return jax.grad(loss, argnums=tuple(range(5)))

    args = (q, k, v, kw["bias"], kw["sinks"])
    got, want = jax.jit(lambda *a: (grads(chunked)(*a), grads(reference)(*a))).lower(*args).compile(FAST)(*args)
    mags = _magnitudes(q, k, v, kw, weights, lse_weights, zeroed=False)
    counts = _counts(jnp.float32, q.shape, k.shape, None if kw["bias"] is None else kw["bias"].shape)
    for name, g, w in zip(ARGNAMES, got, want):
        if w is not None:
            assert_within_roundings(g, w, name, terms=counts[name], magnitude=mags[name])


def test_vmap_jit_and_checkpoint(rng):
    """jax.vmap over a leading axis (sinks mapped too) is the loop over it, forward and gradients; a
    jax.checkpoint's gradients are the plain ones."""
    (q, k, v), kw = _case(rng, jnp.float32, sinks=False)
    sinks = jnp.asarray(rng.standard_normal((2, q.shape[2])), jnp.float32)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    fixed = {name: kw[name] for name in ("bias", "mask", "scale", "is_causal", "q_lengths", "kv_lengths", "window")}

    def loss(q, k, v, s):
        out = xla_chunked.dot_product_attention(q, k, v, sinks=s, return_residual=False, block_size=3, **fixed)
        return jnp.sum(out * weights), out

    grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    qs, ks, vs = (jnp.stack([x, rng.standard_normal(x.shape).astype(np.float32)]) for x in (q, k, v))
    mapped_grads, mapped_out = jax.jit(jax.vmap(grad))(qs, ks, vs, sinks)
    one = jax.jit(grad)
    counts = _counts(jnp.float32, q.shape, k.shape)
    for i in range(2):
        grads, out = one(qs[i], ks[i], vs[i], sinks[i])
        mags = _magnitudes(qs[i], ks[i], vs[i], dict(kw, sinks=sinks[i]), weights)
        assert_within_roundings(mapped_out[i], out, f"vmap out {i}", terms=counts["out"], magnitude=mags["out"])
        for name, g, w in zip(("dq", "dk", "dv", "dsinks"), mapped_grads, grads):
            assert_within_roundings(g[i], w, f"vmap {name} {i}", terms=counts[name], magnitude=mags[name])
    plain, _ = one(q, k, v, sinks[0])
    remat, _ = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks[0])
    mags = _magnitudes(q, k, v, dict(kw, sinks=sinks[0]), weights)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), remat, plain):
        assert_within_roundings(g, w, f"checkpoint {name}", terms=counts[name], magnitude=mags[name])


def test_head_dim_zero(rng):
    """Head dim 0: every logit 0 (the bias's alone): out ``(B, T, N, 0)``, the residual 'xla''s (the gradients are
    0, as no output is left to weigh)."""
    (q, k, v), kw = _case(rng, jnp.float32)
    q, k, v = q[..., :0], k[..., :0], v[..., :0]
    kw["scale"] = 1.0
    weights = jnp.zeros(q.shape, jnp.float32)
    got, want = _both(q, k, v, kw, weights, 3)
    assert got[0].shape == q.shape and got[1].shape == q.shape[:3]
    _compare(got, want, _magnitudes(q, k, v, kw, weights), _counts(jnp.float32, q.shape, k.shape, None if
             kw["bias"] is None else kw["bias"].shape), jnp.float32, _description(kw, 3, q, k))


def test_complex_inputs(rng):
    """Complex64 inputs: the logits' real part (the imaginary one dropped, as 'xla' and jax.nn do); out, residual and
    jax's gradients of a real loss of out's real and imaginary parts are 'xla''s."""
    (q, k, v), kw = _case(rng, jnp.float32)
    q, k, v = (x + 1j * jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v))
    weights = jnp.asarray(rng.standard_normal(q.shape) + 1j * rng.standard_normal(q.shape), jnp.complex64)
    got, want = _both(q, k, v, kw, weights, 3)
    assert got[0].dtype == jnp.complex64
    # a complex product sums 2 H real ones: the counts at head dim 2 H
    counts = _counts(jnp.complex64, (*q.shape[:3], 2 * q.shape[3]), k.shape,
                     None if kw["bias"] is None else kw["bias"].shape)
    _compare(got, want, _magnitudes(q, k, v, kw, weights), counts, jnp.complex64, _description(kw, 3, q, k))


def test_precision_reaches_every_product(rng):
    """``precision`` is every float32 product's, forward and backward."""
    (q, k, v), kw = _case(rng, jnp.float32)
    weights = jnp.ones(q.shape, jnp.float32)
    f = _grads(xla_chunked.dot_product_attention, kw, weights, block_size=3, precision=jax.lax.Precision.HIGH)
    text = jax.jit(f).lower(q, k, v, kw["bias"], kw["sinks"]).as_text()
    products = text.count("stablehlo.dot_general")
    assert products >= 6 and text.count("precision = [HIGH, HIGH]") == products


def test_float64_is_the_float64_formula(rng):
    """Float64 inputs under x64: float64 logits and softmax, within float64 roundings of the float64 formulas
    (tests/attention_oracle.py); 'xla''s softmax is float32 there."""
    with jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64():
        (q, k, v), kw = _case(rng, jnp.float64)
        kw["bias"] = None  # the oracle has no bias gradient
        weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float64)
        got = _grads(xla_chunked.dot_product_attention, kw, weights, block_size=3)
        (dq, dk, dv, _, dsinks), (out, res) = jax.jit(got)(q, k, v, None, kw["sinks"])
        assert out.dtype == res.dtype == dq.dtype == jnp.float64
        t, s = q.shape[1], k.shape[1]
        sinks = None if kw["sinks"] is None else np.asarray(kw["sinks"], np.float64)
        args = dict(scale=kw["scale"], visible=_visible(t, s, kw), sinks=sinks)
        rows = np.ones((q.shape[0], t), bool) if kw["q_lengths"] is None else \
            np.arange(t)[None] < np.asarray(kw["q_lengths"])[:, None]
        out64, lse64, _, _ = oracle64.forward(q, k, v, **args)
        want = oracle64.gradients(q, k, v, np.asarray(weights) * rows[:, :, None, None], **args)
        mags = _magnitudes(q, k, v, kw, weights)
        counts = {name: c * unit(np.float64) for name, c in _counts(np.float32, q.shape, k.shape).items()
                  if c is not None}  # all of it float64
        assert_within_roundings(out, out64 * rows[:, :, None, None], "out", terms=counts["out"], magnitude=mags["out"])
        assert_within_roundings(res, lse64.transpose(0, 2, 1), "residual", terms=counts["residual"],
                                magnitude=mags["residual"])
        for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
            assert_within_roundings(g, w, name, terms=counts[name], magnitude=mags[name])
        if sinks is not None:  # float32 sinks: their gradient float32
            assert_within_roundings(dsinks, want[3], "dsinks", terms=_counts(np.float32, q.shape, k.shape)["dsinks"],
                                    magnitude=mags["dsinks"])


# ---- memory ------------------------------------------------------------------------------------------------------

def _compiled_memory(impl, t: int) -> int:
    """Bytes of the temporaries and outputs XLA's buffer assignment gives the forward and the gradients of query,
    key, value and sinks at ``T = S = t``: one sequence, 8 query and 2 key/value heads of 64, float32, causal
    (compiled, not run)."""
    def loss(q, k, v, sinks):
        return jnp.sum(impl(q, k, v, None, None, scale=0.125, is_causal=True, q_lengths=None, kv_lengths=None,
                            window=None, sinks=sinks, return_residual=False))

    shapes = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((1, t, 8, 64), (1, t, 2, 64), (1, t, 2, 64), (8,))]
    stats = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(*shapes).compile().memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes


def test_memory_grows_with_the_block_not_the_keys():
    """At 16k queries and keys the forward and gradients take at most 1 GiB beyond their arguments (a few float32
    ``(1, 8, 16384, 128)`` blocks of 64 MiB, the ``(T, N, H)`` accumulators), where 'xla''s ``T * S`` logits, their
    probabilities and gradients take more than 8 GiB."""
    assert xla_chunked.default_block_size(1, 8, 16384, 16384) == 128
    assert _compiled_memory(xla_chunked.dot_product_attention, 16384) <= 2 ** 30
    assert _compiled_memory(xla.dot_product_attention, 16384) > 8 * 2 ** 30


@pytest.mark.parametrize("shape, block", [
    ((1, 8, 16384, 16384), 128),  # 8 * 16384 * 128 * 4 bytes: 64 MiB
    ((2, 8, 16384, 16384), 64),
    ((1, 1, 64, 4096), 512),  # the largest
    ((4, 64, 65536, 65536), 16),  # the smallest, though over the budget
    ((1, 4, 100, 5), 16),  # S rounded up, to 16 at least
    ((1, 4, 100, 40), 64),
])
def test_default_block_size(shape, block):
    assert xla_chunked.default_block_size(*shape) == block
