"""Context parallelism on CPU (conftest.py gives the process eight host devices): ``dot_product_attention``'s
``context_axis`` inside ``jax.shard_map`` over 2, 4 and 8 devices, both layouts, against one device's call of the
same implementation (``'xla'``, ``'xla_chunked'`` in blocks of a few keys): out, residual and the gradients of
query, key, value and a replicated sink, within bounds from float64 sums of each result's terms
(tests/test_xla_chunked.py's); the zigzag helpers; every refusal; plain ``jax.jit`` with ``NamedSharding`` over
batch, heads and sequence on a 2 x 4 mesh; ``'fa4'``'s algorithm (each rank in turn, and under ``jax.shard_map``)
in FlashAttention's conventions in jax.numpy, against one call (its kernels: tests/test_gpu_attention.py); and
``flax_attention_fn``'s context axis in linen's multi-head attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dqpost import attention, dot_product_attention, unzigzag, zigzag
from jax_dqpost._attention import context
from jax_dqpost.attention.xla_chunked import XlaChunked
from support import assert_within_roundings
from test_xla_chunked import FAST, _counts, _magnitudes, unit

IMPLEMENTATIONS = ("xla", "xla_chunked")
LAYOUTS = ("contiguous", "zigzag")
BLOCK = 24  # 'xla_chunked''s keys a block: several blocks, the last partial, at every length here
NAMES = ("out", "residual", "dq", "dk", "dv", "dsinks")


@pytest.fixture(autouse=True)
def _small_blocks_on_the_cpu(monkeypatch):
    """'xla_chunked' in small blocks; every computation on the CPU's devices (on a GPU machine too: the meshes are
    the CPU's, and the one-device references must compute as they do), 'fa4''s kernels in jax.numpy there."""
    from jax_dqpost._attention import fa4 as kernels
    monkeypatch.setitem(attention.IMPLEMENTATIONS, "xla_chunked", XlaChunked(block_size=BLOCK))
    monkeypatch.setattr(kernels, "on_gpu", lambda: False)
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _mesh(n: int, name: str = "cp") -> Mesh:
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"{n} CPU devices needed, {len(devices)} here (conftest.py asks XLA for 8)")
    return Mesh(np.array(devices[:n]), (name,))


def _orders(layout: str, n: int):
    """``(order, back)``: a sequence (along ``axis``, 1 by default) put in ``layout``'s order over ``n`` devices,
    and back (``zigzag``/``unzigzag``; the identity for ``'contiguous'``)."""
    if layout == "zigzag":
        return (lambda x, axis=1: zigzag(x, n, axis)), (lambda x, axis=1: unzigzag(x, n, axis))
    return (lambda x, axis=1: x), (lambda x, axis=1: x)


def _inputs(rng, dtype, b, t, n, heads_kv, h, sinks):
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, t, heads_kv, h)), dtype) for _ in range(2))
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    return q, k, v, jnp.asarray(sinks, jnp.float32), weights


def _grads(kw):
    """``f(q, k, v, sinks, weights) -> (out, residual, (dq, dk, dv, dsinks))``: ``dot_product_attention(**kw)``,
    the gradients of ``sum(out * weights)``."""
    def loss(q, k, v, sinks, w):
        out, res = dot_product_attention(q, k, v, sinks=sinks, return_residual=True, **kw)
        return jnp.sum(out.astype(jnp.float32) * w), (out, res)

    def f(q, k, v, sinks, w):
        (_, (out, res)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks, w)
        return out, res, grads

    return f


def _sharded_and_whole(mesh, layout, kw, args):
    """``(got, want)``, each ``(out, residual, dq, dk, dv, dsinks)`` in the sequence's own order: the call with
    ``context_axis`` inside ``jax.shard_map`` (the sequence sharded over the mesh's axis, a replicated sink, jax's
    default checks), and the same call on one device; one compile."""
    axis = mesh.axis_names[0]
    n = mesh.shape[axis]
    order, back = _orders(layout, n)
    seq = P(None, axis)
    sharded = jax.shard_map(_grads(dict(kw, context_axis=axis, context_layout=layout)), mesh=mesh,
                            in_specs=(seq, seq, seq, P(), seq), out_specs=(seq, seq, (seq, seq, seq, P())))

    def both(q, k, v, sinks, w):
        out, res, (dq, dk, dv, ds) = sharded(order(q), order(k), order(v), sinks, order(w))
        got = (*(back(x) for x in (out, res, dq, dk, dv)), ds)
        out, res, grads = _grads(kw)(q, k, v, sinks, w)
        return got, (out, res, *grads)

    return jax.jit(both).lower(*args).compile(FAST)(*args)


def _check(got, want, q, k, v, weights, kw, devices, what, names=NAMES):
    """Each result within its roundings of one device's (tests/test_xla_chunked.py's bounds), dK and dV also within
    one rounding of their dtype a device (the reduce-scatter adds every device's partial sums, each rounded)."""
    dtype = q.dtype
    internal = dict(bias=None, mask=None, scale=q.shape[-1] ** -0.5, is_causal=kw.get("is_causal", False),
                    window=kw.get("local_window_size"), q_lengths=kw.get("query_seq_lengths"),
                    kv_lengths=kw.get("key_value_seq_lengths"), sinks=kw.get("sinks"))
    mags = _magnitudes(q, k, v, internal, weights)
    counts = _counts(dtype, q.shape, k.shape)
    for name in ("dk", "dv"):
        counts[name] += devices * unit(dtype)
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        assert_within_roundings(g, w, f"{name} {what}", terms=counts[name], magnitude=mags[name])


# (devices, dtype, batch, global T, heads, kv heads, head dim, keywords, sinks)
CASES = {
    "8dev-gqa8-causal-w127-f32": (8, jnp.float32, 1, 256, 8, 1, 16, dict(is_causal=True, local_window_size=(127, 0)),
                                  [0.5, -np.inf, 1e4, -1.0, 2.0, 8.0, -np.inf, 0.0]),
    "8dev-gqa8-causal-bf16": (8, jnp.bfloat16, 1, 256, 8, 1, 16, dict(is_causal=True),
                              [0.5, -np.inf, 3.0, -1.0, 2.0, 8.0, 1.5, 0.0]),
    "4dev-gqa2-window-bf16": (4, jnp.bfloat16, 2, 128, 4, 2, 32, dict(local_window_size=(5, 3)),
                              [-np.inf, 1.0, 6.0, -2.0]),
    "2dev-causal-w9-lengths-f32": (2, jnp.float32, 2, 64, 2, 1, 16, dict(is_causal=True, local_window_size=(9, 0)),
                                   [0.3, 1e4]),
    "4dev-gqa8-w127-halo-bf16": (4, jnp.bfloat16, 1, 1024, 8, 1, 16, dict(local_window_size=(127, 0)),
                                 [0.5, -np.inf, 3.0, -1.0, 2.0, 8.0, 1.5, 0.0]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_is_one_device(rng, case, impl, layout):
    """Out, residual and the gradients of query, key, value and sinks: one device's within roundings. Grouped heads
    8:1 and 2:1, a causal mask, gpt-oss's window, a window of a few keys that crosses every chunk's edges, lengths,
    sinks of ``-inf`` and large; the sinks' gradient the whole sequence's."""
    devices, dtype, b, t, n, heads_kv, h, kw, sinks = CASES[case]
    q, k, v, sinks, weights = _inputs(rng, dtype, b, t, n, heads_kv, h, sinks)
    kw = dict(kw, implementation=impl)
    if "lengths" in case:
        lengths = jnp.asarray(rng.integers(t // 2, t + 1, b), jnp.int32)  # past the first chunks, of any layout
        kw.update(query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    got, want = _sharded_and_whole(_mesh(devices), layout, kw, (q, k, v, sinks, weights))
    _check(got, want, q, k, v, weights, dict(kw, sinks=sinks), devices, f"{case} {impl} {layout}")
    assert np.asarray(got[5])[np.isfinite(np.asarray(sinks)) & (np.asarray(sinks) < 100)].any()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_without_checks_a_psum_sums_the_sinks_gradient(rng, impl):
    """``check_vma=False``: each device's sinks gradient is its rows'; their ``psum`` is one device's."""
    mesh, n = _mesh(4), 4
    q, k, v, sinks, w = _inputs(rng, jnp.float32, 1, 64, 2, 1, 16, [0.5, -1.0])
    kw = dict(is_causal=True, implementation=impl)
    f = _grads(dict(kw, context_axis="cp", context_layout="zigzag"))

    def local(*a):
        out, res, grads = f(*a)
        return out, res, (*grads[:3], jax.lax.psum(grads[3], "cp"))

    seq = P(None, "cp")
    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, P(), seq),
                                    out_specs=(seq, seq, (seq, seq, seq, P())), check_vma=False))
    out, res, (dq, dk, dv, ds) = sharded(*(zigzag(x, n) for x in (q, k, v)), sinks, zigzag(w, n))
    got = (*(unzigzag(x, n) for x in (out, res, dq, dk, dv)), ds)
    out, res, grads = jax.jit(_grads(kw))(q, k, v, sinks, w)
    _check(got, (out, res, *grads), q, k, v, w, dict(kw, sinks=sinks), n, f"unchecked {impl}")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_shard_map_over_the_batch_without_a_context_axis(rng, impl):
    """Batch-sharded ``jax.shard_map`` with jax's default checks, no context axis: each device's own call, the
    replicated sinks' gradient summed by jax ('xla_chunked''s scan carries and custom_vjp cotangents typed with the
    operands' varying axes)."""
    mesh = _mesh(4, "d")
    q, k, v, sinks, w = _inputs(rng, jnp.float32, 4, 32, 4, 2, 16, [0.5, -1.0, -np.inf, 2.0])
    f = _grads(dict(is_causal=True, implementation=impl))
    rows = P("d")
    got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(rows, rows, rows, P(), rows),
                                out_specs=(rows, rows, (rows, rows, rows, P()))))(q, k, v, sinks, w)
    out, res, grads = jax.jit(f)(q, k, v, sinks, w)
    _check((*got[:2], *got[2]), (out, res, *grads), q, k, v, w, dict(is_causal=True, sinks=sinks), 1,
           f"batch-sharded {impl}")


def test_implementation_none_runs_xla(rng):
    """``implementation=None`` passes over ``'fa4'`` (float32 inputs, or no GPU) and runs ``'xla'``."""
    mesh = _mesh(2)
    q, k, v, sinks, _ = _inputs(rng, jnp.float32, 1, 32, 2, 1, 16, [0.5, -1.0])
    seq = P(None, "cp")

    def run(impl):
        return jax.jit(jax.shard_map(
            lambda q, k, v, s: dot_product_attention(q, k, v, sinks=s, is_causal=True, implementation=impl,
                                                     context_axis="cp"),
            mesh=mesh, in_specs=(seq, seq, seq, P()), out_specs=seq))(q, k, v, sinks)

    np.testing.assert_array_equal(run(None), run("xla"))


# ---- the zigzag helpers -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zigzag_is_a_permutation_that_unzigzag_undoes(rng, n):
    for shape, axis in (((2, 16 * n, 3, 4), 1), ((4 * n, 5), 0), ((3, 2 * n), -1)):
        x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        z = zigzag(x, n, axis=axis)
        assert z.shape == x.shape and z.dtype == x.dtype
        np.testing.assert_array_equal(np.sort(np.asarray(z, np.float32), axis=axis),
                                      np.sort(np.asarray(x, np.float32), axis=axis))
        np.testing.assert_array_equal(np.asarray(unzigzag(z, n, axis=axis)).view(np.uint16),
                                      np.asarray(x).view(np.uint16))
        np.testing.assert_array_equal(np.asarray(zigzag(unzigzag(x, n, axis=axis), n, axis=axis)).view(np.uint16),
                                      np.asarray(x).view(np.uint16))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_puts_chunks_i_and_2n_minus_1_minus_i_on_device_i(n):
    """Sharded evenly over ``n`` devices, ``zigzag``'s result holds chunks ``i`` and ``2n-1-i`` on device ``i``:
    the positions the attention gives each device's rows (``context.positions``), and the gathered keys'."""
    mesh, t = _mesh(n), 8 * n
    c = t // (2 * n)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
    placed = jax.device_put(zigzag(positions, n), NamedSharding(mesh, P(None, "cp")))
    for shard in placed.addressable_shards:
        i = list(mesh.devices.flat).index(shard.device)
        want = np.concatenate([np.arange(i * c, (i + 1) * c), np.arange((2 * n - 1 - i) * c, (2 * n - i) * c)])
        np.testing.assert_array_equal(np.asarray(shard.data), np.broadcast_to(want, (2, 2 * c)))
        np.testing.assert_array_equal(np.asarray(context.positions("zigzag", 2 * c, n, i)), want)
    np.testing.assert_array_equal(context.gathered_positions("zigzag", 2 * c, n), np.asarray(zigzag(positions, n))[0])
    np.testing.assert_array_equal(context.gathered_positions("contiguous", 2 * c, n), np.arange(t))


def test_zigzag_refusals():
    x = jnp.zeros((2, 12, 4))
    with pytest.raises(ValueError, match=r"zigzag .* multiple of 8, got .*\(2, 12, 4\)"):
        zigzag(x, 4)
    with pytest.raises(ValueError, match=r"unzigzag .* multiple of 8"):
        unzigzag(x, 4)
    with pytest.raises(ValueError, match=r"n must be >= 1, got 0"):
        zigzag(x, 0)
    with pytest.raises(TypeError, match=r"n must be a Python int, got 2.0"):
        zigzag(x, 2.0)
    with pytest.raises(ValueError, match=r"axis must name one of the array's 3 dimensions .* got 3"):
        zigzag(x, 1, axis=3)


# ---- refusals: the argument and its value, one line, at trace time ------------------------------------------------

def _traced(mesh, seq_q=32, seq_k=32, **kw):
    """Trace ``dot_product_attention(**kw)`` inside ``jax.shard_map`` over ``mesh``'s axis, q ``(1, seq_q, 2, 16)``
    and k, v ``(1, seq_k, 1, 16)`` on each device."""
    n = mesh.shape["cp"]
    q = jnp.zeros((1, seq_q * n, 2, 16), jnp.float32)
    k = jnp.zeros((1, seq_k * n, 1, 16), jnp.float32)
    seq = P(None, "cp")
    jax.eval_shape(jax.shard_map(lambda q, k, v: dot_product_attention(q, k, v, **kw), mesh=mesh,
                                 in_specs=(seq, seq, seq), out_specs=seq), q, k, k)


def test_refusals():
    mesh = _mesh(2)
    q = jnp.zeros((1, 32, 2, 16), jnp.float32)
    k = jnp.zeros((1, 32, 1, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"context_axis='cp' names no axis of an enclosing jax.shard_map"):
        dot_product_attention(q, k, k, context_axis="cp")
    with pytest.raises(ValueError, match=r"context_axis='seq' names no axis of an enclosing jax.shard_map"):
        _traced(mesh, context_axis="seq")
    with pytest.raises(TypeError, match=r"context_axis must be None or the name \(a str\).*got \('cp',\) \(tuple\)"):
        _traced(mesh, context_axis=("cp",))
    with pytest.raises(ValueError, match=r"context_layout must be one of 'contiguous', 'zigzag', got 'ring' \(str\)"):
        _traced(mesh, context_axis="cp", context_layout="ring")
    with pytest.raises(ValueError, match=r"context_layout must be one of .* got None"):
        dot_product_attention(q, k, k, context_layout=None)
    with pytest.raises(ValueError, match=r"context_layout='zigzag' .* T must be even, got query \(1, 15, 2, 16\) "
                                         r"\(T = 15\)"):
        _traced(mesh, seq_q=15, seq_k=15, context_axis="cp", context_layout="zigzag")
    with pytest.raises(ValueError, match=r"context_axis='cp' takes self-attention's shapes.*got query \(1, 32, 2, "
                                         r"16\) and key \(1, 16, 1, 16\) \(T = 32, S = 16\)"):
        _traced(mesh, seq_k=16, context_axis="cp")
    with pytest.raises(ValueError, match=r"bias is not taken with context_axis='cp'.*shape \(1, 1, 32, 32\)"):
        _traced(mesh, context_axis="cp", bias=jnp.zeros((1, 1, 32, 32)))
    with pytest.raises(ValueError, match=r"mask is not taken with context_axis='cp'"):
        _traced(mesh, context_axis="cp", mask=jnp.ones((32, 32), bool))


def test_cudnn_refuses_a_context_axis():
    with pytest.raises(ValueError, match=r"implementation='cudnn' cannot run this call: context parallelism "
                                         r"\(context_axis='cp'\) is not yet supported on implementation 'cudnn'; "
                                         r"'xla' and 'xla_chunked' run it"):
        _traced(_mesh(2), context_axis="cp", implementation="cudnn")


@pytest.mark.parametrize("kw, why", [
    (dict(local_window_size=(5, 3)), r"it takes a causal mask, a window \(left, 0\) or no mask, not the window \(5, 3\)"),
    (dict(local_window_size=(5, 3), is_causal=False, query_seq_lengths=jnp.full((1,), 9)),
     r"it takes no query_seq_lengths or key_value_seq_lengths"),
], ids=["window-ahead", "lengths"])
def test_fa4_refuses_what_its_context_kernels_cannot_express(kw, why):
    """Before looking at the machine: a window reaching keys after a row's own, lengths."""
    with pytest.raises(ValueError, match=r"implementation='fa4' cannot run this call: with context_axis='cp' " + why):
        _traced(_mesh(2), context_axis="cp", implementation="fa4", **kw)


# ---- 'fa4''s algorithm (FlashAttention's conventions in jax.numpy here; its kernels in test_gpu_attention.py) ------

def emulated_ranks(q, k, v, sinks, weights, *, devices: int, layout: str, window: tuple, halo: bool = False):
    """``n = devices`` ranks of ``'fa4'``'s context parallelism (``jax_dqpost._attention.fa4.context_attention``)
    run in turn on one device: rank ``i`` given its rows of the sequence laid out as ``layout`` says, every rank's
    keys and values in device order (what its all-gather gives it), or with ``halo`` its own and the window's
    ``left`` before each of its runs (what ``context.neighbours``' ppermute gives it), and its index. Returns
    ``(out, residual, dq, dk, dv, dsinks)`` as the ranks together make them, in sequence order: out ``(B, T, N,
    H)``, the float32 lse ``(B, T, N)``, the gradients of ``sum(out * weights)``: dq each rank's rows, dk and dv
    the sum of the gradients of the keys and values each rank was given, scattered back to where they came from
    (what the collective's transpose does), dsinks their sum (None without sinks)."""
    from jax_dqpost._attention import fa4 as kernels
    order, back = _orders(layout, devices)
    qz, wz = order(q), order(weights)
    t = q.shape[1] // devices
    left = window[0] if halo else None
    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)

    def given(index, k, v):
        """Rank ``index``'s keys and values, from the whole sequence's (in sequence order): all of them in device
        order, or its rows and the ``left`` rows before each of its runs (zeros before the sequence)."""
        if left is None:
            return order(k), order(v)
        own = context.positions(layout, t, devices, index)
        starts = own.reshape(-1, t // context.chunks(layout))[:, :1]
        where = starts - left + jnp.arange(left)
        return tuple(context.arrange(
            jnp.take(x, own, axis=1),
            jnp.where((where >= 0)[None, :, :, None, None], jnp.take(x, jnp.maximum(where, 0), axis=1), 0),
            index == 0) for x in (k, v))

    @jax.jit
    def rank(index, q_i, k, v, sinks, w_i):
        def loss(q_i, k, v, sinks):
            k_i, v_i = given(index, k, v)
            out, lse = kernels.context_attention(q_i, k_i, v_i, layout=layout, devices=devices, index=index,
                                                 scale=q.shape[-1] ** -0.5, window=window, sink=sinks,
                                                 return_lse=True, halo=left)
            return jnp.sum(out.astype(jnp.float32) * w_i), (out, lse)

        return jax.value_and_grad(loss, argnums=argnums, has_aux=True)(q_i, k, v, sinks)

    outs, lses, dqs, partials = [], [], [], []
    for i in range(devices):
        rows = slice(i * t, (i + 1) * t)
        (_, (out, lse)), grads = rank(jnp.int32(i), qz[:, rows], k, v, sinks, wz[:, rows])
        outs.append(out)
        lses.append(lse)
        dqs.append(grads[0])
        partials.append([g.astype(jnp.float32) for g in grads[1:]])
    sums = [sum(parts) for parts in zip(*partials)]
    dk, dv = (x.astype(k.dtype) for x in sums[:2])
    out, dq = (back(jnp.concatenate(x, axis=1)) for x in (outs, dqs))
    lse = back(jnp.concatenate(lses, axis=2), axis=2).transpose(0, 2, 1)
    return out, lse, dq, dk, dv, None if sinks is None else sums[2]


def fa4_whole(q, k, v, sinks, weights, *, window: tuple):
    """``emulated_ranks``'s results from one unsharded call of the same kernels (``jax_dqpost._attention.fa4
    .attention``)."""
    from jax_dqpost._attention import fa4 as kernels
    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)

    def loss(q, k, v, sinks):
        out, lse = kernels.attention(q, k, v, scale=q.shape[-1] ** -0.5, window=window, sink=sinks,
                                     return_lse=True)
        return jnp.sum(out.astype(jnp.float32) * weights), (out, lse.transpose(0, 2, 1))

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks)
    return (out, lse, *grads) + ((None,) if sinks is None else ())


