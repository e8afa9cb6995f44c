"""fa4-jax (FlashAttention-4's kernels called from JAX) as the producer, jax-dqpost as its postprocess.

The GPU tests need fa4-jax 0.1.0 (Python >= 3.12) and a CUDA GPU. They take the accumulators fa4-jax's own
backward writes and check that our one launch gives the bits of fa4-jax's own postprocess launches on them, for
every head dim, masking, packing and grouping fa4-jax runs on this GPU; then that ``jax.grad``, ``vmap`` and
``shard_map`` through the attention give fa4-jax's gradients. fa4-jax's backward adds fp32 partial sums with
atomics in no fixed order, so two backward runs agree bit for bit only where every accumulator element receives
at most two terms (``a + b == b + a``): the end-to-end tests use such shapes, the postprocess tests any shape.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HAS_GPU
from jax_dqpost import AccumLayout, fa4jax
from jax_dqpost._attention import autodiff, fa4 as _fa4, fa4jax_internals as _fa4jax_internals
import attention_oracle
import oracle
from support import assert_close_to_scale, bits, cu_seqlens

HAS_FA4JAX = importlib.util.find_spec("fa4_jax") is not None
needs_fa4jax_gpu = pytest.mark.skipif(not (HAS_GPU and HAS_FA4JAX),
                                      reason="needs a CUDA GPU and fa4-jax (Python >= 3.12: pip install '.[fa4-jax]')")
HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def _fresh_registration():
    _fa4jax_internals.modules.cache_clear()
    fa4jax.register.cache_clear()


# ---- without fa4-jax on a GPU: one line (runs everywhere)

def test_without_fa4jax_a_call_on_a_gpu_says_how_to_install(monkeypatch):
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    monkeypatch.setitem(sys.modules, "fa4_jax", None)  # as if not installed, also where it is
    monkeypatch.setattr(fa4jax, "on_gpu", lambda: True)
    _fresh_registration()
    try:
        with pytest.raises(ImportError) as info:
            fa4jax.flash_attn(q, q, q, causal=True)
    finally:
        monkeypatch.undo()
        _fresh_registration()
    message = str(info.value)
    assert "\n" not in message and "pip install fa4-jax==0.1.0" in message, message


@pytest.mark.skipif(not HAS_FA4JAX, reason="fa4-jax is not installed")
def test_another_fa4jax_version_is_refused(monkeypatch):
    import fa4_jax

    monkeypatch.setattr(fa4_jax, "__version__", "0.2.0")
    _fresh_registration()
    try:
        with pytest.raises(ImportError, match=r"fa4-jax 0\.1\.0's internals, found fa4-jax 0\.2\.0"):
            fa4jax.register()
    finally:
        monkeypatch.undo()
        _fresh_registration()


def test_backend_is_set_by_the_module():
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="backend='cute'"):
        fa4jax.flash_attn(q, q, q, backend="cute")


# ---- without a GPU: FlashAttention's attention in jax.numpy (runs everywhere, no fa4-jax needed)

def _packed_visible(cu_q, cu_k, used_q, used_k, causal, window):
    """``(1, 1, T, Tk)`` of the keys each packed query sees (its sequence's used keys, bottom-right aligned on the
    used lengths), and ``(T,)`` the rows some sequence uses."""
    vis = np.zeros((1, 1, cu_q[-1], cu_k[-1]), bool)
    rows = np.zeros(cu_q[-1], bool)
    for b in range(len(cu_q) - 1):
        vis[0, 0, cu_q[b]:cu_q[b] + used_q[b], cu_k[b]:cu_k[b] + used_k[b]] = attention_oracle.bottom_right(
            int(used_q[b]), int(used_k[b]), causal=causal, window=window)
        rows[cu_q[b]:cu_q[b] + used_q[b]] = True
    return vis, rows


@pytest.mark.parametrize("sink", [False, True], ids=["", "sink"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_without_a_gpu_calls_run_flashattentions_attention_in_jax_numpy(rng, monkeypatch, packed, sink):
    """``flash_attn`` and ``flash_attn_varlen`` where JAX has no GPU: out, lse and the gradients of q, k, v and the
    sink against float64 formulas with FlashAttention's conventions (bottom-right masks on the used lengths; a row
    that sees no key gives 0 and lse the sink or -inf; rows no sequence uses give 0 and -inf)."""
    monkeypatch.setattr(fa4jax, "on_gpu", lambda: False)  # also on a GPU machine
    n, heads_kv, d = 4, 2, 16
    for causal, window in ((False, None), (True, None), (False, (3, 1)), (True, (2, None))):
        if packed:
            cu_q, used_q, cu_k, used_k = _varlen_offsets(rng, 3, 9)
            used_q[1] = 0
            q = jnp.asarray(rng.standard_normal((cu_q[-1], n, d)), jnp.bfloat16)
            k, v = (jnp.asarray(rng.standard_normal((cu_k[-1], heads_kv, d)), jnp.bfloat16) for _ in range(2))
            vis, rows = _packed_visible(cu_q, cu_k, used_q, used_k, causal, window)
            args = (q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))
            kw = dict(seqused_q=jnp.asarray(used_q), seqused_k=jnp.asarray(used_k))
            call = fa4jax.flash_attn_varlen
            q64, k64, v64 = (x[None] for x in (q, k, v))
        else:
            s, s_k = (int(x) for x in rng.integers(3, 12, 2))
            q = jnp.asarray(rng.standard_normal((2, s, n, d)), jnp.bfloat16)
            k, v = (jnp.asarray(rng.standard_normal((2, s_k, heads_kv, d)), jnp.bfloat16) for _ in range(2))
            vis = attention_oracle.bottom_right(s, s_k, causal=causal, window=window)[None, None]
            rows, args, kw, call = np.ones(s, bool), (q, k, v), {}, fa4jax.flash_attn
            q64, k64, v64 = q, k, v
        sinks = jnp.asarray(rng.standard_normal(n) * 2, jnp.float32) if sink else None
        kw = dict(kw, causal=causal, window_size=window, learnable_sink=sinks)
        oracle_kw = dict(scale=d ** -0.5, visible=vis, sinks=None if sinks is None else np.asarray(sinks),
                         empty="zero")
        out64, lse64, _, _ = attention_oracle.forward(q64, k64, v64, **oracle_kw)
        out, lse = call(*args, return_lse=True, **kw)
        live = rows[:, None, None] if packed else rows[None, :, None, None]
        want_out = out64[0] * live if packed else out64
        want_lse = np.where(rows[None], lse64[0], -np.inf) if packed else lse64
        assert_close_to_scale(out, want_out, 2 ** -6, f"out causal={causal} window={window}")
        assert_close_to_scale(lse, want_lse, 2 ** -16, f"lse causal={causal} window={window}")
        w = rng.standard_normal(out.shape) * live
        argnums = (0, 1, 2) + ((3,) if sink else ())

        def loss(q, k, v, s=None):
            return jnp.sum(call(q, k, v, *args[3:], **dict(kw, learnable_sink=s)).astype(jnp.float32) * w)

        grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, *([sinks] if sink else []))
        d_out = w[None] if packed else w
        want = attention_oracle.gradients(q64, k64, v64, d_out, **oracle_kw)
        for name, g, t in zip(("dq", "dk", "dv", "dsink"), grads, want):
            assert_close_to_scale(g, t[0] if packed and name != "dsink" else t, 2 ** -5,
                                  f"{name} causal={causal} window={window}")


@pytest.mark.skipif(HAS_FA4JAX, reason="fa4-jax is installed")
def test_without_a_gpu_a_mask_mod_needs_fa4jax():
    q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(ImportError, match="pip install fa4-jax==0.1.0"):
        fa4jax.flash_attn(q, q, q, mask_mod=object())


def test_accum_layout_of_each_kernel_family():
    assert fa4jax.accum_layout((90, 80, 256, 1, True)) == AccumLayout(90, 80, 256, 1, True, 32)
    assert fa4jax.accum_layout((120, 64, 128, 4, False)) == AccumLayout(80, 64, 128, 4, False, 32)
    assert fa4jax.accum_layout((100, 128, 128, 1, False)) == AccumLayout(100, 128, 128, 1, False, 32, two_cta=False,
                                                                         cluster_size=1)
    with pytest.raises(ValueError, match="no accumulator order for arch 70"):
        fa4jax.accum_layout((70, 64, 128, 1, False))


# ---- the GPU: the accumulators of fa4-jax's backward, finished both ways

def _inputs(rng, dtype, q_shape, k_shape, v_shape):
    """q, k, v and an output-shaped array (the cotangent, or a loss's weights)."""
    out_shape = q_shape[:-1] + v_shape[-1:]
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in (q_shape, k_shape, v_shape, out_shape)]


