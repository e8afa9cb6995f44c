"""``jax_dqpost.dot_product_attention(implementation='fa4')`` on a GPU: FlashAttention-4's kernels and our
postprocess against float64 formulas (tests/attention_oracle.py) and against ``'xla'``, at random shapes, with and
without sinks, by FlashAttention's rule: the kernels' error is at most twice that of the same math in the inputs'
precision (``'xla'``), plus one rounding of the largest magnitude. The translation of jax.nn's masks itself is checked on every
platform (tests/test_attention.py). Context parallelism on the kernels: each rank's computation in turn, and the
public call through ``jax.shard_map`` on this GPU."""

from __future__ import annotations

import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_oracle as oracle64
from conftest import HAS_GPU
from jax_dqpost import dot_product_attention

pytestmark = pytest.mark.skipif(not (HAS_GPU and importlib.util.find_spec("fa4_jax")),
                                reason="needs a CUDA GPU and fa4-jax (Python >= 3.12: pip install '.[fa4-jax]')")


def _shape(rng):
    """Random jax.nn keywords 'fa4' expresses, from few kernel configurations (each compiles once): causal, or
    causal with a window of 64 keys; one lengths array for both (T == S) or none (S >= T, the keys cut); head dims 64
    and 128; 1 or 4 query heads a key/value head."""
    b = int(rng.integers(1, 3))
    heads_kv = int(rng.choice([1, 2]))
    n = heads_kv * int(rng.choice([1, 4]))
    h = int(rng.choice([64, 128]))
    t = int(rng.choice([128, 256]))
    kw = {"is_causal": True}
    if rng.random() < 0.5:
        kw["local_window_size"] = (64, 0)
    if rng.random() < 0.5:
        kw["query_seq_lengths"] = kw["key_value_seq_lengths"] = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32)
        s = t
    else:
        s = t + int(rng.choice([0, 64]))
    return b, t, s, n, heads_kv, h, kw


def _error(got, want, rows):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(np.where(rows, got - want, 0)).max())


def _check(rng, dtype, with_sinks, b, t, s, n, heads_kv, h, kw):
    """'fa4' against float64 formulas within twice 'xla''s error (module docstring): out, dq, dk, dv, dsinks, and
    rows past the lengths 0."""
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, s, heads_kv, h)), dtype) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(n) * 2, jnp.float32) if with_sinks else None
    vis = oracle64.top_left(t, s, causal=kw["is_causal"], window=kw.get("local_window_size"))[None, None]
    rows = np.ones((b, t, 1, 1), bool)
    if "query_seq_lengths" in kw:
        lengths = np.asarray(kw["query_seq_lengths"])
        vis = vis & oracle64.lengths_mask(t, s, lengths, lengths)
        rows = (np.arange(t)[None] < lengths[:, None])[:, :, None, None]
    w = rng.standard_normal((b, t, n, h)) * rows
    args64 = dict(scale=h ** -0.5, visible=vis, sinks=None if sinks is None else np.asarray(sinks))
    out64, _, _, _ = oracle64.forward(q, k, v, **args64)
    grads64 = oracle64.gradients(q, k, v, w, **args64)

    def run(implementation):
        def loss(q, k, v, s=None):
            out = dot_product_attention(q, k, v, **kw, **({} if s is None else {"sinks": s}),
                                        implementation=implementation)
            return jnp.sum(out.astype(jnp.float32) * jnp.asarray(w, jnp.float32)), out
        argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
        return jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, *(() if sinks is None else (sinks,)))

    (g_fa4, out_fa4), (g_xla, out_xla) = run("fa4"), run("xla")
    what = f"B={b} T={t} S={s} N={n} K={heads_kv} H={h} {sorted(kw)} {dtype.__name__}"
    ulp = float(jnp.finfo(dtype).eps)
    failed = []
    for name, got, low, want, live in [("out", out_fa4, out_xla, out64 * rows, rows)] + [
            (g, x, y, z, True) for g, x, y, z in zip(("dq", "dk", "dv", "dsinks"), g_fa4, g_xla, grads64)]:
        scale = float(np.abs(want).max())
        err, base = _error(got, want, live), _error(low, want, live)
        if err > 2 * base + ulp * scale:
            failed.append(f"{name} error {err:.3g}, 'xla''s {base:.3g}")
    assert not failed, f"{what}: {'; '.join(failed)}"
    assert not np.asarray(jnp.where(rows, 0, out_fa4)).any(), f"{what}: rows past the lengths are 0"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_fa4_is_the_float64_formula_within_twice_xlas_error(rng, dtype, with_sinks):
    for _ in range(4):
        _check(rng, dtype, with_sinks, *_shape(rng))