FA4_CASES = {  # (devices, dtype, batch, global T, heads, kv heads, head dim, FlashAttention's window, sinks); the
    # "halo" cases give each rank only the keys its window reaches
    "8dev-gqa8-causal-w127": (8, jnp.float32, 1, 512, 8, 1, 16, (127, 0), [0.5, -np.inf, 3.0, -1.0, 2.0, 8.0, 1e4,
                                                                          0.0]),
    "4dev-gqa8-w127-halo": (4, jnp.float32, 1, 1024, 8, 1, 16, (127, 0), [0.5, -np.inf, 3.0, -1.0, 2.0, 8.0, 1e4,
                                                                         0.0]),
    "4dev-gqa2-causal-bf16": (4, jnp.bfloat16, 2, 128, 4, 2, 32, (None, 0), [-np.inf, 1.0, 6.0, -2.0]),
    "2dev-unmasked": (2, jnp.float32, 2, 64, 2, 1, 16, (None, None), [0.3, -1.0]),
    "2dev-causal-w9-no-sinks": (2, jnp.float32, 1, 64, 2, 2, 16, (9, 0), None),
    "2dev-causal-w9-halo-bf16": (2, jnp.bfloat16, 2, 64, 2, 2, 16, (9, 0), None),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(FA4_CASES))
