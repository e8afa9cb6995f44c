"""Attention with a learnable sink whose backward ends in our op (``jax_dqpost._attention.autodiff``), on any
platform: its ``jax.custom_jvp`` wired to a stand-in producer, and the refusals of ``jax_dqpost.fa4jax`` that need no GPU.

The stand-in (:class:`Producer`) does in jax.numpy what FlashAttention-4's kernels do: a forward that puts the sink
in every softmax row, and a backward main kernel that knows nothing of the sink, reads the forward's lse and the
preprocess's ``dpsum`` and writes fp32 accumulators (here row-major). Our custom_vjp must turn that into the
gradients of plain attention with a sink column, which jax.grad of :func:`reference` gives (float32; the outputs are
bf16, so the bound is bf16's); the real kernels are tests/test_fa4jax_sinks.py's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dqpost import AccumLayout, dq_accum_from_dq, fa4jax
from jax_dqpost._attention import autodiff as _attention
from jax_dqpost._attention.fa4jax_internals import Accumulators
from support import assert_within_roundings, cu_seqlens, ulp

HIGHEST = jax.lax.Precision.HIGHEST  # float32 matmuls in float32 on every backend (a GPU's default is TF32)

H, D = 4, 32
LAYOUT = AccumLayout.row_major(tile_m=32, num_threads=128)


# ---- which keys a row sees: FlashAttention's rule, bottom-right aligned on the used lengths

def visible(len_q: int, len_k: int, causal: bool, window) -> np.ndarray:
    """Boolean ``(len_q, len_k)``: key ``j`` is visible to query ``i`` where ``-right <= i + len_k - len_q - j <=
    left`` (``causal``: right = 0); unbounded sides are None."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(len_q)[:, None] + len_k - len_q
    j = np.arange(len_k)[None, :]
    ok = np.ones((len_q, len_k), bool)
    if left is not None:
        ok &= i - j <= left
    if right is not None:
        ok &= j - i <= right
    return ok


def dense_mask(s, s_k, causal, window) -> np.ndarray:
    """``(1, S, Sk)``: the same for every batch."""
    return visible(s, s_k, causal, window)[None]


def packed_mask(cu_q, cu_k, used_q, used_k, causal, window) -> np.ndarray:
    """``(1, T, Tk)``: each sequence's used rows see its used keys."""
    mask = np.zeros((1, cu_q[-1], cu_k[-1]), bool)
    for b in range(len(cu_q) - 1):
        mask[0, cu_q[b]:cu_q[b] + used_q[b], cu_k[b]:cu_k[b] + used_k[b]] = visible(used_q[b], used_k[b], causal,
                                                                                  window)
    return mask


# ---- plain attention with a sink column: the reference

def reference(q, k, v, sink, mask, scale):
    """``(out, lse)`` in float32 of ``softmax([scale * q k^T, sink]) [v, 0]``, dense ``(B, S, H, D)`` inputs,
    ``mask`` ``(B, S, Sk)`` or ``(1, S, Sk)``; rows with no key: out 0, lse the sink."""
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
    s = jnp.einsum("bshd,bthd->bhst", q.astype(jnp.float32), k, precision=HIGHEST) * scale
    s = jnp.where(mask[:, None], s, -jnp.inf)
    column = jnp.broadcast_to(sink.astype(jnp.float32)[None, :, None, None], (*s.shape[:3], 1))
    logits = jnp.concatenate([s, column], axis=-1)
    lse = jax.nn.logsumexp(logits, axis=-1)
    p = jnp.exp(logits[..., :-1] - lse[..., None])
    return jnp.einsum("bhst,bthd->bshd", p, v, precision=HIGHEST), lse


# ---- the stand-in producer

