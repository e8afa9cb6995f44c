"""flash_attention_postprocess (dQ, dK, dV and dsink in one launch) on every platform present: the tensors against
the independent oracle bit for bit, the fused op against three single calls, the sink gradient against a float64
reference, the presets, and the errors.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HAS_GPU, PLATFORMS
from jax_dqpost import DISABLED_CHECKS, AccumLayout, dq_postprocess, flash_attention_postprocess
from test_dq_postprocess import DTYPES, assert_same_bits
import oracle

# (dQ layout, dK/dV layout, head_dim, head_dim_v): FlashAttention-4's presets on each GPU, and other orders.
PAIRS = {
    "sm90-hd64": (90, 64, 64, False),
    "sm90-hd96": (90, 96, 96, False),
    "sm90-hd128": (90, 128, 128, False),
    "sm90-hd128-causal": (90, 128, 128, True),
    "sm90-hd192-dv128": (90, 192, 128, False),
    "sm90-hd256": (90, 256, 256, False),
    "sm100-hd64": (100, 64, 64, False),
    "sm100-hd128-2cta": (100, 128, 128, False),
    "sm100-hd192-2cta": (100, 192, 192, False),
    "sm120-hd128": (120, 128, 128, False),
}
H, H_KV = 4, 2


def _layouts(name):
    arch, d, dv, causal = PAIRS[name]
    return (AccumLayout.flash_attention(arch, d, causal), AccumLayout.flash_attention(arch, d, causal, tensor="dkv"),
            d, dv)


def _args(layout):
    return (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab)


def _dense(rng, layout, shape, scale, dtype):
    logical = oracle.random_logical(rng, shape)
    acc = oracle.build_accumulator(logical, _args(layout), hdim_multiple_of=layout.hdim_multiple_of, rng=rng,
                                   arch=layout.arch, two_cta=layout.two_cta, cluster=layout.cluster_size)
    return acc, oracle.expected_dq(logical, scale, dtype)


def _varlen(rng, layout, cu, used, total, heads, head_dim, scale, dtype):
    return oracle.build_varlen(rng, cu, used, total, heads, head_dim, _args(layout),
                               hdim_multiple_of=layout.hdim_multiple_of, scale=scale, dtype=dtype, arch=layout.arch,
                               two_cta=layout.two_cta, cluster=layout.cluster_size)


def _lengths(rng, batch, most):
    lens = rng.integers(0, most, size=batch)
    return [0] + np.cumsum(lens).tolist()


def _on(platform, *xs):
    device = jax.devices(platform)[0]
    return [None if x is None else jax.device_put(x, device) for x in xs]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_dense_matches_oracle(rng, platform, dtype, name):
    dq_layout, dkv_layout, d, dv = _layouts(name)
    batch, s_q = 2, int(rng.integers(1, 3 * dq_layout.tile_m))
    s_k = int(rng.integers(1, 3 * dkv_layout.pad_rows))
    scale, k_scale = (float(rng.uniform(0.05, 2.0)) for _ in range(2))
    q_acc, q_want = _dense(rng, dq_layout, (batch, s_q, H, d), scale, dtype)
    k_acc, k_want = _dense(rng, dkv_layout, (batch, s_k, H_KV, d), k_scale, dtype)
    v_acc, v_want = _dense(rng, dkv_layout, (batch, s_k, H_KV, dv), 1.0, dtype)
    fn = jax.jit(lambda q, k, v, s, ks: flash_attention_postprocess(
        q, k, v, s, head_dim=d, head_dim_v=dv, dtype=dtype, dq_layout=dq_layout, dkv_layout=dkv_layout, dk_scale=ks,
        seqlen_q=s_q, seqlen_k=s_k))
    dq, dk, dv_out = fn(*_on(platform, q_acc, k_acc, v_acc, np.float32(scale), np.float32(k_scale)))
    for got, want, what in ((dq, q_want, "dq"), (dk, k_want, "dk"), (dv_out, v_want, "dv")):
        assert_same_bits(got, want, f"{platform} {name} {what} S_q={s_q} S_k={s_k}")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("static", [True, False], ids=["static", "traced"])
@pytest.mark.parametrize("name", ["sm90-hd128", "sm90-hd192-dv128", "sm100-hd128-2cta", "sm120-hd128"])
def test_varlen_with_seqused_matches_oracle(rng, platform, static, name):
    dq_layout, dkv_layout, d, dv = _layouts(name)
    dtype, batch = jnp.bfloat16, 3
    cu_q, cu_k = _lengths(rng, batch, 300), _lengths(rng, batch, 300)
    total_q, total_k = cu_q[-1] + int(rng.integers(0, 9)), cu_k[-1] + int(rng.integers(0, 9))
    used_q = [int(rng.integers(0, cu_q[b + 1] - cu_q[b] + 1)) for b in range(batch)]
    used_k = [int(rng.integers(0, cu_k[b + 1] - cu_k[b] + 1)) for b in range(batch)]
    scale = float(rng.uniform(0.05, 2.0))
    q_acc, q_want = _varlen(rng, dq_layout, cu_q, used_q, total_q, H, d, scale, dtype)
    k_acc, k_want = _varlen(rng, dkv_layout, cu_k, used_k, total_k, H_KV, d, scale, dtype)
    v_acc, v_want = _varlen(rng, dkv_layout, cu_k, used_k, total_k, H_KV, dv, 1.0, dtype)
    offsets = (cu_q, cu_k, used_q, used_k)
    if not static:
        offsets = tuple(jnp.asarray(x, jnp.int32) for x in offsets)

    def f(q, k, v, s):
        return flash_attention_postprocess(q, k, v, s, head_dim=d, head_dim_v=dv, dq_layout=dq_layout,
                                           dkv_layout=dkv_layout, total_q=total_q, total_k=total_k,
                                           cu_seqlens_q=offsets[0], cu_seqlens_k=offsets[1], seqused_q=offsets[2],
                                           seqused_k=offsets[3])

    dq, dk, dv_out = jax.jit(f)(*_on(platform, q_acc, k_acc, v_acc, np.float32(scale)))
    for got, want, what in ((dq, q_want, "dq"), (dk, k_want, "dk"), (dv_out, v_want, "dv")):
        assert_same_bits(got, want, f"{platform} {name} {what}")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_fused_equals_single_calls_and_no_gqa(rng, platform):
    """The fused op's tensors are exactly dq_postprocess's on each accumulator; without dK/dV accumulators it
    is dQ alone."""
    dq_layout, dkv_layout, d, dv = _layouts("sm90-hd96")
    s_q, s_k = 150, 90
    q_acc, _ = _dense(rng, dq_layout, (2, s_q, H, d), 1.0, jnp.float16)
    k_acc, _ = _dense(rng, dkv_layout, (2, s_k, H_KV, d), 1.0, jnp.float16)
    v_acc, _ = _dense(rng, dkv_layout, (2, s_k, H_KV, dv), 1.0, jnp.float16)
    q_acc, k_acc, v_acc = _on(platform, q_acc, k_acc, v_acc)
    kw = dict(head_dim=d, dtype=jnp.float16, dq_layout=dq_layout, seqlen_q=s_q)
    dq, dk, dv_out = flash_attention_postprocess(q_acc, k_acc, v_acc, 0.3, dkv_layout=dkv_layout, seqlen_k=s_k,
                                                 dk_scale=0.7, **kw)
    single = dict(dtype=jnp.float16, head_dim=d)
    assert_same_bits(dq, dq_postprocess(q_acc, 0.3, seqlen_q=s_q, layout=dq_layout, **single))
    assert_same_bits(dk, dq_postprocess(k_acc, 0.7, seqlen_q=s_k, layout=dkv_layout, **single))
    assert_same_bits(dv_out, dq_postprocess(v_acc, 1.0, seqlen_q=s_k, layout=dkv_layout, **single))
    alone = flash_attention_postprocess(q_acc, None, None, 0.3, **kw)
    assert alone[1] is None and alone[2] is None
    assert_same_bits(alone[0], dq)


def _sink_inputs(rng, batch, heads, rows, padded_rows, sink_dtype, *, varlen):
    sink = (rng.standard_normal(heads) * 2).astype(sink_dtype)
    shape = (heads, rows) if varlen else (batch, heads, rows)
    # lse counts the sink's mass too (lse >= sink): p = exp(sink - lse) is in (0, 1], as in attention
    heads_axis = 0 if varlen else 1
    sink_b = np.expand_dims(sink.astype(np.float32), tuple(i for i in range(len(shape)) if i != heads_axis))
    lse = (sink_b + np.abs(rng.standard_normal(shape)) * 3).astype(np.float32)
    lse[rng.random(shape) < 0.05] = -np.inf  # rows that attended to nothing
    dpsum = rng.standard_normal(shape[:-1] + (padded_rows,)).astype(np.float32)
    return sink, lse, dpsum


def _dsink64(sink, lse, dpsum_rows, keep):
    """float64: sum of -exp(sink - lse) * dpsum over the kept rows; (H,) and the sum of |terms| per head."""
    p = np.where(np.isneginf(lse), 1.0, np.exp(sink.astype(np.float64)[:, None] - lse.astype(np.float64)))
    terms = np.where(keep, -p * dpsum_rows.astype(np.float64), 0.0)
    return terms.sum(axis=1), np.abs(terms).sum(axis=1)


def _assert_dsink_close(got, want, scale, sink_dtype):
    got = np.asarray(got).astype(np.float64)
    if np.dtype(sink_dtype) == np.float32:
        tol = 1e-5 * scale
    else:  # the float32 sum, then one rounding to 16 bits
        tol = 1e-5 * scale + np.abs(want) * (2.0**-8 if np.dtype(sink_dtype) == jnp.bfloat16 else 2.0**-11)
    assert (np.abs(got - want) <= tol).all(), (got, want, tol)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("sink_dtype", [np.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("packing", ["dense", "dense-seqused", "varlen"])
def test_dsink_matches_float64(rng, platform, sink_dtype, packing):
    """dsink within 1e-5 of a float64 reference (relative to the sum of the terms' magnitudes: the sum cancels),
    the same bits on every run, and dQ unchanged by the sink."""
    layout, d, batch = AccumLayout.flash_attention(90, 128), 128, 3
    varlen = packing == "varlen"
    if varlen:
        cu = _lengths(rng, batch, 500)
        total = cu[-1] + 5
        used = [int(rng.integers(0, cu[b + 1] - cu[b] + 1)) for b in range(batch)]
        acc, _ = _varlen(rng, layout, cu, used, total, H, d, 1.0, jnp.bfloat16)
        tp = layout.varlen_accum_shape(batch, H, total, d)[1] // layout.padded_head_dim(d)
        sink, lse, dpsum = _sink_inputs(rng, batch, H, total, tp, sink_dtype, varlen=True)
        keep, rows = np.zeros((1, total), bool), np.zeros((H, total), np.float32)
        for b in range(batch):
            start = (cu[b] + b * layout.tile_m) // layout.tile_m * layout.tile_m
            keep[0, cu[b]:cu[b] + used[b]] = True
            rows[:, cu[b]:cu[b] + used[b]] = dpsum[:, start:start + used[b]]
        want, mag = _dsink64(sink, lse, rows, keep)
        kw = dict(total_q=total, cu_seqlens_q=cu, seqused_q=used)
    else:
        seqlen = 700
        acc, _ = _dense(rng, layout, (batch, seqlen, H, d), 1.0, jnp.bfloat16)
        sink, lse, dpsum = _sink_inputs(rng, batch, H, seqlen, layout.padded_seqlen(seqlen), sink_dtype, varlen=False)
        used = [int(rng.integers(0, seqlen + 1)) for _ in range(batch)] if packing == "dense-seqused" else [seqlen] * 3
        keep = np.concatenate([np.arange(seqlen) < u for u in used])[None, :]
        lse_rows = np.moveaxis(lse, 1, 0).reshape(H, -1)
        dpsum_rows = np.moveaxis(dpsum[:, :, :seqlen], 1, 0).reshape(H, -1)
        want, mag = _dsink64(sink, lse_rows, dpsum_rows, keep)
        kw = dict(seqlen_q=seqlen, seqused_q=used if packing == "dense-seqused" else None)
    args = _on(platform, acc, sink, lse, dpsum)
    fn = jax.jit(lambda a, s, l, p: dq_postprocess(a, 0.5, head_dim=d, layout=layout, learnable_sink=s, lse=l,
                                                   dpsum=p, **kw))
    dq, dsink = fn(*args)
    assert dsink.dtype == np.dtype(sink_dtype) and dsink.shape == (H,)
    _assert_dsink_close(dsink, want, mag, sink_dtype)
    again = fn(*args)[1]
    assert np.array_equal(np.asarray(again).view(np.uint8), np.asarray(dsink).view(np.uint8)), "not deterministic"
    assert_same_bits(dq, dq_postprocess(args[0], 0.5, head_dim=d, layout=layout, **kw))


def test_presets_match_flash_attention_4():
    """FlashAttention-4 b36's dK/dV configurations (interface.py: _tile_size_bwd_sm90 and the postprocess calls);
    the sm90 entries were also observed in its backward on the H200 (test_fa4_producer.py)."""
    fa = AccumLayout.flash_attention
    sm90 = {64: (128, 256, 2, False, 32), 96: (128, 256, 2, False, 32), 128: (128, 256, 2, False, 32),
            192: (96, 256, 2, True, 64), 256: (48, 256, 1, True, 64)}
    for d, want in sm90.items():
        for causal in (False, True):
            assert fa(90, d, causal, tensor="dkv") == AccumLayout(90, *want)
    for d in (64, 96):
        assert fa(100, d, tensor="dkv") == AccumLayout(100, 128, 128, 1, False, 32)
    for d in (128, 192):
        assert fa(100, d, tensor="dkv") == AccumLayout(100, 128, 128, 1, False, 32, cluster_size=2)
        assert fa(110, d, tensor="dkv").cluster_size == 2
        assert fa(100, d).cluster_size == 1 and fa(100, d).two_cta
    assert fa(120, 256, tensor="dkv") == AccumLayout(80, 64, 128, 4, False, 32)
    with pytest.raises(ValueError, match="dedicated hd256 kernel"):
        fa(100, 256, tensor="dkv")
    with pytest.raises(ValueError, match="tensor must be 'dq' or 'dkv', got 'dk'"):
        fa(90, 128, tensor="dk")
    with pytest.raises(ValueError, match="no dK/dV postprocess configuration for arch=80"):
        fa(80, 128, tensor="dkv")


def test_cluster_size_pads_rows_in_clusters():
    layout = AccumLayout(100, 128, 128, cluster_size=2)
    assert layout.pad_rows == 256 and layout.padded_seqlen(300) == 512 and layout.num_tiles(300) == 3
    assert layout.varlen_accum_shape(2, 1, 100, 64) == (1, 768 * 64)  # round_up(100 + 2*256, 256)
    assert "cluster_size=2" in repr(layout) and "cluster_size" not in repr(AccumLayout())
    for bad, err in ((0, ValueError), (16, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(err, match="AccumLayout.cluster_size"):
            AccumLayout(cluster_size=bad)


def test_errors_name_the_argument():
    dq_layout, dkv_layout, d, _ = _layouts("sm90-hd128")
    q = jnp.zeros(dq_layout.accum_shape(1, 4, 80, d), jnp.float32)
    k = jnp.zeros(dkv_layout.accum_shape(1, 2, 60, d), jnp.float32)
    base = dict(head_dim=d, dq_layout=dq_layout, dkv_layout=dkv_layout, seqlen_q=80, seqlen_k=60)
    cases = [
        (dict(dk_accum=None), ValueError, "dk_accum and dv_accum must be given together"),
        (dict(dkv_layout=None), ValueError, "dkv_layout is required"),
        (dict(dkv_layout="sm90"), TypeError, "dkv_layout must be an AccumLayout, got 'sm90'"),
        (dict(seqlen_k=None), ValueError, "seqlen_k is required"),
        (dict(cu_seqlens_k=[0, 10], seqlen_k=None, total_k=5), ValueError, r"cu_seqlens_k\[-1\]=10 exceeds total_k=5"),
        (dict(dk_accum=k.astype(jnp.bfloat16)), TypeError, "dk_accum must be float32, got bfloat16"),
        (dict(dk_scale="1"), TypeError, r"dk_scale must be a Python float .* got '1' \(str\)"),
        (dict(dv_accum=k[:, :1]), ValueError, "dk_accum and dv_accum disagree on batch, rows or heads"),
        (dict(learnable_sink=jnp.zeros(4)), ValueError, "missing lse, dpsum"),
        (dict(learnable_sink=jnp.zeros(4, jnp.int32), lse=jnp.zeros((1, 4, 80)), dpsum=jnp.zeros((1, 4, 80))),
         TypeError, "learnable_sink must be a float32, bfloat16 or float16 array, got dtype int32"),
        (dict(learnable_sink=jnp.zeros(4), lse=jnp.zeros((1, 4, 79)), dpsum=jnp.zeros((1, 4, 128))),
         ValueError, r"lse must have shape \(1, 4, 80\)"),
        (dict(head_dim_v=100), ValueError, "head_dim_v must be a positive multiple of 8"),
    ]
    for change, err, match in cases:
        kw = dict(base, dk_accum=k, dv_accum=k)
        kw.update(change)
        dk_acc, dv_acc = kw.pop("dk_accum"), kw.pop("dv_accum")
        with pytest.raises(err, match=match):
            flash_attention_postprocess(q, dk_acc, dv_acc, 0.1, **kw)
    k3 = jnp.zeros(dkv_layout.accum_shape(1, 3, 60, d), jnp.float32)
    with pytest.raises(ValueError, match=r"key/value heads \(3\) must divide the query heads \(4\)"):
        flash_attention_postprocess(q, k3, k3, 0.1, **base)
    with pytest.raises(ValueError, match="dkv_layout, seqlen_k only apply with dk_accum"):
        flash_attention_postprocess(q, None, None, 0.1, **base)
    with pytest.raises(ValueError, match="head_dim_v, dk_scale only apply with dk_accum"):
        flash_attention_postprocess(q, None, None, 0.1, head_dim=d, dq_layout=dq_layout, seqlen_q=80, head_dim_v=64,
                                    dk_scale=1.0)


def test_kv_errors_name_the_arguments_passed():
    """dK/dV shape and offset errors name dk_accum/dv_accum, the k side's arguments and head_dim_v, never dQ's."""
    dq_layout, dkv_layout, d, _ = _layouts("sm90-hd128")
    k = jnp.zeros(dkv_layout.accum_shape(1, 2, 60, d), jnp.float32)
    v64 = jnp.zeros(dkv_layout.accum_shape(1, 2, 60, 64), jnp.float32)
    k_packed = jnp.zeros(dkv_layout.varlen_accum_shape(2, 2, 100, d), jnp.float32)
    v_packed = jnp.zeros(dkv_layout.varlen_accum_shape(2, 2, 100, 64), jnp.float32)
    dense = dict(seqlen_k=60)
    packed = dict(total_k=100, cu_seqlens_k=[0, 40, 100])
    cases = [
        ((k, k), dict(dense, seqlen_k=200), r"dk_accum.shape\[2\] must be Sr\*Dr = 256\*128 = 32768 for seqlen_k=200, "
         r"head_dim=128"),
        ((k, k), dict(dense, head_dim_v=64), r"dv_accum.shape\[2\] must be Sr\*Dr = 128\*64 = 8192 for seqlen_k=60, "
         r"head_dim_v=64"),
        ((k, v64), dict(dense, head_dim_v=96), r"dv_accum.shape\[2\] .* head_dim_v=96 and"),
        ((k[0], k), dense, r"dk_accum must have shape \(batch, heads, Sr\*Dr\), got shape \(2, 16384\)"),
        ((k, k), dict(dense, seqused_k=jnp.zeros(3, jnp.int32)),
         r"seqused_k must have shape \(1,\) \(dk_accum has batch 1\), got \(3,\)"),
        ((k, k), dict(dense, seqused_k=[61]), r"seqused_k\[0\]=61 must be in \[0, seqlen_k=60\]"),
        ((k_packed, k_packed), dict(packed, total_k=300),
         r"dk_accum must have shape \(heads, Tp\*Dr\) = \(heads, 640\*128\) for total_k=300, batch=2, head_dim=128"),
        ((k_packed, v_packed), dict(packed, head_dim_v=96),
         r"dv_accum must have shape \(heads, Tp\*Dr\) = \(heads, 384\*96\) for total_k=100, batch=2, head_dim_v=96"),
        ((k_packed, k_packed), dict(packed, cu_seqlens_k=jnp.asarray([0, 40, 100, 100])),
         r"dk_accum must have shape \(heads, Tp\*Dr\) = \(heads, 512\*128\) for total_k=100, batch=3"),
        ((k_packed, k_packed), dict(packed, seqused_k=[41, 0]),
         r"seqused_k\[0\]=41 must be in \[0, 40\] .* in cu_seqlens_k"),
    ]
    for (dk_acc, dv_acc), kw, match in cases:
        batch = len(kw["cu_seqlens_k"]) - 1 if "cu_seqlens_k" in kw else 1  # dQ's, matching the k side's
        q = jnp.zeros(dq_layout.accum_shape(batch, 4, 80, d), jnp.float32)
        with pytest.raises(ValueError, match=match) as err:
            flash_attention_postprocess(q, dk_acc, dv_acc, 0.1, head_dim=d, dq_layout=dq_layout, dkv_layout=dkv_layout,
                                        seqlen_q=80, **kw)
        message = str(err.value)
        assert not re.search(r"dq_accum|seqlen_q|total_q|cu_seqlens_q|seqused_q", message), message
        if "dv_accum" in message:
            assert "head_dim=" not in message, message
    # The head dim dV's layout cannot hold is head_dim_v.
    dq_layout, dkv_layout = AccumLayout.flash_attention(90, 256), AccumLayout.flash_attention(90, 256, tensor="dkv")
    q = jnp.zeros(dq_layout.accum_shape(1, 4, 80, 256), jnp.float32)
    k = jnp.zeros(dkv_layout.accum_shape(1, 2, 60, 256), jnp.float32)
    with pytest.raises(ValueError, match=r"^head_dim_v=64 \(padded to 64\) with AccumLayout\(arch=90, tile_m=48"):
        flash_attention_postprocess(q, k, k, 0.1, head_dim=256, head_dim_v=64, dq_layout=dq_layout,
                                    dkv_layout=dkv_layout, seqlen_q=80, seqlen_k=60)


def test_concrete_k_offsets_outside_jit_are_validated_like_static_values(rng):
    """The k side's offsets and lengths as jax arrays outside jit: checked as static ones, naming the k side's
    arguments; traced, the same values are clamped (no error)."""
    dq_layout, dkv_layout, d, _ = _layouts("sm90-hd128")
    s_q, s_k = 80, 100
    q = jnp.asarray(rng.standard_normal(dq_layout.accum_shape(2, 4, s_q, d)), jnp.float32)
    k_dense = jnp.asarray(rng.standard_normal(dkv_layout.accum_shape(2, 2, s_k, d)), jnp.float32)
    k_packed = jnp.asarray(rng.standard_normal(dkv_layout.varlen_accum_shape(2, 2, s_k, d)), jnp.float32)
    kw = dict(head_dim=d, dq_layout=dq_layout, dkv_layout=dkv_layout, seqlen_q=s_q)
    packed = lambda cu, used=None: flash_attention_postprocess(q, k_packed, k_packed, 0.5, total_k=s_k, cu_seqlens_k=cu,
                                                               seqused_k=used, **kw)
    dense = lambda used: flash_attention_postprocess(q, k_dense, k_dense, 0.5, seqlen_k=s_k, seqused_k=used, **kw)
    cases = [
        (packed, [0, 100, 50], r"cu_seqlens_k must be non-decreasing, got cu_seqlens_k\[1\]=100 > "
                               r"cu_seqlens_k\[2\]=50"),
        (packed, [0, 50, 101], r"cu_seqlens_k\[-1\]=101 exceeds total_k=100"),
        (lambda u: packed([0, 50, 100], u), [51, 3], r"seqused_k\[0\]=51 must be in \[0, 50\] .* in cu_seqlens_k"),
        (dense, [200, 50], r"seqused_k\[0\]=200 must be in \[0, seqlen_k=100\]"),
    ]
    for call, values, match in cases:
        with pytest.raises(ValueError, match=match):
            call(values)
        with pytest.raises(ValueError, match=match):
            call(jnp.asarray(values, jnp.int32))
        jax.jit(call)(jnp.asarray(values, jnp.int32))


def test_q_and_k_sides_must_have_the_same_batch(rng):
    """Every pairing of dense and packed sides: the batch of a dense accumulator, the sequences of a packed side
    (static or traced offsets); a mismatch names both. Matching batches pass, also under vmap (which folds a dense
    batch but not a packed side's sequences)."""
    dq_layout, dkv_layout, d, _ = _layouts("sm90-hd128")
    kw = dict(head_dim=d, dq_layout=dq_layout, dkv_layout=dkv_layout)

    def side(layout, heads, batch, packed, k):
        """(accumulator, keyword arguments) of a side with ``batch`` sequences of random lengths."""
        if not packed:
            acc = rng.standard_normal(layout.accum_shape(batch, heads, 50, d)).astype(np.float32)
            return acc, {f"seqlen_{k}": 50}
        cu = _lengths(rng, batch, 60)
        acc = rng.standard_normal(layout.varlen_accum_shape(batch, heads, cu[-1], d)).astype(np.float32)
        return acc, {f"total_{k}": cu[-1], f"cu_seqlens_{k}": cu}

    what = {(False, "q"): "dq_accum has batch {}", (True, "q"): "cu_seqlens_q has {} sequences",
            (False, "k"): "dk_accum has batch {}", (True, "k"): "cu_seqlens_k has {} sequences"}
    for q_packed in (False, True):
        for k_packed in (False, True):
            q_batch, k_batch = (int(b) for b in rng.choice(np.arange(1, 5), 2, replace=False))
            q, q_kw = side(dq_layout, H, q_batch, q_packed, "q")
            k, k_kw = side(dkv_layout, H_KV, k_batch, k_packed, "k")
            match = re.escape("the q and k sides must have the same batch: " + what[q_packed, "q"].format(q_batch)
                              + " but " + what[k_packed, "k"].format(k_batch))
            with pytest.raises(ValueError, match=match):
                flash_attention_postprocess(q, k, k, 0.5, **kw, **q_kw, **k_kw)
            traced = {n: v for n, v in {**q_kw, **k_kw}.items() if n.startswith("cu_")}
            if traced:  # the same error for traced offsets (their shape gives the number of sequences)
                static = {n: v for n, v in {**q_kw, **k_kw}.items() if n not in traced}
                f = jax.jit(lambda q, k, offsets: flash_attention_postprocess(q, k, k, 0.5, **kw, **static, **offsets))
                with pytest.raises(ValueError, match=match):
                    f(q, k, {n: jnp.asarray(v, jnp.int32) for n, v in traced.items()})
            # The same batch on both sides: accepted, and under vmap over the accumulators too.
            k, k_kw = side(dkv_layout, H_KV, q_batch, k_packed, "k")
            g = lambda q, k: flash_attention_postprocess(q, k, k, 0.5, **kw, **q_kw, **k_kw)
            one = g(q, k)
            mapped = jax.vmap(g)(np.stack([q, q]), np.stack([k, k]))
            for a, b in zip(one, mapped, strict=True):
                assert_same_bits(b[0], a, f"vmap q_packed={q_packed} k_packed={k_packed}")


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_dsink_deterministic_on_gpu_across_compiles(rng):
    """The GPU's reduction order does not depend on the launch: the same bits with dQ alone and with dK/dV."""
    dq_layout, dkv_layout, d, _ = _layouts("sm90-hd64")
    q_acc, _ = _dense(rng, dq_layout, (2, 300, H, d), 1.0, jnp.bfloat16)
    k_acc, _ = _dense(rng, dkv_layout, (2, 200, H_KV, d), 1.0, jnp.bfloat16)
    sink, lse, dpsum = _sink_inputs(rng, 2, H, 300, dq_layout.padded_seqlen(300), np.float32, varlen=False)
    sk = dict(learnable_sink=sink, lse=lse, dpsum=dpsum)
    _, alone = dq_postprocess(q_acc, 0.5, head_dim=d, layout=dq_layout, seqlen_q=300, **sk)
    fused = flash_attention_postprocess(q_acc, k_acc, k_acc, 0.5, head_dim=d, dq_layout=dq_layout,
                                        dkv_layout=dkv_layout, seqlen_q=300, seqlen_k=200, **sk)[3]
    assert np.array_equal(np.asarray(alone).view(np.uint32), np.asarray(fused).view(np.uint32))


@pytest.mark.parametrize("packing", ["dense", "varlen"])
def test_export_for_cuda_emits_one_fused_custom_call(packing):
    """Lowered for CUDA (also without a GPU): one custom call carrying one module (dQ, dK, dV and dsink), with the
    buffers in abi.py's order (their sizes checked by the handler) and the extents of each part; and it
    serialises."""
    from jax_dqpost import _ffi

    dq_layout, dkv_layout, d, dv = _layouts("sm90-hd192-dv128")
    batch, s_q, s_k = 2, 300, 200
    sk = dict(learnable_sink=jax.ShapeDtypeStruct((H,), jnp.float32))
    if packing == "dense":
        kw = dict(seqlen_q=s_q, seqlen_k=s_k)
        shapes = (dq_layout.accum_shape(batch, H, s_q, d), dkv_layout.accum_shape(batch, H_KV, s_k, d),
                  dkv_layout.accum_shape(batch, H_KV, s_k, dv))
        rows = ((batch, H, s_q), (batch, H, dq_layout.padded_seqlen(s_q)))
    else:
        cu_q, cu_k = jnp.asarray([0, 100, 300], jnp.int32), jnp.asarray([0, 50, 200], jnp.int32)
        kw = dict(total_q=s_q, total_k=s_k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        shapes = (dq_layout.varlen_accum_shape(batch, H, s_q, d), dkv_layout.varlen_accum_shape(batch, H_KV, s_k, d),
                  dkv_layout.varlen_accum_shape(batch, H_KV, s_k, dv))
        tp = shapes[0][1] // dq_layout.padded_head_dim(d)
        rows = ((H, s_q), (H, tp))

    def f(q, k, v, sink, lse, dpsum):
        return flash_attention_postprocess(q, k, v, 0.1, head_dim=d, head_dim_v=dv, dq_layout=dq_layout,
                                           dkv_layout=dkv_layout, learnable_sink=sink, lse=lse, dpsum=dpsum, **kw)

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes] + [sk["learnable_sink"]] + [
        jax.ShapeDtypeStruct(r, jnp.float32) for r in rows]
    exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(*args)
    text = exp.mlir_module()
    assert text.count("@jax_dqpost") == 1 and text.count(f"@{_ffi.TARGET_NAME}") == 1, "expected one launch"
    outs = [(batch, s_q, H, d) if packing == "dense" else (s_q, H, d),
            (batch, s_k, H_KV, d) if packing == "dense" else (s_k, H_KV, d),
            (batch, s_k, H_KV, dv) if packing == "dense" else (s_k, H_KV, dv)]
    aux = (0, 0)  # dense: no seqused; varlen: the work lists of traced offsets (varlen.WorkList, its bound of tiles)
    if packing == "varlen":
        from jax_dqpost.varlen import WorkList, sections

        aux = tuple(sections(batch + 2)[1] + WorkList.max_tiles(total, batch, layout)
                    for total, layout in ((s_q, dq_layout), (s_k, dkv_layout)))
    sizes = [4 * int(np.prod(x)) for x in shapes]
    sizes += [4 * a for a in aux] + [4 * 3, 4 * H] + [4 * int(np.prod(r)) for r in rows]
    sizes += [2 * int(np.prod(o)) for o in outs] + [4 * H]
    assert "bytes = dense<[" + ", ".join(map(str, sizes)) + "]>" in text, "buffers in abi.py's order"
    assert [o.shape for o in exp.out_avals] == [(batch, s_q, H, d) if packing == "dense" else (s_q, H, d),
                                                (batch, s_k, H_KV, d) if packing == "dense" else (s_k, H_KV, d),
                                                (batch, s_k, H_KV, dv) if packing == "dense" else (s_k, H_KV, dv),
                                                (H,)]
    assert jax.export.deserialize(exp.serialize()).out_avals == exp.out_avals