def test_fa4_ranks_are_one_call(rng, case, layout):
    """Each rank's 'fa4' context-parallel computation in turn (its rows, the keys it gathers or receives, its
    index), assembled: one unsharded call of the same attention within roundings, out, residual and every gradient;
    the window of gpt-oss crossing chunks of 64 rows, grouped heads, sinks of ``-inf`` and large."""
    devices, dtype, b, t, n, heads_kv, h, window, sinks = FA4_CASES[case]
    q, k, v, s, w = _inputs(rng, dtype, b, t, n, heads_kv, h, [0.0] * n if sinks is None else sinks)
    s = None if sinks is None else s
    got = emulated_ranks(q, k, v, s, w, devices=devices, layout=layout, window=window, halo="halo" in case)
    want = fa4_whole(q, k, v, s, w, window=window)
    kw = dict(is_causal=window[1] == 0, local_window_size=None if window[0] is None else window, sinks=s)
    names = NAMES if s is not None else NAMES[:5]
    _check(got[:len(names)], want[:len(names)], q, k, v, w, kw, devices, f"{case} {layout}", names)


@pytest.mark.parametrize("window", [(20, 0), (9, 0), (0, 0)], ids=["w20", "w9", "w0"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fa4_algorithm_under_shard_map(rng, layout, window):
    """The same inside ``jax.shard_map`` over 4 devices with jax's default checks: the keys all-gathered, or (where
    the window is within a run: 9 and 0 keys, and 20 contiguous) received from the neighbours
    (``context.neighbours``), the index traced (``axis_index``), the backward's collectives and the replicated
    sink's summed gradient jax's."""
    from jax_dqpost._attention import fa4 as kernels
    mesh, n = _mesh(4), 4
    q, k, v, sinks, w = _inputs(rng, jnp.float32, 2, 128, 4, 1, 16, [0.5, -np.inf, 3.0, -1.0])
    halo = context.halo(True, window, layout, 128 // n)
    assert (halo is None) == (window == (20, 0) and layout == "zigzag")

    def loss(q, k, v, sinks, w):
        if halo is None:
            k, v = context.gather(k, "cp"), context.gather(v, "cp")
        else:
            k, v = (context.neighbours(x, "cp", layout, n, jax.lax.axis_index("cp"), halo) for x in (k, v))
        out, lse = kernels.context_attention(q, k, v, layout=layout, devices=n, index=jax.lax.axis_index("cp"),
                                             scale=0.25, window=window, sink=sinks, return_lse=True, halo=halo)
        return jnp.sum(out * w), (out, lse.transpose(0, 2, 1))

    def f(*args):
        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
        return out, lse, grads

    seq = P(None, "cp")
    order, back = _orders(layout, n)
    out, lse, (dq, dk, dv, ds) = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(seq, seq, seq, P(), seq),
                                                       out_specs=(seq, seq, (seq, seq, seq, P()))))(
        *(order(x) for x in (q, k, v)), sinks, order(w))
    got = (*(back(x) for x in (out, lse, dq, dk, dv)), ds)
    want = fa4_whole(q, k, v, sinks, w, window=window)
    _check(got, want, q, k, v, w, dict(is_causal=True, local_window_size=window, sinks=sinks), n,
           f"shard_map {layout}")


# ---- plain jax.jit with NamedSharding -----------------------------------------------------------------------------

SHARDINGS = {  # (query, key and value, sinks) over the mesh ("a": 2, "b": 4)
    "batch-heads": (P("a", None, "b"), P("a", None, "b"), P("b")),
    "sequence": (P(None, ("a", "b")), P(None, ("a", "b")), P()),
    "batch-sequence": (P("a", "b"), P("a", "b"), P()),
    "sequence-heads": (P(None, "a", "b"), P(None, "a", "b"), P("b")),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_jit_with_named_shardings_is_unsharded(rng, impl, dtype):
    """Under ``jax.jit`` with the operands placed by ``NamedSharding`` over batch, heads, sequence and mixes on a
    2 x 4 mesh: out, residual and the gradients are the unsharded call's within roundings (a sum the partitioner
    splits over the 8 devices rounds each device's part)."""
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("8 CPU devices needed")
    mesh = Mesh(np.array(devices[:8]).reshape(2, 4), ("a", "b"))
    kw = dict(is_causal=True, local_window_size=(20, 0), implementation=impl)
    args = _inputs(rng, dtype, 2, 64, 8, 4, 16, [0.5, -np.inf, 3.0, -1.0, 2.0, 1e4, 1.5, 0.0])
    f = jax.jit(_grads(kw))
    want = f.lower(*args).compile(FAST)(*args)
    want = (*want[:2], *want[2])
    internal = dict(bias=None, mask=None, scale=16 ** -0.5, is_causal=True, window=(20, 0), q_lengths=None,
                    kv_lengths=None, sinks=args[3])
    mags = _magnitudes(*args[:3], internal, args[4])
    counts = {name: c + 8 * unit(dtype) for name, c in _counts(dtype, args[0].shape, args[1].shape).items()
              if c is not None}
    for layout, (q_spec, kv_spec, sink_spec) in SHARDINGS.items():
        specs = (q_spec, kv_spec, kv_spec, sink_spec, q_spec)
        placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        got = f.lower(*placed).compile(FAST)(*placed)
        for name, g, w in zip(NAMES, (*got[:2], *got[2]), want):
            assert_within_roundings(g, w, f"{name} {layout}", terms=counts[name], magnitude=mags[name])


# ---- flax -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_flax_attention_fn_takes_a_context_axis(rng, layout):
    """linen's multi-head attention with ``flax_attention_fn`` given ``context_axis``, applied inside
    ``jax.shard_map`` over 4 devices with the sequence sharded, its parameters replicated: the module's output on
    one device within roundings, and its parameters' gradient too (each device's share summed by jax)."""
    linen = pytest.importorskip("flax.linen")
    import functools
    from jax_dqpost import flax_attention_fn
    mesh, n = _mesh(4), 4
    x = jnp.asarray(rng.standard_normal((2, 64, 32)), jnp.float32)
    fn = functools.partial(flax_attention_fn, is_causal=True, local_window_size=(20, 0), implementation="xla")

    def module(**more):
        return linen.MultiHeadDotProductAttention(num_heads=4, attention_fn=functools.partial(fn, **more))

    params = module().init(jax.random.key(0), x)

    def loss(m, params, x):
        return jnp.sum(m.apply(params, x) ** 2), m.apply(params, x)

    order, back = _orders(layout, n)
    seq = P(None, "cp")
    sharded = jax.shard_map(
        lambda p, x: jax.grad(functools.partial(loss, module(context_axis="cp", context_layout=layout)),
                              has_aux=True)(p, x),
        mesh=mesh, in_specs=(P(), seq), out_specs=(P(), seq))
    d_got, got = jax.jit(sharded)(params, order(x))
    d_want, want = jax.jit(jax.grad(functools.partial(loss, module()), has_aux=True))(params, x)
    np.testing.assert_allclose(back(got), want, rtol=1e-5, atol=1e-5)
    top = max(float(np.abs(w).max()) for w in jax.tree.leaves(d_want))  # the key bias's is 0 but for roundings
    for g, w in zip(jax.tree.leaves(d_got), jax.tree.leaves(d_want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * top)


# ---- a windowed layer receives only the keys its window reaches ----------------------------------------------------

@pytest.mark.parametrize("causal, window, layout, t, want", [
    (True, (127, 0), "zigzag", 256, 127), (False, (127, 0), "contiguous", 128, 127), (True, (8, 8), "zigzag", 16, 8),
    (True, (9, 0), "zigzag", 16, None), (True, None, "contiguous", 64, None), (False, (3, 1), "contiguous", 64, None),
    (False, None, "contiguous", 64, None), (True, (0, 0), "zigzag", 8, 0),
])
def test_halo_is_a_causal_windows_reach_within_a_run(causal, window, layout, t, want):
    assert context.halo(causal, window, layout, t) == want
    assert context.halo(causal, window, layout, t, lengths=True) is None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_key_lengths_under_a_short_window_gather_every_key(rng, impl, layout):
    """Key lengths alone under a window of 2 keys, no sinks: rows whose window holds no key under the length average
    every value of the sequence, as one device's call does (jax.nn's rule), so every key is gathered."""
    n, t = 2, 32
    q, k, v, _, _ = _inputs(rng, jnp.float32, 2, t, 2, 1, 16, [0.0, 0.0])
    kw = dict(is_causal=True, local_window_size=(2, 0), implementation=impl,
              key_value_seq_lengths=jnp.asarray([3, 20], jnp.int32))
    seq = P(None, "cp")
    sharded = jax.jit(jax.shard_map(
        lambda q, k, v: dot_product_attention(q, k, v, context_axis="cp", context_layout=layout, **kw),
        mesh=_mesh(n), in_specs=(seq, seq, seq), out_specs=seq))
    order, back = _orders(layout, n)
    got = back(sharded(*(order(x) for x in (q, k, v))))
    want = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, **kw))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_halo_longer_than_a_run_is_refused():
    with pytest.raises(ValueError, match=r"a halo of 9 keys before each run of 8 rows \('zigzag'\)"):
        context.neighbour_positions("zigzag", 16, 2, 0, 9)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("devices", [1, 4])
def test_a_windowed_layer_sends_only_the_keys_before_each_run(rng, layout, devices):
    """gpt-oss's window over rows of 256 a device: the forward and backward send ``collective-permute``s and no
    ``all-gather`` (the reduce-scatter neither), and equal one device's call within roundings; a window longer than
    a run gathers every key."""
    mesh = _mesh(devices)
    t = 256 * devices
    q, k, v, sinks, w = _inputs(rng, jnp.float32, 1, t, 4, 1, 16, [0.5, -np.inf, 3.0, -1.0])
    for window, halo in (((127, 0), True), ((200, 0), layout == "contiguous")):
        kw = dict(is_causal=True, local_window_size=window, implementation="xla")
        seq = P(None, "cp")
        f = jax.jit(jax.shard_map(_grads(dict(kw, context_axis="cp", context_layout=layout)), mesh=mesh,
                                  in_specs=(seq, seq, seq, P(), seq), out_specs=(seq, seq, (seq, seq, seq, P()))))
        order, back = _orders(layout, devices)
        args = (*(order(x) for x in (q, k, v)), sinks, order(w))
        hlo = f.lower(*args).compile().as_text()
        if devices > 1:
            assert ("all-gather" not in hlo and "reduce-scatter" not in hlo) == halo, (window, layout)
            assert ("collective-permute" in hlo) == halo, (window, layout)
        out, res, grads = f(*args)
        got = (*(back(x) for x in (out, res, *grads[:3])), grads[3])
        want_out, want_res, want_grads = jax.jit(_grads(kw))(q, k, v, sinks, w)
        _check(got, (want_out, want_res, *want_grads), q, k, v, w, dict(kw, sinks=sinks), devices,
               f"{layout} {window} over {devices}")