@pytest.mark.parametrize("with_sinks, t, s, n, heads_kv", [
    (True, 128, 192, 4, 1), (True, 128, 128, 4, 1), (False, 128, 192, 4, 1), (True, 128, 192, 8, 2),
    (True, 300, 333, 4, 1),
], ids=["sinks-mqa4-keys-cut", "sinks-mqa4-same-length", "mqa4-keys-cut", "sinks-gqa4-keys-cut",
        "sinks-mqa4-no-tile-divides"])
def test_fa4_grouped_heads_with_the_keys_cut_in_the_same_jit(rng, with_sinks, t, s, n, heads_kv):
    """Causal with fewer queries than keys: 'fa4' reads the first T keys, a slice XLA's dynamic-slice fusion would
    hand to the backward's main kernel as a view; under grouped-query attention that fused call wrote dK and dV
    wrong (fa4jax_internals.accumulators keeps its operands whole). With and without sinks, 1 and 2 key/value
    heads, lengths tiles do not divide, and the same shape with T == S (no slice)."""
    _check(rng, jnp.bfloat16, with_sinks, 1, t, s, n, heads_kv, 64, {"is_causal": True})


def test_on_a_gpu_none_runs_fa4_without_a_warning(rng):
    q = jnp.asarray(rng.standard_normal((1, 256, 8, 64)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, 256, 2, 64)), jnp.bfloat16)
    sinks = jnp.zeros(8, jnp.float32)
    loss = lambda q, s: jnp.sum(dot_product_attention(q, kv, kv, is_causal=True, sinks=s).astype(jnp.float32))  # noqa
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(q, sinks).as_text()
    ours = [str(w.message) for w in caught if "jax_dqpost" in str(w.message)]  # (fa4-jax's own deprecations aside)
    assert not ours, ours
    assert "jax_dqpost" in text and "fa4" in text, "FlashAttention-4's kernels and our postprocess run the call"


def test_an_infinite_sink_takes_the_whole_row_on_fa4(rng):
    """``sinks=+inf`` on the kernels: that head's output 0 and residual ``+inf`` (but rows past a query length,
    ``-inf`` as FlashAttention leaves them), the other heads the finite call's bits, the gradients finite and 0 for
    that sink."""
    q, k, v = (jnp.asarray(rng.standard_normal((2, 128, 4, 64)), jnp.bfloat16) for _ in range(3))
    lengths = jnp.asarray([100, 128], jnp.int32)
    kw = dict(is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation="fa4")
    sinks = jnp.asarray([np.inf, 0.5, -np.inf, 1.0], jnp.float32)
    out, residual = dot_product_attention(q, k, v, sinks=sinks, return_residual=True, **kw)
    finite, finite_res = dot_product_attention(q, k, v, sinks=sinks.at[0].set(0.0), return_residual=True, **kw)
    assert not np.asarray(out[:, :, 0]).any()
    np.testing.assert_array_equal(np.asarray(out[:, :, 1:]), np.asarray(finite[:, :, 1:]))
    res = np.asarray(residual[:, :, 0], np.float32)
    assert np.isposinf(res[0, :100]).all() and np.isneginf(res[0, 100:]).all() and np.isposinf(res[1]).all()
    np.testing.assert_array_equal(np.asarray(residual[:, :, 1:]), np.asarray(finite_res[:, :, 1:]))
    grads = jax.grad(lambda q, s: jnp.sum(dot_product_attention(q, k, v, sinks=s, **kw).astype(jnp.float32) ** 2),
                     argnums=(0, 1))(q, sinks)
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)
    assert grads[1][0] == 0 and not np.asarray(grads[0][:, :, 0]).any()


