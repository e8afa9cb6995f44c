"""vmap, autodiff and dq_accum_from_dq (the op's transpose), dense and varlen, on every platform present."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from conftest import PLATFORMS
from jax_dqpost import AccumLayout, dq_accum_from_dq, dq_postprocess
from test_dq_postprocess import assert_same_bits
import oracle

LAYOUT = AccumLayout(90, 80, 256, 1, True, 32)
D = 128


def _dense_acc(rng, batch, seqlen, heads):
    logical = oracle.random_logical(rng, (batch, seqlen, heads, D), specials=False)
    return oracle.build_accumulator(logical, (80, 256, 1, True), hdim_multiple_of=32, rng=rng)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_vmap_dense_folds_into_one_call_and_matches_a_loop(rng, platform):
    device = jax.devices(platform)[0]
    n, B, S, H = 3, 2, 100, 2
    acc = jax.device_put(np.stack([_dense_acc(rng, B, S, H) for _ in range(n)]), device)
    scales = jax.device_put(rng.uniform(0.1, 2.0, n).astype(np.float32), device)
    used = jax.device_put(rng.integers(0, S + 1, (n, B)).astype(np.int32), device)
    op = lambda a, s, u: dq_postprocess(a, s, seqlen_q=S, head_dim=D, seqused_q=u, layout=LAYOUT)
    loop = np.stack([np.asarray(jax.jit(op)(acc[i], scales[i], used[i])) for i in range(n)])
    for in_axes in [(0, 0, 0), (0, None, 0), (0, 0, None), (0, None, None)]:
        args = [x if ax == 0 else x[0] for x, ax in zip((acc, scales, used), in_axes)]
        got = jax.jit(jax.vmap(op, in_axes=in_axes))(*args)
        want = loop if in_axes == (0, 0, 0) else np.stack([
            np.asarray(jax.jit(op)(*[a[i] if ax == 0 else a for a, ax in zip(args, in_axes)])) for i in range(n)])
        assert_same_bits(got, want, f"vmap in_axes={in_axes}")
    # One kernel call for the whole vmapped batch (not a loop), and nested vmap.
    jaxpr = jax.make_jaxpr(jax.vmap(op, in_axes=(0, None, 0)))(acc, scales[0], used)
    assert str(jaxpr).count("jax_dqpost_postprocess[") == 1 and "while" not in str(jaxpr)
    nested = jax.jit(jax.vmap(jax.vmap(op, in_axes=(0, None, None)), in_axes=(0, None, None)))(
        acc.reshape((1, n) + acc.shape[1:]), scales[0], used[0])
    assert_same_bits(nested[0], np.stack([np.asarray(jax.jit(op)(acc[i], scales[0], used[0])) for i in range(n)]),
                     "nested vmap")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_vmap_varlen_matches_a_loop(rng, platform):
    device = jax.devices(platform)[0]
    n, T, H = 3, 300, 2
    cus, accs = [], []
    for _ in range(n):
        cu = np.concatenate([[0], np.sort(rng.integers(0, T + 1, 2)), [T]]).astype(np.int32)
        acc, _ = oracle.build_varlen(rng, list(cu), None, T, H, D, (80, 256, 1, True), hdim_multiple_of=32,
                                     scale=1.0, dtype=jnp.bfloat16)
        cus.append(cu)
        accs.append(acc)
    acc, cu = jax.device_put(np.stack(accs), device), jax.device_put(np.stack(cus), device)
    op = lambda a, c: dq_postprocess(a, 0.3, head_dim=D, total_q=T, cu_seqlens_q=c, layout=LAYOUT)
    got = jax.jit(jax.vmap(op))(acc, cu)
    want = np.stack([np.asarray(jax.jit(op)(acc[i], cu[i])) for i in range(n)])
    assert_same_bits(got, want, "vmap varlen, per-element offsets (one call each)")
    # The same offsets for every element (traced or static), per-element scales: folded into the heads, one call.
    scales = jax.device_put(rng.uniform(0.1, 2.0, n).astype(np.float32), device)
    same = lambda a, s: dq_postprocess(a, s, head_dim=D, total_q=T, cu_seqlens_q=cu[0], layout=LAYOUT)  # noqa: E731
    static = lambda a, s: dq_postprocess(a, s, head_dim=D, total_q=T, cu_seqlens_q=cus[0].tolist(),  # noqa: E731
                                         layout=LAYOUT)
    for name, fn in (("traced", same), ("static", static)):
        jaxpr = str(jax.make_jaxpr(jax.vmap(fn))(acc, scales))
        assert jaxpr.count("jax_dqpost_postprocess[") == 1 and "while" not in jaxpr, jaxpr
        got = jax.jit(jax.vmap(fn))(acc, scales)
        want = np.stack([np.asarray(jax.jit(fn)(acc[i], scales[i])) for i in range(n)])
        assert_same_bits(got, want, f"vmap varlen, shared {name} offsets")
        nested = jax.jit(jax.vmap(jax.vmap(fn, in_axes=(0, None)), in_axes=(0, None)))(acc[None], scales[0])
        assert_same_bits(nested[0], np.stack([np.asarray(jax.jit(fn)(acc[i], scales[0])) for i in range(n)]),
                         f"nested vmap varlen, shared {name} offsets")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dq_accum_from_dq_inverts_the_op_and_zeroes_padding(rng, platform):
    device = jax.devices(platform)[0]
    B, S, H = 2, 150, 3
    dq = jax.device_put(oracle.random_logical(rng, (B, S, H, D), specials=False).astype(jnp.bfloat16), device)
    acc = jax.jit(lambda x: dq_accum_from_dq(x, 1.0, layout=LAYOUT))(dq)
    assert acc.shape == LAYOUT.accum_shape(B, H, S, D) and acc.dtype == jnp.float32
    # Where each element goes: the independent producer emulation, with zeros in padding.
    want = oracle.build_accumulator(np.asarray(dq).astype(np.float32), (80, 256, 1, True), hdim_multiple_of=32,
                                    rng=rng, padding="zeros")
    np.testing.assert_array_equal(np.asarray(acc), want)
    back = jax.jit(lambda a: dq_postprocess(a, 1.0, seqlen_q=S, head_dim=D, layout=LAYOUT))(acc)
    assert_same_bits(back, dq, "op(dq_accum_from_dq(dq)) == dq")
    # Scaled: one fp32 multiply per element.
    scaled = np.asarray(jax.jit(lambda x: dq_accum_from_dq(x, 0.375, layout=LAYOUT))(dq))
    np.testing.assert_array_equal(scaled, want * np.float32(0.375))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dq_accum_from_dq_varlen(rng, platform):
    device = jax.devices(platform)[0]
    cu, used, T, H = [0, 40, 40, 250], [40, 0, 100], 260, 2
    dq = oracle.random_logical(rng, (T, H, D), specials=False).astype(jnp.bfloat16)
    for static in (True, False):
        c = cu if static else jnp.asarray(cu, jnp.int32)
        u = used if static else jnp.asarray(used, jnp.int32)
        acc = jax.jit(lambda x: dq_accum_from_dq(x, 1.0, cu_seqlens_q=c, seqused_q=u, layout=LAYOUT))(
            jax.device_put(dq, device))
        _, want_dq = oracle.build_varlen(rng, cu, used, T, H, D, (80, 256, 1, True), hdim_multiple_of=32, scale=1.0,
                                         dtype=jnp.bfloat16, logical=np.asarray(dq).astype(np.float32))
        back = jax.jit(lambda a: dq_postprocess(a, 1.0, head_dim=D, total_q=T, cu_seqlens_q=c, seqused_q=u,
                                                layout=LAYOUT))(acc)
        assert_same_bits(back, want_dq, f"varlen round trip static={static}")
        nonzero = int((np.asarray(acc) != 0).sum())
        assert nonzero == int((want_dq.astype(np.float32) != 0).sum()), "entries outside the read positions"


def _grad_case(rng, varlen):
    if varlen:
        cu, T, H = [0, 70, 70, 200], 210, 2
        acc, _ = oracle.build_varlen(rng, cu, None, T, H, D, (80, 256, 1, True), hdim_multiple_of=32, scale=1.0,
                                     dtype=jnp.float16, logical=rng.standard_normal((T, H, D)).astype(np.float32))
        acc = np.nan_to_num(np.clip(acc, -4, 4))
        f = lambda a, s: dq_postprocess(a, s, head_dim=D, total_q=T, cu_seqlens_q=jnp.asarray(cu, jnp.int32),
                                        dtype=jnp.float16, layout=LAYOUT)
    else:
        B, S, H = 1, 90, 2
        acc = np.clip(_dense_acc(rng, B, S, H), -4, 4)
        acc = np.nan_to_num(acc)
        f = lambda a, s: dq_postprocess(a, s, seqlen_q=S, head_dim=D, dtype=jnp.float16, layout=LAYOUT)
    return f, jnp.asarray(acc), jnp.float32(0.75)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_grads_to_second_order(rng, varlen):
    """The op is linear in dq_accum and bilinear in (dq_accum, scale), so central differences with a large
    step are exact up to fp16 rounding: first order in both arguments, second order in dq_accum (jointly,
    second-order checks see a cubic in scale, whose central differences are not exact)."""
    f, acc, scale = _grad_case(rng, varlen)
    check_grads(jax.jit(f), (acc, scale), order=1, modes=("fwd", "rev"), eps=1.0, atol=0.05, rtol=0.02)
    check_grads(jax.jit(lambda a: f(a, scale)), (acc,), order=2, modes=("fwd", "rev"), eps=1.0, atol=0.05,
                rtol=0.02)


def test_vjp_is_dq_accum_from_dq(rng):
    f, acc, scale = _grad_case(rng, False)
    out, vjp = jax.vjp(lambda a: f(a, scale), acc)
    ct = jnp.asarray(rng.standard_normal(out.shape), jnp.float16)
    (acc_bar,) = vjp(ct)
    np.testing.assert_array_equal(np.asarray(acc_bar),
                                  np.asarray(dq_accum_from_dq(ct, scale, layout=LAYOUT)))
