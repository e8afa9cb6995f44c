"""flash_attention_postprocess under jax's transformations: vmap (folded into one launch), autodiff (linear in the
accumulators; dsink in learnable_sink, lse and dpsum), sharding over batch and heads (key/value heads with their
query heads; a batch-sharded dsink adds one reduction), on every platform present."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import HAS_GPU, PLATFORMS
from jax_dqpost import AccumLayout, dq_accum_from_dq, flash_attention_postprocess
from test_dq_postprocess import assert_same_bits
import oracle

D, H, H_KV = 64, 4, 2
QL, KL = AccumLayout.flash_attention(90, D), AccumLayout.flash_attention(90, D, tensor="dkv")
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _acc(rng, layout, shape):
    logical = oracle.random_logical(rng, shape, specials=False)
    return oracle.build_accumulator(logical, (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab),
                                    hdim_multiple_of=layout.hdim_multiple_of, rng=rng, padding="zeros")


def _sink(rng, batch, seqlen):
    sink = rng.standard_normal(H).astype(np.float32)
    lse = (sink[None, :, None] + np.abs(rng.standard_normal((batch, H, seqlen))) * 2).astype(np.float32)
    dpsum = rng.standard_normal((batch, H, QL.padded_seqlen(seqlen))).astype(np.float32)
    return sink, lse, dpsum


def _op(s_q, s_k, **extra):
    def op(q, k, v, scale, sink, lse, dpsum, used=None):
        return flash_attention_postprocess(q, k, v, scale, head_dim=D, dq_layout=QL, dkv_layout=KL, seqlen_q=s_q,
                                           seqlen_k=s_k, learnable_sink=sink, lse=lse, dpsum=dpsum, seqused_q=used,
                                           **extra)
    return op


def _inputs(rng, n, batch, s_q, s_k):
    q = np.stack([_acc(rng, QL, (batch, s_q, H, D)) for _ in range(n)])
    k = np.stack([_acc(rng, KL, (batch, s_k, H_KV, D)) for _ in range(n)])
    v = np.stack([_acc(rng, KL, (batch, s_k, H_KV, D)) for _ in range(n)])
    sinks = [_sink(rng, batch, s_q) for _ in range(n)]
    return q, k, v, *(np.stack([s[i] for s in sinks]) for i in range(3))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_vmap_is_one_launch_and_matches_a_loop(rng, platform):
    device = jax.devices(platform)[0]
    n, batch, s_q, s_k = 3, 2, 150, 100
    q, k, v, sink, lse, dpsum = (jax.device_put(x, device) for x in _inputs(rng, n, batch, s_q, s_k))
    scales = jax.device_put(rng.uniform(0.1, 2.0, n).astype(np.float32), device)
    op = _op(s_q, s_k)
    loop = [jax.jit(op)(q[i], k[i], v[i], scales[i], sink[i], lse[i], dpsum[i]) for i in range(n)]
    for scale_axis in (0, None):
        s = scales if scale_axis == 0 else scales[0]
        got = jax.jit(jax.vmap(op, in_axes=(0, 0, 0, scale_axis, 0, 0, 0)))(q, k, v, s, sink, lse, dpsum)
        want = loop if scale_axis == 0 else [jax.jit(op)(q[i], k[i], v[i], s, sink[i], lse[i], dpsum[i])
                                             for i in range(n)]
        for j, what in enumerate(("dq", "dk", "dv")):
            assert_same_bits(got[j], np.stack([np.asarray(w[j]) for w in want]), f"vmap {what}")
        # dsink: the same rows summed per head (on the GPU in FlashAttention-4's order, which does not depend on
        # the fold); on CPU the float32 sum may associate differently.
        np.testing.assert_allclose(got[3], np.stack([np.asarray(w[3]) for w in want]), rtol=1e-5, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(jax.vmap(op, in_axes=(0, 0, 0, None, 0, 0, 0)))(q, k, v, scales[0], sink, lse, dpsum))
    assert jaxpr.count("jax_dqpost_postprocess[") == 1 and "while" not in jaxpr


@pytest.mark.parametrize("platform", PLATFORMS)
def test_vmap_varlen_with_shared_offsets_is_one_launch(rng, platform):
    device = jax.devices(platform)[0]
    n, cu, total = 2, [0, 40, 130], 140
    q = np.stack([oracle.build_varlen(rng, cu, None, total, H, D, (QL.tile_m, QL.num_threads, QL.atom_layout,
                                                                   QL.swap_ab), hdim_multiple_of=32, scale=1.0,
                                      dtype=jnp.bfloat16)[0] for _ in range(n)])
    k = np.stack([oracle.build_varlen(rng, cu, None, total, H_KV, D, (KL.tile_m, KL.num_threads, KL.atom_layout,
                                                                      KL.swap_ab), hdim_multiple_of=32, scale=1.0,
                                      dtype=jnp.bfloat16)[0] for _ in range(n)])
    q, k = jax.device_put(q, device), jax.device_put(k, device)
    cu_t = jnp.asarray(cu, jnp.int32)

    def op(q, k, c):
        return flash_attention_postprocess(q, k, k, 0.5, head_dim=D, dq_layout=QL, dkv_layout=KL, total_q=total,
                                           total_k=total, cu_seqlens_q=c, cu_seqlens_k=c)

    got = jax.jit(jax.vmap(op, in_axes=(0, 0, None)))(q, k, cu_t)
    for i in range(n):
        want = jax.jit(op)(q[i], k[i], cu_t)
        for j in range(3):
            assert_same_bits(got[j][i], want[j], f"varlen vmap element {i} tensor {j}")
    per_element = jax.jit(jax.vmap(op, in_axes=(0, 0, 0)))(q, k, jnp.stack([cu_t] * n))  # offsets mapped: a loop
    assert_same_bits(per_element[0], got[0], "per-element offsets")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_autodiff(rng, platform):
    """Linear in each accumulator (the VJP is dq_accum_from_dq of the cotangent), bilinear in the scales; dsink
    differentiable in learnable_sink, lse and dpsum as the float64 formula says."""
    device = jax.devices(platform)[0]
    batch, s_q, s_k = 1, 70, 50
    q, k, v, sink, lse, dpsum = (jax.device_put(x[0], device) for x in _inputs(rng, 1, batch, s_q, s_k))
    op = _op(s_q, s_k)
    outs, vjp = jax.vjp(lambda q, k, v: op(q, k, v, 0.5, sink, lse, dpsum)[:3], q, k, v)
    cts = [jnp.asarray(rng.standard_normal(o.shape), o.dtype) for o in outs]
    q_bar, k_bar, v_bar = vjp(tuple(cts))
    np.testing.assert_array_equal(np.asarray(q_bar), np.asarray(dq_accum_from_dq(cts[0], 0.5, layout=QL)))
    np.testing.assert_array_equal(np.asarray(k_bar), np.asarray(dq_accum_from_dq(cts[1], 0.5, layout=KL)))
    np.testing.assert_array_equal(np.asarray(v_bar), np.asarray(dq_accum_from_dq(cts[2], 1.0, layout=KL)))

    # dsink's gradients against float64 finite-free formulas: d/dsink = sum(-p dpsum), d/dlse = p dpsum,
    # d/ddpsum = -p (rows < S; lse = -inf rows: p = 1, no gradient to sink or lse).
    def dsink_sum(s, l, p):
        return jnp.sum(op(q, k, v, 0.5, s, l, p)[3] * jnp.arange(1, H + 1, dtype=jnp.float32))

    g_sink, g_lse, g_dpsum = jax.grad(dsink_sum, argnums=(0, 1, 2))(sink, lse, dpsum)
    w = np.arange(1, H + 1, dtype=np.float64)[None, :, None]
    p = np.exp(np.asarray(sink, np.float64)[None, :, None] - np.asarray(lse, np.float64))
    dp = np.asarray(dpsum, np.float64)[:, :, :s_q]
    np.testing.assert_allclose(g_sink, (w * -p * dp).sum(axis=(0, 2)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g_lse, w * p * dp, rtol=1e-4, atol=1e-5)
    want_dpsum = np.zeros(dpsum.shape)
    want_dpsum[:, :, :s_q] = w * -p
    np.testing.assert_allclose(g_dpsum, want_dpsum, rtol=1e-4, atol=1e-6)
    # The scales: bilinear, scale's gradient is sum(ct * acc value read).
    g_scale = jax.grad(lambda s: jnp.sum(op(q, k, v, s, sink, lse, dpsum)[0].astype(jnp.float32)))(0.5)
    assert np.isfinite(g_scale)
    with pytest.raises(TypeError):
        jax.grad(lambda c: jnp.sum(flash_attention_postprocess(q, k, v, 0.5, head_dim=D, dq_layout=QL,
                                                               dkv_layout=KL, total_q=s_q, total_k=s_k,
                                                               cu_seqlens_q=c, cu_seqlens_k=c)[0]))(
            jnp.asarray([0, s_q], jnp.int32))


CPUS = jax.devices("cpu")
GPUS = jax.devices("cuda") if HAS_GPU else []
DEVICE_SETS = [pytest.param(CPUS, id=f"cpu{len(CPUS)}", marks=pytest.mark.skipif(
    len(CPUS) < 8, reason="needs --xla_force_host_platform_device_count=8"))]
DEVICE_SETS += [pytest.param(GPUS, id=f"cuda{len(GPUS)}")] if len(GPUS) >= 2 else []


@pytest.mark.parametrize("devices", DEVICE_SETS)
def test_sharding_batch_and_heads(rng, devices):
    """Heads sharded (query heads and their key/value heads on the same device): no collective, same bits.
    Batch sharded: dQ/dK/dV without a collective; dsink is the one all-reduce (per-shard float32 sums)."""
    batch, s_q, s_k = 2, 150, 100
    q, k, v, sink, lse, dpsum = (x[0] for x in _inputs(rng, 1, batch, s_q, s_k))
    op = _op(s_q, s_k)
    args = (q, k, v, np.float32(0.5), sink, lse, dpsum)
    want = jax.jit(op)(*(jax.device_put(a, CPUS[0]) for a in args))
    # dsink is reduced in the platform's own order (FlashAttention-4's on the GPU): the heads-sharded sums must have
    # the bits of the same op on one device of that platform, and agree with the CPU's within float32 rounding.
    one_device = jax.jit(op)(*(jax.device_put(a, devices[0]) for a in args))
    n = min(len(devices), 2)
    for axis, specs in (("h", (P(None, "x"), P(None, "x"), P(None, "x"), P(), P("x"), P(None, "x"), P(None, "x"))),
                        ("b", (P("x"), P("x"), P("x"), P(), P(), P("x"), P("x")))):
        mesh = Mesh(np.array(devices[:n]), ("x",))
        shardings = tuple(NamedSharding(mesh, s) for s in specs)
        f = jax.jit(op, in_shardings=shardings)
        placed = [jax.device_put(a, s) for a, s in zip(args, shardings)]
        text = f.lower(*placed).compile().as_text()
        got = f(*placed)
        for j, what in enumerate(("dq", "dk", "dv")):
            assert_same_bits(got[j], want[j], f"{what} sharded over {axis}")
        found = [c for c in COLLECTIVES if c in text]
        if axis == "h":
            assert not found, f"collectives {found} in the heads-sharded program"
            assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "x", None)), 4)
            assert np.array_equal(np.asarray(got[3]).view(np.uint32), np.asarray(one_device[3]).view(np.uint32))
            np.testing.assert_allclose(got[3], want[3], rtol=1e-5, atol=1e-5)
        else:
            assert found == ["all-reduce"] and text.count("all-reduce(") == 1, found
            np.testing.assert_allclose(got[3], want[3], rtol=1e-5, atol=1e-5)