@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("lengths", [False, True], ids=["dense", "lengths"])
def test_forward_mode_on_fa4_is_within_twice_xlas_error(rng, with_sinks, lengths):
    """jax.jvp on 'fa4' (FlashAttention-4's forward-mode kernel, and the sinks' own terms) for random tangents of
    query, key, value and sinks: the tangent of out against 'xla''s in float32 on the same inputs, within twice the
    error of 'xla' in bf16 plus one bf16 rounding of the largest magnitude (the module docstring's rule)."""
    b, t, n, heads_kv, h = 2, 192, 8, 2, 64
    kw = dict(is_causal=True, local_window_size=(127, 0))
    if lengths:
        kw["query_seq_lengths"] = kw["key_value_seq_lengths"] = jnp.asarray([150, 192], jnp.int32)
    primals = [jnp.asarray(rng.standard_normal((b, t, x, h)), jnp.bfloat16) for x in (n, heads_kv, heads_kv)]
    if with_sinks:
        primals.append(jnp.asarray(rng.standard_normal(n) * 2, jnp.float32))
    tangents = [jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in primals]

    def tangent_of_out(implementation, dtype):
        def f(q, k, v, *s):
            out = dot_product_attention(q, k, v, **kw, **({"sinks": s[0]} if s else {}),
                                        implementation=implementation)
            return out.astype(jnp.float32)
        cast = [x.astype(dtype) if x.ndim == 4 else x for x in primals]
        cast_t = [x.astype(dtype) if x.ndim == 4 else x for x in tangents]
        return np.asarray(jax.jit(lambda p, d: jax.jvp(f, p, d)[1])(cast, cast_t), np.float64)

    got, low = tangent_of_out("fa4", jnp.bfloat16), tangent_of_out("xla", jnp.bfloat16)
    want = tangent_of_out("xla", jnp.float32)
    err, base = np.abs(got - want).max(), np.abs(low - want).max()
    assert err <= 2 * base + float(jnp.finfo(jnp.bfloat16).eps) * np.abs(want).max(), (err, base)


# ---- context parallelism: each rank's computation in turn on this GPU -----------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("window, with_sinks, halo", [
    ((127, 0), True, True), ((127, 0), True, False), ((None, 0), False, False), ((None, None), True, False)],
    ids=["causal-w127-sinks-halo", "causal-w127-sinks", "causal", "unmasked-sinks"])
def test_fa4_context_parallel_ranks_within_twice_xlas_error(rng, layout, window, with_sinks, halo):
    """'fa4''s context parallelism over 4 ranks, each rank's computation run in turn on the kernels (its rows, the
    keys its all-gather gives it or, with ``halo``, the keys before its runs; its index;
    tests/test_context_parallel.py's ``emulated_ranks``) and assembled:
    out, lse and every gradient within twice 'xla''s bf16 error of the float64 formula, as the unsharded 'fa4' call
    is, and of that call. gpt-oss's shape: 8:1 grouped heads, head dim 64, a window of 128 keys crossing the
    ranks' chunks."""
    from test_context_parallel import emulated_ranks, fa4_whole
    devices, b, t, n, heads_kv, h, dtype = 4, 1, 2048, 8, 1, 64, jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, t, heads_kv, h)), dtype) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(n) * 2, jnp.float32) if with_sinks else None
    w = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    got = emulated_ranks(q, k, v, sinks, w, devices=devices, layout=layout, window=window, halo=halo)
    _assert_within_twice_xlas_error(got, fa4_whole(q, k, v, sinks, w, window=window), q, k, v, sinks, w, window,
                                    f"{layout} window {window}")


def _assert_within_twice_xlas_error(got, whole, q, k, v, sinks, w, window, what):
    """``got`` ((out, lse ``(B, T, N)``, dq, dk, dv, dsinks or None), the loss ``sum(out * w)``'s gradients)
    within twice 'xla''s bf16 error of the float64 formula plus one bf16 rounding at the largest magnitude, and as
    near ``whole`` (the same from the unsharded 'fa4' call)."""
    h, t, dtype = q.shape[-1], q.shape[1], q.dtype
    kw = dict(is_causal=window[1] == 0, local_window_size=None if window[0] is None else window)
    vis = oracle64.top_left(t, t, causal=kw["is_causal"], window=kw["local_window_size"])[None, None]
    args64 = dict(scale=h ** -0.5, visible=vis, sinks=None if sinks is None else np.asarray(sinks))
    out64, lse64, _, _ = oracle64.forward(q, k, v, **args64)
    want = (out64, lse64.transpose(0, 2, 1), *oracle64.gradients(q, k, v, np.asarray(w), **args64))

    def loss(q, k, v, s):
        out, lse = dot_product_attention(q, k, v, sinks=s, implementation="xla", return_residual=True, **kw)
        return jnp.sum(out.astype(jnp.float32) * w), (out, lse)

    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks)
    low = (out, lse, *grads)
    failed = []
    for name, g, one, x, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, whole, low, want):
        if r is None:
            continue
        ulp = float(jnp.finfo(dtype).eps) * float(np.abs(r).max())
        base = _error(x, r, True)
        for of, err in (("the formula", _error(g, r, True)), ("the unsharded 'fa4' call", _error(g, one, True))):
            if err > 2 * base + ulp:
                failed.append(f"{name}: {err:.3g} from {of}, 'xla''s error {base:.3g}")
    assert not failed, f"{what}: {'; '.join(failed)}"