def stored(x, dtype):
    """Float32 ``x`` rounded to ``dtype`` as ``reduce_precision``, which XLA keeps where it may drop a convert pair."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


@dataclasses.dataclass(frozen=True)
class Config:
    """What the stand-in's kernels know statically: the mask (bytes and shape), the scale, and for a packed batch
    its offsets and used lengths (where the real kernels read them on the device)."""

    mask: tuple
    scale: float
    cu_q: tuple = ()
    used_q: tuple = ()

    @staticmethod
    def of(mask, scale, cu_q=(), used_q=()):
        return Config((np.packbits(mask).tobytes(), mask.shape), scale, tuple(map(int, cu_q)),
                      tuple(map(int, used_q)))

    @property
    def array(self):
        data, shape = self.mask
        return np.unpackbits(np.frombuffer(data, np.uint8), count=int(np.prod(shape))).reshape(shape).astype(bool)

    def visible(self, seqlens):
        """The mask, ``(1, S, Sk)`` or ``(1, T, Tk)`` (the kernels' offsets: static here)."""
        return self.array

    def padded_rows(self, total):
        """The natural row and the accumulator row of each used packed row (FlashAttention's allocation: sequence
        ``b`` from ``(cu[b] + b P) // P * P``)."""
        p = LAYOUT.pad_rows
        pairs = [(self.cu_q[b] + r, (self.cu_q[b] + b * p) // p * p + r)
                 for b in range(len(self.used_q)) for r in range(self.used_q[b])]
        return np.array([a for a, _ in pairs], np.int32), np.array([b for _, b in pairs], np.int32)


@dataclasses.dataclass(frozen=True)
class RowsConfig(Config):
    """A packed batch whose sequence ``b`` is ``c`` rows (``cu_q``, ``used_q``) at the end of ``keys`` keys, of
    which it reads the first ``used_k[b]`` (on the device, as the kernels read them) under a causal mask with
    ``left`` keys before each row (None: all), bottom-right aligned: what a device runs for its rows."""

    left: int | None = None
    keys: int = 0

    def visible(self, seqlens):
        used_k = seqlens[3]
        b, c, s = len(self.used_q), self.used_q[0], self.keys
        row, key = jnp.arange(b * c), jnp.arange(b * s)
        end = used_k[row // c][:, None]  # the keys row's sequence reads
        diagonal = (row % c)[:, None] + end - c  # the key at the row's own position
        ok = (row[:, None] // c == key[None] // s) & (key[None] % s < end) & (key[None] % s <= diagonal)
        if self.left is not None:
            ok &= diagonal - key[None] % s <= self.left
        return ok[None]


class Producer:
    """FlashAttention-4's steps in jax.numpy, row-major accumulators (module docstring)."""

    def forward(self, cfg, q, k, v, sink, seqlens):
        packed = seqlens is not None
        q, k, v = ((x[None] if packed else x) for x in (q, k, v))
        out, lse = reference(q, k, v, sink, cfg.visible(seqlens), cfg.scale)
        out = out.astype(q.dtype)
        return (out[0], lse[0]) if packed else (out, lse)

    def tangent(self, cfg, q, k, v, out, lse, dq, dk, dv, seqlens):
        """What a forward-mode kernel computes: the probabilities from the forward's lse, ``t_S = scale (dq k^T + q
        dk^T)``, ``mu = rowsum(P t_S)``, ``t_out = P dv + (P (t_S - mu)) v``, ``t_lse = mu``; it knows no sink."""
        f32 = jnp.float32
        packed = seqlens is not None
        q4, k4, v4, dq4, dk4, dv4 = ((x[None] if packed else x).astype(f32) for x in (q, k, v, dq, dk, dv))
        lse4 = lse[None] if packed else lse
        group = q.shape[-2] // k.shape[-2]
        kk, vv, dkk, dvv = (jnp.repeat(x, group, axis=2) for x in (k4, v4, dk4, dv4))
        s = jnp.einsum("bshd,bthd->bhst", q4, kk, precision=HIGHEST) * cfg.scale
        t_s = (jnp.einsum("bshd,bthd->bhst", dq4, kk, precision=HIGHEST)
               + jnp.einsum("bshd,bthd->bhst", q4, dkk, precision=HIGHEST)) * cfg.scale
        p = jnp.where(cfg.visible(seqlens)[:, None], jnp.exp(s - lse4[..., None]), 0.0)
        mu = jnp.sum(p * t_s, axis=-1)
        t_out = (jnp.einsum("bhst,bthd->bshd", p, dvv, precision=HIGHEST)
                 + jnp.einsum("bhst,bthd->bshd", p * (t_s - mu[..., None]), vv, precision=HIGHEST))
        t_out = t_out.astype(q.dtype)
        return (t_out[0], mu[0]) if packed else (t_out, mu)

    def accumulators(self, cfg, q, k, v, out, lse, d_out, dpsum_delta, seqlens):
        f32 = jnp.float32
        packed = seqlens is not None
        q4, k4, v4, o4, do4 = ((x[None] if packed else x).astype(f32) for x in (q, k, v, out, d_out))
        # each as its storage type holds it: a GPU's XLA may drop a pair of converts to a narrower type and back
        # (excess precision), in one program and not in another, where the kernels read the stored bits
        q4, k4, v4, o4, do4 = (stored(x, y.dtype) for x, y in zip((q4, k4, v4, o4, do4), (q, k, v, out, d_out)))
        lse4 = lse[None] if packed else lse
        rows = jnp.moveaxis(jnp.sum(o4 * do4, axis=-1), 1, 2)  # (B, H, S): the preprocess's, on the rounded out
        if packed:  # in the accumulator's rows
            natural, padded = cfg.padded_rows(q.shape[0])
            total_p = LAYOUT.varlen_accum_shape(len(cfg.used_q), 1, q.shape[0], 32)[1] // 32
            dpsum = jnp.zeros((q.shape[1], total_p), f32).at[:, padded].set(rows[0][:, natural])
        else:
            dpsum = jnp.pad(rows, [(0, 0), (0, 0), (0, LAYOUT.padded_seqlen(q.shape[1]) - q.shape[1])])
        if dpsum_delta is not None:
            dpsum = dpsum - dpsum_delta
        if packed:  # what the main kernel reads back
            d_rows = jnp.zeros_like(rows[0]).at[:, natural].set(dpsum[:, padded])[None]
        else:
            d_rows = dpsum[..., :q.shape[1]]
        group = q.shape[-2] // k.shape[-2]
        kk, vv = jnp.repeat(k4, group, axis=2), jnp.repeat(v4, group, axis=2)
        s = jnp.einsum("bshd,bthd->bhst", q4, kk, precision=HIGHEST) * cfg.scale
        p = jnp.where(cfg.visible(seqlens)[:, None], jnp.exp(s - lse4[..., None]), 0.0)
        ds = p * (jnp.einsum("bshd,bthd->bhst", do4, vv, precision=HIGHEST) - d_rows[..., None])
        dq = jnp.einsum("bhst,bthd->bshd", ds, kk, precision=HIGHEST)  # unscaled (the dQ accumulator)
        dk = jnp.einsum("bhst,bshd->bthd", ds, q4, precision=HIGHEST)
        dv = jnp.einsum("bhst,bshd->bthd", p, do4, precision=HIGHEST)
        dk, dv = (x.reshape(*x.shape[:2], k.shape[-2], group, x.shape[-1]).sum(3) for x in (dk, dv))
        dq, dk, dv = ((x[0] if packed else x) for x in (dq, dk, dv))

        def accum(x, side):
            if packed:
                return dq_accum_from_dq(x, 1.0, layout=LAYOUT, cu_seqlens_q=seqlens[side], seqused_q=seqlens[side + 2])
            return dq_accum_from_dq(x, 1.0, layout=LAYOUT)

        if group == 1:  # the main kernel writes dK (scaled) and dV
            return Accumulators(accum(dq, 0), (dk * cfg.scale).astype(k.dtype), dv.astype(v.dtype), None, None, dpsum)
        return Accumulators(accum(dq, 0), None, None, accum(dk, 1), accum(dv, 1), dpsum)


PRODUCER = Producer()


# ---- cases

def _case(rng, *, packed, heads_kv, causal=False, window=(None, None), dtype=jnp.bfloat16):
    """``(call, (q, k, v, sink), seqlens, (w, u))``: inputs, the stand-in's call, and a loss's weights of out and lse
    (zero on rows no sequence uses, whose lse no kernel defines)."""
    scale = D ** -0.5
    if packed:
        lens_q, lens_k = np.array([7, 0, 23, 12]), np.array([9, 3, 20, 12])
        used_q, used_k = np.array([7, 0, 19, 12]), np.array([9, 3, 20, 5])
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
        mask = packed_mask(cu_q, cu_k, used_q, used_k, causal, window)
        shape_q, shape_k = (int(cu_q[-1]), H), (int(cu_k[-1]), heads_kv)
        seqlens = tuple(jnp.asarray(x, jnp.int32) for x in (cu_q, cu_k, used_q, used_k))
        rows = mask.any(-1)[0] | np.isin(np.arange(cu_q[-1]), Config.of(mask, scale, cu_q, used_q).padded_rows(0)[0])
        live = rows[:, None]  # (T, 1): rows some sequence uses
        cfg = Config.of(mask, scale, cu_q, used_q)
    else:
        batch, s, s_k = 2, 40, 29  # S > Sk: causal rows with no key
        mask = dense_mask(s, s_k, causal, window)
        shape_q, shape_k = (batch, s, H), (batch, s_k, heads_kv)
        seqlens, live, cfg = None, np.ones((batch, s, 1), bool), Config.of(mask, scale)
    q = jnp.asarray(rng.standard_normal((*shape_q, D)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((*shape_k, D)), dtype) for _ in range(2))
    sink = jnp.asarray(rng.standard_normal(H) * 2, jnp.float32)
    w = jnp.asarray(rng.standard_normal((*shape_q, D)) * live[..., None], jnp.float32)
    u = rng.standard_normal(shape_q) * live
    u = jnp.asarray(u.transpose(1, 0) if packed else u.transpose(0, 2, 1), jnp.float32)  # lse's (H, T), (B, H, S)
    call = _attention.AttentionSpec(PRODUCER, cfg, scale, LAYOUT, LAYOUT if heads_kv < H else None)
    return call, (q, k, v, sink), seqlens, (w, u), mask


def _loss(attention, with_lse):
    def loss(q, k, v, sink, w, u):
        out, lse = attention(q, k, v, sink)
        total = jnp.sum(out.astype(jnp.float32) * w)
        return total + jnp.sum(lse * u) if with_lse else total
    return loss


def _ours(call, seqlens):
    return lambda q, k, v, sink: _attention.attention(call, q, k, v, sink, seqlens)


def _theirs(mask, scale, packed):
    def attention(q, k, v, sink):
        if packed:
            out, lse = reference(q[None], k[None], v[None], sink, mask, scale)
            return out[0], lse[0]
        return reference(q, k, v, sink, mask, scale)
    return attention


def _assert_close(got, want, what, rel=2 ** -6):
    """Within a few bf16 roundings of the reference's magnitude (a wrong scale, row or sign is off by far more)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), what
    err = np.max(np.abs(got - want)[finite], initial=0)
    scale = np.max(np.abs(want)[finite], initial=0)
    assert err <= rel * scale + 1e-6, f"{what}: max error {err:.3g} against the reference's {scale:.3g}"


def _assert_same(got, want, what, terms=256):
    """Two programs of the same float32 arithmetic (batched, rematerialised, sharded), which XLA may fuse and sum in
    other orders on another machine: within one rounding of the output's dtype, after float32 sums of up to
    ``terms`` terms reordered."""
    assert_within_roundings(got, want, what, roundings=1, terms=terms)


GRAD_NAMES = ("dq", "dk", "dv", "dsink")
WINDOWS = {"full": (False, (None, None)), "causal": (True, (None, None)), "window": (False, (8, 3))}


@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("masking", list(WINDOWS))
@pytest.mark.parametrize("heads_kv", [H, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_gradients_are_plain_attentions_with_a_sink_column(rng, packed, heads_kv, masking, with_lse):
    causal, window = WINDOWS[masking]
    call, args, seqlens, weights, mask = _case(rng, packed=packed, heads_kv=heads_kv, causal=causal, window=window)
    ours = jax.jit(_ours(call, seqlens))(*args)
    theirs = _theirs(mask, call.scale, packed)(*args)
    for name, g, t in zip(("out", "lse"), ours, theirs):
        _assert_close(g, t, name)
    grads = jax.jit(jax.grad(_loss(_ours(call, seqlens), with_lse), argnums=(0, 1, 2, 3)))(*args, *weights)
    want = jax.grad(_loss(_theirs(mask, call.scale, packed), with_lse), argnums=(0, 1, 2, 3))(*args, *weights)
    for name, g, t, x in zip(GRAD_NAMES, grads, want, args):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        _assert_close(g, t, name)
    assert np.abs(np.asarray(grads[3])).min() > 0  # every head's sink has a gradient


def test_the_lse_cotangent_moves_the_gradients(rng):
    """A loss of the lse alone: the producer's out cotangent is zero, so all of dq, dk and dsink comes through
    dpsum's ``- d_lse`` (dV, which the lse does not depend on, is 0)."""
    call, args, seqlens, (w, u), mask = _case(rng, packed=True, heads_kv=2, causal=True)
    only_lse = lambda attention: lambda *a: jnp.sum(attention(*a)[1] * u)  # noqa: E731
    grads = jax.jit(jax.grad(only_lse(_ours(call, seqlens)), argnums=(0, 1, 2, 3)))(*args)
    want = jax.grad(only_lse(_theirs(mask, call.scale, True)), argnums=(0, 1, 2, 3))(*args)
    for name, g, t in zip(GRAD_NAMES, grads, want):
        _assert_close(g, t, name)
    assert not np.asarray(grads[2]).any() and np.asarray(grads[0]).any()


def test_lse_cotangent_rows_are_dpsums(rng):
    """Each used packed row lands in its sequence's accumulator row (FlashAttention's allocation), every other row
    is 0; dense rows are padded with zeros. Traced offsets add no loop to the program (as the work list's)."""
    lens, used = np.array([5, 0, 17, 16, 1]), np.array([5, 0, 11, 16, 0])
    cu = cu_seqlens(lens)
    d_lse = rng.standard_normal((3, cu[-1])).astype(np.float32)
    seqlens = tuple(jnp.asarray(x, jnp.int32) for x in (cu, cu, used, used))
    rows = jax.jit(lambda g, s: _attention.lse_cotangent_rows(g, LAYOUT, s))
    assert "stablehlo.while" not in rows.lower(d_lse, seqlens).as_text()
    got = np.asarray(rows(d_lse, seqlens))
    natural, padded = Config.of(np.zeros((1, 1, 1), bool), 1.0, cu, used).padded_rows(cu[-1])
    want = np.zeros((3, LAYOUT.varlen_accum_shape(len(lens), 1, int(cu[-1]), 32)[1] // 32), np.float32)
    want[:, padded] = d_lse[:, natural]
    np.testing.assert_array_equal(got, want)
    dense = rng.standard_normal((2, 3, 20)).astype(np.float32)
    got = np.asarray(_attention.lse_cotangent_rows(dense, LAYOUT))
    np.testing.assert_array_equal(got, np.pad(dense, [(0, 0), (0, 0), (0, 12)]))


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_forward_mode_is_plain_attentions(rng, packed):
    """jax.jvp and jax.jacfwd: the producer's forward-mode kernel for q, k, v, plus the sink's own terms, give the
    tangents of plain attention with a sink column, of out and of the lse."""
    call, (q, k, v, sink), seqlens, _, mask = _case(rng, packed=packed, heads_kv=2, causal=True)
    ours, theirs = _ours(call, seqlens), _theirs(mask, call.scale, packed)
    primals = (q, k, v, sink)
    tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in primals)
    got = jax.jit(lambda p, t: jax.jvp(ours, p, t))(primals, tangents)
    want = jax.jvp(theirs, primals, tangents)
    live = np.asarray(mask.any(-1))[0] if packed else None  # rows no sequence uses: no kernel defines their lse
    for what, g, w in zip(("out", "lse", "t_out", "t_lse"), (*got[0], *got[1]), (*want[0], *want[1])):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if live is not None and what in ("lse", "t_lse"):
            g, w = g[:, live], w[:, live]
        _assert_close(g, w, what)
    sink_only = jax.jacfwd(lambda s: ours(q, k, v, s)[1])(sink)
    _assert_close(sink_only, jax.jacfwd(lambda s: theirs(q, k, v, s)[1])(sink), "jacfwd of the lse by the sink")


class CountingProducer(Producer):
    """The stand-in, recording the batch of each forward it traced."""

    def __init__(self):
        self.batches = []

    def forward(self, cfg, q, k, v, sink, seqlens):
        self.batches.append(q.shape[0])
        return super().forward(cfg, q, k, v, sink, seqlens)


@pytest.mark.parametrize("sink_mapped", [False, True], ids=["shared-sink", "mapped-sink"])
def test_vmap_of_grad_gives_each_examples_gradients(rng, sink_mapped):
    """A shared sink folds the mapped axis into the producer's batch (one launch: dsink per example from the
    postprocess's vmap rule); a mapped one runs the producer per example."""
    call, args, seqlens, weights, mask = _case(rng, packed=False, heads_kv=2, causal=True)
    counting = CountingProducer()
    call = dataclasses.replace(call, kernels=counting)
    _, (q2, k2, v2, sink2), _, (w2, u2), _ = _case(rng, packed=False, heads_kv=2, causal=True)
    (q, k, v, sink), (w, u) = args, weights
    stacked = [jnp.stack(pair) for pair in ((q, q2), (k, k2), (v, v2), (w, w2), (u, u2))]
    sinks = jnp.stack([sink, sink2]) if sink_mapped else sink
    grad = jax.grad(_loss(_ours(call, seqlens), True), argnums=(0, 1, 2, 3))
    q_, k_, v_, w_, u_ = stacked
    got = jax.jit(jax.vmap(grad, in_axes=(0, 0, 0, 0 if sink_mapped else None, 0, 0)))(q_, k_, v_, sinks, w_, u_)
    # (custom_vmap also traces one element alone, for its shapes)
    assert set(counting.batches) == ({q.shape[0]} if sink_mapped else {q.shape[0], 2 * q.shape[0]})
    for i in range(2):
        one = jax.jit(grad)(q_[i], k_[i], v_[i], sinks[i] if sink_mapped else sink, w_[i], u_[i])
        for name, g, o in zip(GRAD_NAMES, got, one):
            _assert_same(g[i], o, name)


@pytest.mark.parametrize("axis, check_vma", [("batch", True), ("heads", True), ("batch", False)],
                         ids=["batch", "heads", "batch-unchecked"])
def test_shard_map_sums_the_sinks_gradient_over_the_batch(rng, axis, check_vma):
    """Under ``jax.shard_map`` each device runs the attention on its shard: over the batch, dsink is the sum of
    every device's; over the heads, each device has its heads' sinks. With shard_map's default check the
    attention's outputs and gradients vary over the axes of q, k, v, so jax sums the replicated sink's gradient
    over the batch itself; without it (``check_vma=False``) the caller sums it (a psum)."""
    from jax.sharding import Mesh, PartitionSpec as P

    n = 4
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    call, args, seqlens, weights, mask = _case(rng, packed=False, heads_kv=H)
    q, k, v, sink = args
    w, u = weights
    if axis == "batch":
        q, k, v, w = (jnp.tile(x, (n // 2, 1, 1, 1)) for x in (q, k, v, w))
        u = jnp.tile(u, (n // 2, 1, 1))
        specs = (P("d"), P("d"), P("d"), P(), P("d"), P("d"))
    else:
        q, k, v, w, sink = (jnp.repeat(x, n // 2, axis=-2 if x.ndim > 1 else 0) for x in (q, k, v, w, sink))
        u = jnp.repeat(u, n // 2, axis=1)
        specs = (P(None, None, "d"), P(None, None, "d"), P(None, None, "d"), P("d"), P(None, None, "d"),
                 P(None, "d"))
    local = jax.grad(_loss(_ours(call, seqlens), True), argnums=(0, 1, 2, 3))
    if axis == "batch" and not check_vma:
        def sharded_grad(*a):
            g = local(*a)
            return (*g[:3], jax.lax.psum(g[3], "d"))
    else:
        sharded_grad = local
    got = jax.jit(jax.shard_map(sharded_grad, mesh=mesh, in_specs=specs, out_specs=specs[:4],
                                check_vma=check_vma))(q, k, v, sink, w, u)
    want = jax.jit(jax.grad(_loss(_ours(call, seqlens), True), argnums=(0, 1, 2, 3)))(q, k, v, sink, w, u)
    for name, g, t in zip(GRAD_NAMES, got, want):  # dsink: a float32 sum over the batch's rows too
        _assert_same(g, t, name, terms=256 if name != "dsink" else 256 + q.shape[0] * q.shape[1])


class ShapeProducer(Producer):
    """The stand-in, recording the query's shape at each step it traced."""

    def __init__(self):
        self.shapes = {"forward": set(), "accumulators": set()}

    def forward(self, cfg, q, k, v, sink, seqlens):
        self.shapes["forward"].add(q.shape)
        return super().forward(cfg, q, k, v, sink, seqlens)

    def accumulators(self, cfg, q, k, v, out, lse, d_out, dpsum_delta, seqlens):
        self.shapes["accumulators"].add(q.shape)
        return super().accumulators(cfg, q, k, v, out, lse, d_out, dpsum_delta, seqlens)


def _on_8_cpus(shardy: bool, run):
    """``run(cpus)`` on the CPU's 8 devices, partitioned by Shardy (``shardy``) or GSPMD; skipped with fewer."""
    cpus = jax.devices("cpu")
    if len(cpus) < 8:
        pytest.skip("8 CPU devices needed (conftest.py asks XLA for 8)")
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        run(cpus)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
@pytest.mark.parametrize("sharded", ["batch", "heads", "batch-heads", "heads-gqa-gathered"])
def test_jit_with_sharded_inputs_runs_each_devices_share(rng, sharded, shardy):
    """Under plain ``jax.jit`` with q, k, v sharded over the batch and/or the heads (a 2x4 mesh), each device runs
    the producer's steps on its own share (the shapes the stand-in saw), and out, the lse and the gradients are the
    unsharded call's. Where the key/value heads do not divide over the mesh's axis, the heads are gathered. On the
    CPU's devices (on a GPU machine too)."""
    _on_8_cpus(shardy, lambda cpus: _run_sharded(rng, sharded, cpus))


def _run_sharded(rng, sharded, cpus):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    with jax.default_device(cpus[0]):
        heads_kv = 1 if sharded == "heads-gqa-gathered" else 2
        call, (q, k, v, sink), seqlens, (w, u), mask = _case(rng, packed=False, heads_kv=heads_kv, causal=True)
        q, k, v, w = (jnp.concatenate([x, x[::-1]]) for x in (q, k, v, w))  # batch 4
        u = jnp.concatenate([u, u[::-1]])
        mesh = Mesh(np.array(cpus[:8]).reshape(2, 4), ("data", "model"))
        # (batch's axis, the query heads' axis, the key/value heads' axis, the query's shape on a device)
        batch, heads, kv_heads, local = {
            "batch": ("data", None, None, (2, 40, 4, D)),
            "heads": (None, "data", "data", (4, 40, 2, D)),
            "batch-heads": ("model", "data", "data", (1, 40, 2, D)),
            "heads-gqa-gathered": (None, "data", None, (4, 40, 4, D)),  # 1 key head: the heads are gathered
        }[sharded]
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        args = (put(q, P(batch, None, heads)), put(k, P(batch, None, kv_heads)), put(v, P(batch, None, kv_heads)),
                put(sink, P(heads)), put(w, P(batch, None, heads)), put(u, P(batch, heads)))
        producer = ShapeProducer()
        sharded_call = dataclasses.replace(call, kernels=producer)
        loss = _loss(_ours(sharded_call, seqlens), True)
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)
        want = jax.jit(jax.value_and_grad(_loss(_ours(call, seqlens), True), argnums=(0, 1, 2, 3)))(q, k, v, sink,
                                                                                                      w, u)
        _assert_same(got[0], want[0], "loss", terms=256 + q.size)
        for name, g, t in zip(GRAD_NAMES, got[1], want[1]):
            _assert_same(g, t, name, terms=256 + q.shape[0] * q.shape[1])
        for step, shapes in producer.shapes.items():
            assert local in shapes, (step, local, shapes)


class RowsProducer(ShapeProducer):
    """The stand-in with a ``context``: a device's rows of a self-attention without a mask read every key;
    under a causal mask with ``left`` keys before each row (None: all), a packed batch of each sequence's rows
    reading its keys up to its own last row (:class:`RowsConfig`), as FlashAttention-4's producer does."""

    def __init__(self, causal: bool, left: int | None):
        super().__init__()
        self.causal, self.left = causal, left

    def context(self, spec, q, k, v):
        b, c, s = q.shape[0], q.shape[1], k.shape[1]
        if not self.causal:
            return dataclasses.replace(spec, config=Config.of(np.ones((1, c, s), bool), spec.scale)), False
        config = RowsConfig((), spec.scale, tuple(range(0, b * c + 1, c)), (c,) * b, left=self.left, keys=s)
        return dataclasses.replace(spec, config=config), True


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
@pytest.mark.parametrize("sharded", ["rows", "batch-rows-heads"])
@pytest.mark.parametrize("masking", ["causal", "window", "none"])
def test_jit_with_the_rows_sharded_runs_each_devices_rows(rng, masking, sharded, shardy):
    """Under plain ``jax.jit`` with the sequence of q, k, v sharded over 4 devices (or over 2, the batch and the
    heads over 2 each), each device runs the forward and the backward of its own rows (the shapes the stand-in
    saw), the keys and values gathered and their gradients summed and scattered back (a reduce-scatter): out, the
    lse and the gradients are the unsharded call's, under a causal mask, a window (6, 0), and none; dK and dV within
    one bf16 rounding more a device (each device's share is rounded before they are summed, as the kernels write
    it)."""
    _on_8_cpus(shardy, lambda cpus: _run_rows_sharded(rng, masking, sharded, cpus))


def _run_rows_sharded(rng, masking, sharded, cpus):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    causal, left = {"causal": (True, None), "window": (True, 6), "none": (False, None)}[masking]
    batch, s, heads_kv = 2, 64, 2
    scale = D ** -0.5
    with jax.default_device(cpus[0]):
        q = jnp.asarray(rng.standard_normal((batch, s, H, D)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((batch, s, heads_kv, D)), jnp.bfloat16) for _ in range(2))
        sink = jnp.asarray(rng.standard_normal(H) * 2, jnp.float32)
        w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        u = jnp.asarray(rng.standard_normal((batch, H, s)), jnp.float32)
        config = Config.of(dense_mask(s, s, causal, (left, None)), scale)
        call = _attention.AttentionSpec(PRODUCER, config, scale, LAYOUT, LAYOUT)
        if sharded == "rows":  # over 4 devices, the mesh's other axis unused
            mesh, b_axis, h_axis = Mesh(np.array(cpus[:8]).reshape(2, 4), ("a", "rows")), None, None
        else:  # the batch, the rows and the heads each over 2
            mesh, b_axis, h_axis = Mesh(np.array(cpus[:8]).reshape(2, 2, 2), ("a", "rows", "h")), "a", "h"
        n = mesh.shape["rows"]
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        args = (put(q, P(b_axis, "rows", h_axis)), put(k, P(b_axis, "rows", h_axis)),
                put(v, P(b_axis, "rows", h_axis)), put(sink, P(h_axis)), put(w, P(b_axis, "rows", h_axis)),
                put(u, P(b_axis, h_axis, "rows")))
        producer = RowsProducer(causal, left)
        loss = _loss(_ours(dataclasses.replace(call, kernels=producer), None), True)
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        got = grad(*args)
        want = jax.jit(jax.value_and_grad(_loss(_ours(call, None), True), argnums=(0, 1, 2, 3)))(q, k, v, sink, w, u)
        _assert_same(got[0], want[0], "loss", terms=256 + q.size)
        shares = n * float(ulp(1.0, jnp.bfloat16) / ulp(1.0, np.float32))  # a bf16 rounding of each device's share
        for name, g, t in zip(GRAD_NAMES[:3], got[1], want[1]):
            _assert_same(g, t, name, terms=256 + q.shape[0] * q.shape[1] + (shares if name in ("dk", "dv") else 0))
        assert_within_roundings(got[1][3], want[1][3], "dsink", terms=256 + batch * s,
                                magnitude=_dsink_terms(call, q, k, v, sink, w, u))
        b_local, h_local = (batch // 2, H // 2) if b_axis else (batch, H)
        rows = (b_local * s // n, h_local, D) if causal else (b_local, s // n, h_local, D)
        for step, shapes in producer.shapes.items():  # and the whole call's, traced once before partitioning
            assert shapes - {q.shape} == {rows}, (step, rows, shapes)
        text = grad.lower(*args).compile().as_text()
        assert "reduce-scatter" in text and "all-gather" in text


@pytest.mark.parametrize("sharded", ["batch", "batch-rows"])
def test_a_sharded_bf16_sinks_gradient_is_rounded_once(rng, sharded):
    """Under ``jax.jit`` with the batch (and the rows) sharded over 8 devices and a bf16 sink, dsink is each
    device's share summed in float32 and rounded once: within half a bf16 rounding (and float32 sums reordered) of
    the float32 sink's dsink, as on one device (rounding each share first is off by a rounding of each share)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    cpus = jax.devices("cpu")
    if len(cpus) < 8:
        pytest.skip("8 CPU devices needed (conftest.py asks XLA for 8)")
    batch, s = 8, 64
    with jax.default_device(cpus[0]):
        # examples b and b + 4 equal but for lse cotangents 16 apart, on other devices: each device's share of dsink
        # is larger than their sum, which rounding each share would show
        def pairs(shape, dtype):
            return jnp.concatenate([jnp.asarray(rng.standard_normal(shape), dtype)] * 2)

        q = pairs((batch // 2, s, H, D), jnp.bfloat16)
        k, v = (pairs((batch // 2, s, 2, D), jnp.bfloat16) for _ in range(2))
        sink = jnp.asarray(rng.standard_normal(H) * 2 + 1, jnp.bfloat16)
        w = pairs((batch // 2, s, H, D), jnp.float32)
        u = pairs((batch // 2, H, s), jnp.float32) + 8 * jnp.where(jnp.arange(batch) < batch // 2, 1, -1)[:, None, None]
        scale = D ** -0.5
        call = _attention.AttentionSpec(RowsProducer(True, None), Config.of(dense_mask(s, s, True, (None, None)),
                                                                            scale), scale, LAYOUT, LAYOUT)
        grad = jax.jit(jax.grad(_loss(_ours(call, None), True), argnums=3))
        want = grad(q, k, v, sink.astype(jnp.float32), w, u)
        axes = ("a", "rows") if sharded == "batch-rows" else ("a", None)
        mesh = Mesh(np.array(cpus[:8]).reshape(4, 2) if sharded == "batch-rows" else np.array(cpus[:8])[:, None],
                    ("a", "rows"))
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        got = grad(*(put(x, P(*axes)) for x in (q, k, v)), put(sink, P()), put(w, P(*axes)),
                   put(u, P(axes[0], None, axes[1])))
        assert got.dtype == jnp.bfloat16
        assert_within_roundings(got, want, "dsink", roundings=0.5, terms=256 + batch * s,
                                magnitude=_dsink_terms(call, q, k, v, sink, w, u))


def _dsink_terms(call, q, k, v, sink, w, u):
    """``sum |P_i,sink (D_i - u_i)|`` per head: the absolute values of dsink's terms (``-sum_i P_i,sink (D_i -
    u_i)``, a sum with cancellation) that a reordered float32 sum is bounded by."""
    out, lse = (np.asarray(x, np.float64) for x in jax.jit(_ours(call, None))(q, k, v, sink.astype(jnp.float32)))
    p_sink = np.exp(np.asarray(sink, np.float64)[None, :, None] - lse)
    d_abs = np.sum(np.abs(np.asarray(w, np.float64) * out), axis=-1).transpose(0, 2, 1)
    return np.sum(p_sink * (d_abs + np.abs(np.asarray(u, np.float64))), axis=(0, 2))


def test_remat_and_the_sinks_gradient_alone(rng):
    call, args, seqlens, weights, _ = _case(rng, packed=True, heads_kv=2, causal=True)
    loss = _loss(_ours(call, seqlens), True)
    whole = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args, *weights)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))(*args, *weights)
    alone = jax.jit(jax.grad(loss, argnums=3))(*args, *weights)
    for name, g, r in zip(GRAD_NAMES, whole, remat):
        _assert_same(g, r, name)
    # (another program: XLA may fuse the stand-in's float32 sums otherwise, which a sum with cancellation shows)
    _assert_close(alone, whole[3], "dsink alone", rel=2 ** -8)


# ---- jax_dqpost.fa4jax's refusals: before anything runs (no fa4-jax, no GPU needed)

Q = jnp.zeros((1, 64, 8, 64), jnp.bfloat16)
KV = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)


@pytest.mark.parametrize("sink, error, words", [
    (jnp.zeros(8, jnp.int32), TypeError, "learnable_sink must be a floating-point array of shape (heads,), got "
                                         "dtype int32"),
    ([0.0] * 8, TypeError, "(list)"),
    (jnp.zeros(2, jnp.float32), ValueError, "learnable_sink must have shape (8,), one logit per query head of q "
                                            "(1, 64, 8, 64), got shape (2,)"),
    (jnp.zeros((1, 8), jnp.float32), ValueError, "got shape (1, 8)"),
], ids=["int32", "list", "kv-heads", "2d"])
def test_a_wrong_sink_is_refused_naming_it(sink, error, words):
    with pytest.raises(error) as info:
        fa4jax.flash_attn(Q, KV, KV, learnable_sink=sink)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_a_sink_of_each_kernel_dtype_is_taken_as_it_is(dtype):
    sink = jnp.linspace(-1, 1, 8).astype(dtype)
    got = fa4jax.check_sink(sink, Q, {}, packed=False)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, sink)


def test_a_float64_sink_is_read_as_float32():
    """A float64 sink (numpy's, or jax's under jax_enable_x64) is taken as jax's own ops take it: as float32."""
    sink = np.linspace(-1, 1, 8)
    assert sink.dtype == np.float64
    got = fa4jax.check_sink(sink, Q, {}, packed=False)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, sink.astype(np.float32))


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(mask_mod=object()), ValueError, "mask_mod with learnable_sink is not supported"),
    (dict(seqused_q=np.ones(1)), TypeError, "unexpected keyword argument(s) seqused_q; with learnable_sink it takes "
                                             "causal, window_size, scale, return_lse"),
])
def test_what_a_sink_does_not_take_is_refused(kwargs, error, words):
    with pytest.raises(error) as info:
        fa4jax.flash_attn(Q, KV, KV, learnable_sink=jnp.zeros(8), **kwargs)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("family, takes", [(8, False), (9, True), (10, True), (12, False)])
def test_gpus_whose_forward_takes_no_sink_are_refused(family, takes):
    if takes:
        fa4jax.check_sink_gpu(family)
        return
    with pytest.raises(ValueError, match=rf"compute capability {family}\.x\) takes no learnable sink; the sm90"):
        fa4jax.check_sink_gpu(family)


@pytest.mark.parametrize("values, error", [
    (np.array([0, 50], np.int64), None), (np.array([0, 50], np.int16), None),
    (np.array([0, 2 ** 32 + 5], np.int64), ValueError), (np.array([0, 2 ** 32 - 1], np.uint32), ValueError),
], ids=["int64-fits", "int16", "int64-beyond", "uint32-beyond"])
def test_offsets_the_sink_path_would_narrow_are_refused(values, error):
    """fa4-jax casts offsets to int32; the sink path refuses what that would narrow: values this host sees beyond
    int32, and traced types wider than int32 (int8/int16/uint8/uint16 widen exactly)."""
    from jax_dqpost.fa4jax import _check_offsets_dtype

    if error is None:
        _check_offsets_dtype("cu_seqlens_q", values)
    else:
        with pytest.raises(error, match=r"^cu_seqlens_q holds \d+, beyond int32"):
            _check_offsets_dtype("cu_seqlens_q", values)
    traced = jax.jit(lambda cu: _check_offsets_dtype("cu_seqlens_q", cu) or cu)
    if values.dtype == np.int16:
        traced(jnp.asarray(values))
    elif values.dtype == np.uint32:
        with pytest.raises(TypeError, match=r"^cu_seqlens_q must be int32 .* got traced dtype uint32"):
            traced(jnp.asarray(values))