def _varlen_offsets(rng, batch, most):
    """Packed q and k sides: ``(cu_q, used_q, cu_k, used_k)``, each sequence's keys (used or not) at least as many
    as its queries, so that every used query row sees a key also when causal (bottom-right aligned)."""
    lengths_q = rng.integers(1, most, size=batch)
    used_q = np.minimum(lengths_q, rng.integers(1, most, size=batch))
    used_k = used_q + rng.integers(0, most // 4, size=batch)
    lengths_k = np.maximum(lengths_q, used_k) + rng.integers(0, most // 4, size=batch)
    return cu_seqlens(lengths_q), used_q.astype(np.int32), cu_seqlens(lengths_k), used_k.astype(np.int32)


def _rows(cu, used, total):
    """Boolean (total,): the packed rows some sequence uses."""
    mask = np.zeros(total, bool)
    for start, _, n in oracle.sequence_rows(cu, used, total, 1):
        mask[start:start + n] = True
    return mask


@functools.partial(jax.jit, static_argnames=("causal", "packed"))
def _finish_both_ways(q, k, v, d_out, seqlens, *, causal, packed):
    """fa4-jax's forward (the reference, in jnp) and backward accumulators, finished by fa4-jax's own postprocess
    launches and by ours: ``(theirs, ours, dq_accum)``."""
    import fa4_jax

    if packed:
        out, lse = fa4_jax.reference_attn_varlen(q, k, v, seqlens[0], seqlens[1], seqused_q=seqlens[2],
                                                 seqused_k=seqlens[3], causal=causal, return_lse=True)
    else:
        out, lse = fa4_jax.reference_attn(q, k, v, causal=causal, return_lse=True)
    cfg = _fa4jax_internals.config(q, causal=causal, varlen=packed)
    acc = _fa4jax_internals.accumulators(cfg, q, k, v, out.astype(q.dtype), lse, d_out, (), seqlens)
    dq_layout, dkv_layout = _fa4._layouts(cfg, q, k, v)
    ours = autodiff.finish(acc, q, k, v, seqlens, scale=cfg.scale, dq_layout=dq_layout, dkv_layout=dkv_layout)
    return _fa4jax_postprocess(cfg, q, k, v, acc, seqlens), ours[:3], acc.dq_accum


def _fa4jax_postprocess(cfg, q, k, v, acc, seqlens):
    """fa4-jax's own postprocess of ``acc``: one launch per accumulator, as its ``CuteBackend.vjp`` makes them
    (without ``defined_padding``'s zero-filled outputs): ``(dq, dk, dv)``. fa4-jax 0.1.0's private names, as
    jax_dqpost._attention.fa4jax_internals lists them."""
    _, _, K, cutejax = _fa4jax_internals.modules()
    cfg = _fa4jax_internals.as_cute(cfg)
    dtype, hd, hdv, ratio, arch = K._validate(cfg, "bwd", q, k, v)
    static = K._get_static(cfg, dtype, hd, hdv, ratio, arch, "bwd")
    packed = seqlens is not None
    spec = K._QKV3_SPEC if packed else K._QKV_SPEC

    def launch(name, key, scale, accum, like, side):
        args = (accum, *(seqlens[side::2] if packed else ()))
        name += "_varlen" if packed else ""
        return cutejax.call(getattr(K, "_" + name), jax.ShapeDtypeStruct(like.shape, like.dtype),
                            K._aux_static(key, static[key], scale), *args,
                            in_specs=[K._F32_SPEC] + [None] * (len(args) - 1), out_specs=spec, name=name)

    dq = launch("fa4_bwd_post", "post", static["scale"], acc.dq_accum, q, 0)
    if acc.dk_accum is None:
        return dq, acc.dk, acc.dv
    dk = launch("fa4_bwd_post_dk", "post_k", static["scale"], acc.dk_accum, k, 1)
    dv = launch("fa4_bwd_post_dv", "post_v", None, acc.dv_accum, v, 1)
    return dq, dk, dv


@needs_fa4jax_gpu
@pytest.mark.parametrize("packing", ["dense", "varlen"])
@pytest.mark.parametrize("heads_kv", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, head_dim, head_dim_v", [("bf16", d, d) for d in HEAD_DIMS] + [
    ("bf16", 80, 80),  # a head dim fa4-jax pads (to 96)
    ("bf16", 128, 64),  # head dims that differ: on sm90 grouped-query attention takes the mma.sync kernel
    ("fp16", 64, 64), ("fp16", 128, 128)])
def test_postprocess_bit_identical_to_fa4jax(rng, dtype, head_dim, head_dim_v, causal, heads_kv, packing):
    """bf16 on every head dim, fp16 on two (each configuration compiles fa4-jax's backward)."""
    dtype = DTYPES[dtype]
    batch, heads = 2, 8
    if packing == "dense":
        s_q, s_k = 1000, 777  # not multiples of any tile
        q, k, v, d_out = _inputs(rng, dtype, (batch, s_q, heads, head_dim), (batch, s_k, heads_kv, head_dim),
                                 (batch, s_k, heads_kv, head_dim_v))
        seqlens, q_rows, k_rows = None, slice(None), slice(None)
        written_rows = batch * s_q
    else:
        cu_q, used_q, cu_k, used_k = _varlen_offsets(rng, 3, 700)
        q, k, v, d_out = _inputs(rng, dtype, (int(cu_q[-1]), heads, head_dim), (int(cu_k[-1]), heads_kv, head_dim),
                                 (int(cu_k[-1]), heads_kv, head_dim_v))
        written_rows = int(used_q.sum())
        seqlens = tuple(jnp.asarray(a) for a in (cu_q, cu_k, used_q, used_k))
        q_rows, k_rows = _rows(cu_q, used_q, q.shape[0]), _rows(cu_k, used_k, k.shape[0])
    theirs, ours, dq_accum = _finish_both_ways(q, k, v, d_out, seqlens, causal=causal, packed=seqlens is not None)
    # a real backward ran: most of the accumulator's rows that sequences use hold nonzero values
    assert np.count_nonzero(np.asarray(dq_accum)) > written_rows * heads * head_dim // 2
    gqa = heads_kv < heads
    for name, want, got, rows in zip(("dq", "dk", "dv"), theirs, ours, (q_rows, k_rows, k_rows)):
        # Without grouped-query attention dk, dv are the main kernel's, passed through on both sides.
        np.testing.assert_array_equal(bits(got)[rows], bits(want)[rows], err_msg=name)
        if seqlens is not None and (gqa or name == "dq"):  # rows no sequence uses: 0 here, unspecified in fa4-jax
            assert not np.asarray(got)[~rows].any(), name
        used = bits(got)[rows]
        assert np.count_nonzero(used) > used.size // 2, name  # a real gradient (causal: the early rows are 0)


# ---- end to end: jax.grad, vmap and shard_map through the attention

def _e2e_inputs(rng, heads_kv, head_dim=64, batch=2, seqlen=64):
    """Sequences of 64 rows: one q tile and one kv tile per head on every configuration, so each accumulator
    element sums at most two terms (dK/dV: two q heads per kv head) and two backward runs agree bit for bit."""
    q, k, v, w = _inputs(rng, jnp.bfloat16, (batch, seqlen, 4, head_dim), (batch, seqlen, heads_kv, head_dim),
                         (batch, seqlen, heads_kv, head_dim))
    return q, k, v, w


def _grads(attention, causal):
    def loss(q, k, v, w):
        return jnp.sum(attention(q, k, v, causal=causal).astype(jnp.float32) * w.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _fa4_own(q, k, v, **kwargs):
    import fa4_jax
    return fa4_jax.flash_attn(q, k, v, backend="cute", **kwargs)


def _assert_same(got, want):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=name)
        assert np.count_nonzero(bits(g)) > g.size // 2, name


@needs_fa4jax_gpu
@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_grad_equals_fa4jax(rng, head_dim, causal, heads_kv):
    q, k, v, w = _e2e_inputs(rng, heads_kv, head_dim)
    _assert_same(_grads(fa4jax.flash_attn, causal)(q, k, v, w), _grads(_fa4_own, causal)(q, k, v, w))


@needs_fa4jax_gpu
@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
def test_vmap_of_grad_equals_fa4jax(rng, heads_kv):
    q, k, v, w = (jnp.stack([x, y]) for x, y in zip(_e2e_inputs(rng, heads_kv), _e2e_inputs(rng, heads_kv)))
    ours = jax.vmap(_grads(fa4jax.flash_attn, True))(q, k, v, w)
    _assert_same(ours, jax.vmap(_grads(_fa4_own, True))(q, k, v, w))
    one = _grads(fa4jax.flash_attn, True)(q[1], k[1], v[1], w[1])  # the fold into the batch keeps each example
    _assert_same([g[1] for g in ours], one)


@needs_fa4jax_gpu
@pytest.mark.parametrize("axis", ["batch", "heads"])
def test_shard_map_over_devices_equals_fa4jax(rng, axis):
    from jax.sharding import Mesh, PartitionSpec as P

    devices = jax.devices()
    n = len(devices)
    q, k, v, w = _e2e_inputs(rng, 2, batch=2 * n if axis == "batch" else 2)
    if axis == "heads":  # 4 q heads and 2 kv heads per device
        q, w = (jnp.tile(x, (1, 1, n, 1)) for x in (q, w))
        k, v = (jnp.tile(x, (1, 1, n, 1)) for x in (k, v))
    spec = P("d") if axis == "batch" else P(None, None, "d")
    mesh = Mesh(np.array(devices), ("d",))
    # fa4-jax's primitives give no varying-manual-axes types to their cotangents: shard_map without that check.
    sharded = jax.jit(jax.shard_map(_grads(fa4jax.flash_attn, True), mesh=mesh, in_specs=spec, out_specs=spec,
                                    check_vma=False))
    got = sharded(q, k, v, w)
    assert len(got[0].sharding.device_set) == n
    _assert_same(got, _grads(_fa4_own, True)(q, k, v, w))


@needs_fa4jax_gpu
@pytest.mark.parametrize("defined_padding", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
def test_varlen_grad_equals_fa4jax(rng, heads_kv, defined_padding):
    """Packed sequences of at most 64 rows (at most two terms per accumulator element), some rows unused: the
    gradients of ``flash_attn_varlen`` equal fa4-jax's on every row it defines (all rows with ``defined_padding``:
    zeros past the used lengths), and ours are 0 on dq's unused rows either way."""
    import fa4_jax

    lengths = np.array([64, 17, 50], np.int32)
    used = np.array([64, 9, 31], np.int32)
    cu = jnp.asarray(cu_seqlens(lengths))
    total = int(lengths.sum())
    q, k, v, w = _inputs(rng, jnp.bfloat16, (total, 4, 64), (total, heads_kv, 64), (total, heads_kv, 64))
    kw = dict(seqused_q=jnp.asarray(used), seqused_k=jnp.asarray(used), causal=True, defined_padding=defined_padding)

    def grads(attention):
        def loss(q, k, v):
            return jnp.sum(attention(q, k, v, cu, cu, **kw).astype(jnp.float32) * w.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    ours = grads(fa4jax.flash_attn_varlen)
    theirs = grads(lambda *a, **k: fa4_jax.flash_attn_varlen(*a, backend="cute", **k))
    rows = _rows(np.asarray(cu), used, total)
    for name, got, want in zip(("dq", "dk", "dv"), ours, theirs):
        where = slice(None) if defined_padding else rows
        np.testing.assert_array_equal(bits(got)[where], bits(want)[where], err_msg=name)
        assert np.count_nonzero(bits(got)[rows]) > bits(got)[rows].size // 2, name
    assert not np.asarray(ours[0])[~rows].any()


def test_an_order_our_kernel_does_not_take_is_refused_naming_the_head_dims():
    """On sm90 fa4-jax writes dK/dV of grouped-query attention at head dims 136..160 with 96-row tiles over two
    warpgroups, swapped: the MMA's M mode is the head dim padded to 160, not a whole number of 64-row WGMMA atoms."""
    with pytest.raises(ValueError, match=r"fa4-jax's dK accumulator for head_dim=160, head_dim_v=160") as info:
        _fa4.layouts((90, 64, 256, 1, False), (90, 96, 256, 2, True), 160, 160)
    assert "backend='cute'" in str(info.value) and "\n" not in str(info.value)
    dq_layout, dkv_layout = _fa4.layouts((90, 64, 256, 1, False), None, 160, 160)  # dK, dV the main kernel's
    assert dq_layout == AccumLayout(90, 64, 256, 1, False, 32) and dkv_layout is None