@pytest.mark.parametrize("window, with_sinks", [((127, 0), True), ((None, 0), False), ((None, None), True)],
                         ids=["causal-w127-sinks", "causal", "unmasked-sinks"])
def test_fa4_rows_under_jit_sharding_within_twice_xlas_error(rng, window, with_sinks):
    """``jax.jit`` with the sequence sharded over 4 devices: each device's forward and backward of its rows
    (``autodiff._own_rows``, what the kernels' partitioning rule runs with the device's index), run in turn on the
    kernels, their dK, dV and dsinks summed and the rows assembled: within twice 'xla''s bf16 error of the float64
    formula, as the unsharded 'fa4' call is, and of that call. gpt-oss's shape, as the context-parallel ranks."""
    from test_context_parallel import fa4_whole
    from jax_dqpost._attention import autodiff, fa4, fa4jax_internals
    devices, b, t, n, heads_kv, h, dtype = 4, 1, 2048, 8, 1, 64, jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, t, heads_kv, h)), dtype) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(n) * 2, jnp.float32) if with_sinks else None
    w = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    cfg = fa4jax_internals.config(q, window_size=window, scale=h ** -0.5)
    spec = autodiff.AttentionSpec(fa4.KERNELS, cfg, cfg.scale, *fa4._layouts(cfg, q, k, v))
    assert autodiff._own_rows_run(spec, q, k, v, None)
    forward = autodiff._Step("forward", spec, with_sinks, False, own_rows=True)
    backward = autodiff._Step("backward", spec, False, False, with_sinks, own_rows=True)
    c = t // devices
    outs, lses, dqs, dk, dv, dsinks = [], [], [], 0.0, 0.0, 0.0
    for i in range(devices):
        def rank(q_i, w_i, i=i):
            out, lse = autodiff._own_rows(forward, [q_i, k, v, sinks, None], i, devices)
            grads = autodiff._own_rows(backward, [q_i, k, v, out, lse, w_i.astype(dtype), None, sinks, None], i,
                                       devices)
            return out, lse, grads
        out, lse, (dq_i, dk_i, dv_i, ds_i) = jax.jit(rank)(q[:, i * c:(i + 1) * c], w[:, i * c:(i + 1) * c])
        outs.append(out), lses.append(lse), dqs.append(dq_i)
        dk, dv = dk + dk_i.astype(jnp.float32), dv + dv_i.astype(jnp.float32)
        dsinks = dsinks + (0.0 if ds_i is None else ds_i)
    got = (jnp.concatenate(outs, 1), jnp.concatenate(lses, 2).transpose(0, 2, 1), jnp.concatenate(dqs, 1),
           dk.astype(dtype), dv.astype(dtype), dsinks if with_sinks else None)
    _assert_within_twice_xlas_error(got, fa4_whole(q, k, v, sinks, w, window=window), q, k, v, sinks, w, window,
                                    f"jit rows, window {window}")


def test_fa4_context_axis_under_shard_map_on_one_device(rng):
    """``dot_product_attention(implementation='fa4', context_axis=...)`` inside ``jax.shard_map`` over this one GPU
    (its index traced; the packed causal path, the window's keys received from no neighbour): the call without a
    context axis, within twice 'xla''s error and one bf16 rounding at the largest magnitude (zigzag's two runs'
    gradients of their copies of the keys, each rounded, are summed)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    q = jnp.asarray(rng.standard_normal((2, 256, 4, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((2, 256, 2, 64)), jnp.bfloat16) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    kw = dict(is_causal=True, local_window_size=(127, 0), sinks=sinks)

    def grads(impl, **more):
        def loss(q, k, v):
            out = dot_product_attention(q, k, v, implementation=impl, **kw, **more)
            return jnp.sum(out.astype(jnp.float32)), out
        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)

    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    seq = P(None, "cp")
    got = jax.jit(jax.shard_map(grads("fa4", context_axis="cp", context_layout="zigzag"), mesh=mesh,
                                in_specs=(seq, seq, seq), out_specs=((seq, seq, seq), seq)))(q, k, v)
    whole, low = (jax.jit(grads(impl))(q, k, v) for impl in ("fa4", "xla"))
    for name, g, w, x in zip(("dq", "dk", "dv", "out"), jax.tree.leaves(got), jax.tree.leaves(whole),
                             jax.tree.leaves(low)):
        err, base = _error(g, w, True), _error(x, w, True)
        eps = float(jnp.finfo(jnp.bfloat16).eps)
        assert err <= 2 * base + float(np.abs(np.asarray(w, np.float64)).max()) * eps, (name, err, base)
