"""Both ops under jax's transformations, as one matrix over the part of the postprocess (``dq``: dq_postprocess;
``dqkv``: flash_attention_postprocess with dK and dV), the learnable sink (none or one), the packing and the offsets
(static or traced), on every platform present:

- vmap: folded into one launch (a batch or shared offsets folded into the heads) with a loop's bits; per-element
  offsets run as a loop;
- autodiff: linear in each accumulator (its VJP is dq_accum_from_dq of the cotangent), bilinear in the scales
  (checked by central differences, exact up to rounding), dsink differentiable in learnable_sink, lse and dpsum as
  the float64 formula says;
- sharding over batch and heads without a collective (a batch-sharded dsink adds one reduction), a sharded sequence
  axis gathered, packed heads sharded; the bits of the unsharded op;
- dq_accum_from_dq (the op's transpose) against the producer emulation, also in rows allocated wider than the tiles.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from conftest import HAS_GPU, PLATFORMS
from jax_dqpost import AccumLayout, Gradients, dq_accum_from_dq, dq_postprocess, flash_attention_postprocess
import oracle
from oracle import assert_same_bits
from support import assert_within_roundings, round_up

PARTS = ("dq", "dqkv")
D = 128
QL = AccumLayout.flash_attention(90, D, causal=False, tensor="dq", version="4.0.0b36")
KL = AccumLayout.flash_attention(90, D, causal=False, tensor="dkv", version="4.0.0b36")
HEADS = {"dq": (2, None), "dqkv": (4, 2)}  # query heads, key/value heads (sharded over heads: twice as many)
COLLECTIVES = re.compile(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter")
ARG_NAMES = {"used_q": "seqused_q", "used_k": "seqused_k", "cu_q": "cu_seqlens_q", "cu_k": "cu_seqlens_k",
             "sink": "learnable_sink", "lse": "lse", "dpsum": "dpsum"}


def make_op(part, static=None, dtype=jnp.bfloat16):
    """``part``'s op on a dict of operands: q (k, v), scale (k_scale), and by their names in ARG_NAMES the lengths,
    offsets and sink inputs present; ``static``: the static keyword arguments. Returns a tuple of its outputs (dq,
    dk, dv, dsink, those computed)."""
    def op(x):
        kw = dict(static or {}, **{ARG_NAMES[n]: v for n, v in x.items() if n in ARG_NAMES})
        if part == "dq" and "learnable_sink" not in kw:
            return (dq_postprocess(x["q"], x["scale"], head_dim=D, dtype=dtype, layout=QL, **kw),)
        if part == "dq":  # dQ with a sink: the fused op without dK/dV accumulators
            out = flash_attention_postprocess(x["q"], None, None, x["scale"], head_dim=D, dtype=dtype, dq_layout=QL,
                                              **kw)
            return out.dq, out.dsink
        out = flash_attention_postprocess(x["q"], x["k"], x["v"], x["scale"], head_dim=D, dtype=dtype, dq_layout=QL,
                                          dkv_layout=KL, dk_scale=x["k_scale"], **kw)
        return out if out.dsink is not None else out[:3]  # with a sink, the Gradients itself
    return op


def problem(rng, part, packing, *, sink=False, cu=None, batch=2, seqlens=(100, 70), total=300, specials=True,
            padding="random", heads=None, attended_to_nothing=True):
    """The operands (numpy, by name) of one random problem of ``part`` and the op's static keyword arguments.
    Dense: ``batch`` sequences of ``seqlens`` rows (q side, k side), with seqused ("dense-seqused") random lengths
    (an operand); packed ("varlen"): ``cu`` (default random) offsets on both sides, ``total`` rows, not in the
    operands (the caller passes them, static or traced). ``heads``: query and key/value heads (default HEADS[part]);
    with a sink, ``attended_to_nothing``: some rows of lse are -inf."""
    heads, kv_heads = HEADS[part] if heads is None else heads
    ops = dict(scale=np.float32(rng.uniform(0.1, 2.0)))
    if packing.startswith("dense"):
        s_q, s_k = seqlens
        static = dict(seqlen_q=s_q) | (dict(seqlen_k=s_k) if part == "dqkv" else {})
        acc = lambda layout, h, s: oracle.dense_case(rng, layout, (batch, s, h, D), 1.0, jnp.bfloat16,  # noqa: E731
                                                     specials=specials, padding=padding)[0]
        ops["q"] = acc(QL, heads, s_q)
        if part == "dqkv":
            ops["k"], ops["v"] = acc(KL, kv_heads, s_k), acc(KL, kv_heads, s_k)
        if packing == "dense-seqused":
            ops["used_q"] = rng.integers(0, s_q + 1, batch).astype(np.int32)
            if part == "dqkv":
                ops["used_k"] = rng.integers(0, s_k + 1, batch).astype(np.int32)
        rows, padded = (batch, heads, s_q), (batch, heads, QL.padded_seqlen(s_q))
    else:
        cu = [0, *sorted(int(c) for c in rng.integers(0, total + 1, batch - 1)), total] if cu is None else cu
        static = dict(total_q=total) | (dict(total_k=total) if part == "dqkv" else {})
        logical = lambda h: oracle.random_logical(rng, (total, h, D), specials=specials)  # noqa: E731
        ops["q"] = oracle.varlen_case(rng, QL, cu, None, total, heads, D, 1.0, jnp.bfloat16, logical=logical(heads))[0]
        if part == "dqkv":
            ops["k"], ops["v"] = (oracle.varlen_case(rng, KL, cu, None, total, kv_heads, D, 1.0, jnp.bfloat16,
                                                     logical=logical(kv_heads))[0] for _ in range(2))
        tp = QL.varlen_accum_shape(len(cu) - 1, heads, total, D)[1] // QL.padded_head_dim(D)
        rows, padded = (heads, total), (heads, tp)
    if part == "dqkv":
        ops["k_scale"] = np.float32(rng.uniform(0.1, 2.0))
    if sink:
        ops["sink"], ops["lse"], ops["dpsum"] = oracle.sink_inputs(rng, heads, np.float32, rows, padded,
                                                                   0 if len(rows) == 2 else 1)
        if not attended_to_nothing:
            ops["lse"] = np.where(np.isneginf(ops["lse"]), ops["sink"].max() + 1, ops["lse"]).astype(np.float32)
    return ops, static


def stacked(problems):
    """``n`` problems' operands stacked on a new leading axis."""
    return {name: np.stack([p[name] for p in problems]) for name in problems[0]}


def loop(op, x, in_axes):
    """``op`` applied element by element (jitted once), stacked: what vmap must give."""
    n = next(len(v) for name, v in x.items() if in_axes.get(name) == 0)
    f = jax.jit(op)
    outs = [f({name: v[i] if in_axes.get(name) == 0 else v for name, v in x.items()}) for i in range(n)]
    return [np.stack([np.asarray(o[j]) for o in outs]) for j in range(len(outs[0]))]


def assert_like_loop(got, want, what, *, sink):
    """dq, dk, dv with the loop's bits; dsink (last, with a sink) the same rows summed per head (on the GPU in
    FlashAttention-4's order, which does not depend on the fold; on CPU the float32 sum may associate differently:
    within one rounding and the reordering of a few hundred terms, of dsink's scale)."""
    n = len(got) - 1 if sink else len(got)
    for j in range(n):
        assert_same_bits(got[j], want[j], f"{what}: output {j}")
    if sink:
        assert_within_roundings(got[-1], want[-1], f"{what}: dsink", terms=1024)


def assert_one_launch(f, *args):
    jaxpr = str(jax.make_jaxpr(f)(*args))
    assert len(re.findall(r"\b\w*postprocess\w*\[", jaxpr)) == 1, jaxpr  # the op's primitive, once
    assert "while" not in jaxpr, jaxpr


# ---- the result types

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("gqa", [False, True])
def test_one_result_type_whatever_the_arguments(rng, platform, gqa):
    """dq_postprocess returns one array (it takes no sink); flash_attention_postprocess a Gradients of four members
    with or without a sink and dK/dV accumulators, None where not computed, out of a call, jit, vmap, eval_shape, a
    VJP (its cotangent a Gradients too), shard_map (out_specs one spec or a Gradients) and a serialized export."""
    from jax_dqpost import DISABLED_CHECKS

    part = "dqkv" if gqa else "dq"
    device = jax.devices(platform)[0]
    x, static = problem(rng, part, "dense", sink=True)
    x = jax.device_put(x, device)
    kv = dict(dkv_layout=KL, seqlen_k=static["seqlen_k"]) if gqa else {}

    def fused(x, sink):
        sk = dict(learnable_sink=x["sink"], lse=x["lse"], dpsum=x["dpsum"]) if sink else {}
        return flash_attention_postprocess(x["q"], x.get("k"), x.get("v"), x["scale"], head_dim=D, dq_layout=QL,
                                           seqlen_q=static["seqlen_q"], **kv, **sk)

    dq = dq_postprocess(x["q"], x["scale"], head_dim=D, seqlen_q=static["seqlen_q"], layout=QL)
    assert isinstance(dq, jax.Array) and dq.shape == (2, 100, HEADS[part][0], D)
    assert isinstance(jax.jit(lambda q: dq_postprocess(q, 0.5, head_dim=D, seqlen_q=100, layout=QL))(x["q"]),
                      jax.Array)
    with pytest.raises(TypeError, match="unexpected keyword argument 'learnable_sink'"):
        dq_postprocess(x["q"], x["scale"], head_dim=D, seqlen_q=100, layout=QL, learnable_sink=x["sink"],
                       lse=x["lse"], dpsum=x["dpsum"])
    two = jax.tree.map(lambda a: np.stack([a, a]), x)
    for sink in (False, True):
        present = (True, gqa, gqa, sink)
        f = functools.partial(fused, sink=sink)
        direct = f(x)
        outs = {"call": direct, "jit": jax.jit(f)(x), "vmap": jax.vmap(f)(two), "eval_shape": jax.eval_shape(f, x)}
        out, vjp = jax.vjp(f, x)
        outs["vjp"] = out
        for how, got in outs.items():
            assert type(got) is Gradients and got._fields == ("dq", "dk", "dv", "dsink"), (how, type(got))
            assert tuple(m is not None for m in got) == present, (how, sink, got)
        assert jax.tree.structure(direct) == jax.tree.structure(outs["jit"])
        assert len(jax.tree.leaves(direct)) == sum(present)
        cotangent = jax.tree.map(jnp.ones_like, direct)  # None members stay None
        assert type(cotangent) is Gradients and vjp(cotangent)[0]["q"].shape == x["q"].shape
        exported = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=DISABLED_CHECKS)(x)
        restored = jax.export.deserialize(exported.serialize()).call(x)
        assert type(restored) is Gradients and tuple(m is not None for m in restored) == present
        for got, want in zip(restored[:3], direct[:3]):
            if want is not None:
                assert_same_bits(got, want, f"exported, sink={sink}")
        if sink:
            oracle.assert_dsink_reordered(restored.dsink, direct.dsink, x["sink"], x["lse"], x["dpsum"], "exported")
        mesh = Mesh(np.array([device]), ("b",))
        for specs in (P(), Gradients(P(), P() if gqa else None, P() if gqa else None, P() if sink else None)):
            got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=specs))(x)
            assert type(got) is Gradients and tuple(m is not None for m in got) == present, specs


# ---- vmap

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part, sink", [("dq", False), ("dq", True), ("dqkv", True)])
def test_vmap_dense_is_one_launch_and_matches_a_loop(rng, platform, part, sink):
    """Mapped accumulators, with the scales and the lengths (seqused, an operand) mapped or shared; nested vmap."""
    device = jax.devices(platform)[0]
    problems = [problem(rng, part, "dense-seqused", sink=sink) for _ in range(3)]
    op, x = make_op(part, problems[0][1]), jax.device_put(stacked([p for p, _ in problems]), device)
    for shared in ((), ("scale", "k_scale"), ("scale", "k_scale", "used_q", "used_k")):
        in_axes = {name: None if name in shared else 0 for name in x}
        args = {name: v[0] if name in shared else v for name, v in x.items()}
        got = jax.jit(jax.vmap(op, in_axes=(in_axes,)))(args)
        assert_like_loop(got, loop(op, args, in_axes), f"vmap, shared {shared}", sink=sink)
    # One kernel launch for the whole vmapped batch (not a loop), and nested vmap.
    shared = {name: None if name in ("scale", "k_scale", "used_q", "used_k") else 0 for name in x}
    assert_one_launch(jax.vmap(op, in_axes=(shared,)), args)
    nested = jax.jit(jax.vmap(jax.vmap(op, in_axes=(shared,)), in_axes=(shared,)))(
        {name: v[None] if shared[name] == 0 else v for name, v in args.items()})
    assert_like_loop([o[0] for o in nested], loop(op, args, shared), "nested vmap", sink=sink)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part, sink, offsets", [("dq", False, "static"), ("dq", True, "traced"),
                                                 ("dqkv", True, "static"), ("dqkv", False, "traced")])
def test_vmap_varlen_with_shared_offsets_is_one_launch(rng, platform, part, sink, offsets):
    """The same offsets for every element (static, or traced and not mapped) fold into the heads: one launch, a
    loop's bits, nested vmap too; traced offsets mapped per element run as a loop, with its bits."""
    device = jax.devices(platform)[0]
    cu = [0, 40, 40, 250, 290]
    problems = [problem(rng, part, "varlen", sink=sink, cu=cu) for _ in range(2)]
    x = jax.device_put(stacked([p for p, _ in problems]), device)
    static = dict(problems[0][1])
    names = ("cu_q", "cu_k") if part == "dqkv" else ("cu_q",)
    if offsets == "static":
        static |= {ARG_NAMES[n]: cu for n in names}
    else:
        x |= {n: jnp.asarray(cu, jnp.int32) for n in names}
    op = make_op(part, static)
    in_axes = {name: None if name in names else 0 for name in x}
    got = jax.jit(jax.vmap(op, in_axes=(in_axes,)))(x)
    assert_like_loop(got, loop(op, x, in_axes), f"vmap varlen, shared {offsets} offsets", sink=sink)
    assert_one_launch(jax.vmap(op, in_axes=(in_axes,)), x)
    nested = jax.jit(jax.vmap(jax.vmap(op, in_axes=(in_axes,)), in_axes=(in_axes,)))(
        {name: v[None] if in_axes[name] == 0 else v for name, v in x.items()})
    assert_like_loop([o[0] for o in nested], got, "nested vmap varlen", sink=sink)
    if offsets == "traced":  # per-element offsets: mapped too
        per_element = [[0, *sorted(int(c) for c in rng.integers(0, 301, 3)), 300] for _ in range(2)]
        problems = [problem(rng, part, "varlen", sink=sink, cu=c) for c in per_element]
        x = jax.device_put(stacked([p for p, _ in problems]), device)
        x |= {n: np.asarray(per_element, np.int32) for n in names}
        all_mapped = {name: 0 for name in x}
        got = jax.jit(jax.vmap(op, in_axes=(all_mapped,)))(x)
        assert_like_loop(got, loop(op, x, all_mapped), "vmap varlen, per-element offsets", sink=sink)


# ---- autodiff

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("packing", ["dense", "varlen"])
def test_linear_in_the_accumulators_bilinear_in_the_scales(rng, platform, part, packing):
    """The VJP of each accumulator is dq_accum_from_dq of its cotangent, with its scale. dQ alone: linear in its
    accumulator and bilinear in (accumulator, scale), so central differences with a large step are exact up to fp16
    rounding: first order in both, second order in the accumulator (jointly with the scale, second-order checks see
    a cubic, whose central differences are not exact); its packed VJP is the fused op's packed dK/dV one."""
    device = jax.devices(platform)[0]
    cu = [0, 70, 70, 200]
    x, static = problem(rng, part, packing, specials=False, batch=1, seqlens=(90, 60), cu=cu, total=210,
                        heads=(2, 1))
    x = {name: np.nan_to_num(np.clip(v, -4, 4)) if name in ("q", "k", "v") else v for name, v in x.items()}
    offsets = {}
    if packing == "varlen":
        offsets = {n: jnp.asarray(cu, jnp.int32) for n in (("cu_q", "cu_k") if part == "dqkv" else ("cu_q",))}
    x = jax.device_put(x, device)
    op = make_op(part, static, dtype=jnp.float16)
    accs = ("q", "k", "v") if part == "dqkv" else ("q",)
    scales = ("scale", "k_scale") if part == "dqkv" else ("scale",)

    def f(*args):
        return op(dict(x, **offsets, **dict(zip(accs + scales, args))))

    args = tuple(x[n] for n in accs + scales)
    linear = jax.jit(lambda *a: f(*a, *args[len(accs):]))  # in the accumulators alone
    if part == "dq":  # (the fused op's derivative rules are the same code: its VJPs below, for time)
        check_grads(jax.jit(f), args, order=1, modes=("fwd", "rev"), eps=1.0, atol=0.05, rtol=0.02)
        check_grads(linear, args[:len(accs)], order=2, modes=("fwd", "rev"), eps=1.0, atol=0.05, rtol=0.02)
    if (part, packing) == ("dq", "varlen"):
        return  # (its VJP: dK's and dV's below, the same transpose, for time)
    outs, vjp = jax.vjp(linear, *args[:len(accs)])
    cts = tuple(jnp.asarray(rng.standard_normal(o.shape), o.dtype) for o in outs)
    kw = {} if packing == "dense" else dict(cu_seqlens_q=offsets["cu_q"])
    transpose = jax.jit(lambda cts: [dq_accum_from_dq(ct, scale, layout=layout, **kw) for ct, scale, layout in zip(
        cts, (x["scale"], x.get("k_scale"), 1.0), (QL, KL, KL))])
    for name, bar, want in zip(accs, jax.jit(vjp)(cts), transpose(cts)):
        np.testing.assert_array_equal(np.asarray(bar), np.asarray(want), err_msg=f"VJP of {name}")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part, packing", [("dq", "dense"), ("dq", "varlen"), ("dqkv", "dense")])
def test_dsink_gradients(rng, platform, part, packing):
    """dsink's gradients against float64 formulas: d/dsink = sum(-p dpsum), d/dlse = p dpsum, d/ddpsum = -p over
    the covered rows, p = exp(sink - lse); the scale's gradient is finite."""
    _check_dsink_gradients(rng, platform, part, packing, attended_to_nothing=False)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part", PARTS)
def test_dsink_gradients_where_a_row_attended_to_nothing(rng, platform, part):
    """Rows with lse = -inf (attended to nothing): p = 1, so no gradient to sink or lse from them, -1 to dpsum."""
    _check_dsink_gradients(rng, platform, part, "dense", attended_to_nothing=True)


def _check_dsink_gradients(rng, platform, part, packing, attended_to_nothing):
    device = jax.devices(platform)[0]
    cu = [0, 30, 30, 110]
    x, static = problem(rng, part, packing, sink=True, cu=cu, total=120, seqlens=(70, 50), batch=1, specials=False,
                        attended_to_nothing=attended_to_nothing)
    x = jax.device_put(x, device)
    if packing == "varlen":
        static |= {ARG_NAMES[n]: cu for n in (("cu_q", "cu_k") if part == "dqkv" else ("cu_q",))}
    op = make_op(part, static)
    heads = HEADS[part][0]
    weights = jnp.arange(1, heads + 1, dtype=jnp.float32)

    def dsink_sum(s, lse, dpsum):
        return jnp.sum(op(dict(x, sink=s, lse=lse, dpsum=dpsum))[-1] * weights)

    g_sink, g_lse, g_dpsum = jax.jit(jax.grad(dsink_sum, argnums=(0, 1, 2)))(x["sink"], x["lse"], x["dpsum"])
    sink, lse, dpsum = (np.asarray(x[n], np.float64) for n in ("sink", "lse", "dpsum"))
    w = np.arange(1, heads + 1, dtype=np.float64)
    if packing == "dense":  # rows r < S of batch b: lse[b, h, r] and dpsum[b, h, r], as (H, rows) and (H, rows)
        s_q = static["seqlen_q"]
        lse_at = (slice(None), slice(None), slice(0, s_q))
        spans = [(lse_at, lse_at)]
        to_rows = lambda a: np.moveaxis(a, 1, 0).reshape(heads, -1)  # noqa: E731
    else:  # packed: lse[h, cu[b] + r], dpsum[h, padded start of b + r]
        spans = [((slice(None), slice(o, o + n)), (slice(None), slice(a, a + n)))
                 for o, a, n in oracle.sequence_rows(cu, None, 120, QL.pad_rows)]
        to_rows = lambda a: a  # noqa: E731
    want_sink, want_lse, want_dpsum = np.zeros(heads), np.zeros(lse.shape), np.zeros(dpsum.shape)
    magnitude, rows = np.zeros(heads), 0  # dsink's sums: their terms' magnitudes and count
    for lse_at, dpsum_at in spans:
        l, d = to_rows(lse[lse_at]), to_rows(dpsum[dpsum_at])
        finite = np.isfinite(l)
        with np.errstate(over="ignore"):
            p = np.where(finite, np.exp(sink[:, None] - np.where(finite, l, 0)), 1.0)
        want_sink += np.where(finite, w[:, None] * -p * d, 0).sum(axis=1)
        magnitude += np.where(finite, np.abs(w[:, None] * p * d), 0).sum(axis=1)
        rows += l.shape[1]
        back = lambda rows, like: np.moveaxis(rows.reshape(like.shape[1], like.shape[0], -1), 0, 1) \
            if packing == "dense" else rows  # noqa: E731
        want_lse[lse_at] = back(np.where(finite, w[:, None] * p * d, 0), lse[lse_at])
        want_dpsum[dpsum_at] = back(w[:, None] * -p, dpsum[dpsum_at])
    # float32 against float64: p = exp(sink - lse) is a few roundings off, and more where ``sink - lse`` is large
    # (its float32 rounding, times that difference, up to about 16 here); dsink sums the terms in some order.
    p_roundings = 32
    assert_within_roundings(g_sink, want_sink, "dsink", roundings=p_roundings, terms=rows + p_roundings,
                            magnitude=magnitude)
    assert_within_roundings(g_lse, want_lse, "d lse", roundings=p_roundings)
    assert_within_roundings(g_dpsum, want_dpsum, "d dpsum", roundings=p_roundings)
    g_scale = jax.grad(lambda s: jnp.sum(op(dict(x, scale=s))[0].astype(jnp.float32)))(jnp.float32(0.5))
    assert np.isfinite(g_scale)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part", PARTS)
def test_float64_sink_and_scale_under_x64(rng, platform, part):
    """Under ``jax_enable_x64`` (only inside this test) a float64 sink and a float64 scale, traced or not, are taken
    as jax's own operations take them: read as float32 by the kernel, dsink returned in the sink's dtype (float64),
    and the gradients in the sink and the scale float64, with the float32 call's values; traced packed offsets too.
    Without x64 a float64 numpy sink is jax's float32. dQ is one multiply and one rounding: its bits. dsink (on a
    CPU) and the two gradients are float32 sums that XLA computes in each program, in an order it may choose per
    program: within the reordering of their terms."""
    device = jax.devices(platform)[0]
    cu = [0, 30, 30, 110]
    packing = "varlen" if part == "dq" else "dense"
    x, static = problem(rng, part, packing, sink=True, cu=cu, total=120, seqlens=(70, 50), batch=1, specials=False)
    x = jax.device_put(x, device)
    offsets = {}
    if packing == "varlen":
        offsets = {n: jnp.asarray(cu, jnp.int32) for n in (("cu_q", "cu_k") if part == "dqkv" else ("cu_q",))}
    op = make_op(part, static)
    sink32, scale32 = x["sink"], np.float32(x["scale"])
    weights = np.arange(1, sink32.shape[0] + 1, dtype=np.float32)

    want = jax.jit(op)(dict(x, **offsets))
    signs = np.sign(np.asarray(want[0], np.float32))  # dQ's: a sum of |dQ| has no cancellation

    def losses(sink, scale, offsets):  # dsink's, and dQ's (in the scale)
        outs = op(dict(x, sink=sink, scale=scale, **offsets))
        return jnp.sum(outs[-1] * weights), jnp.sum(outs[0].astype(jnp.float32) * signs)

    want_sink = jax.jit(jax.grad(lambda s, o: losses(s, scale32, o)[0]))(sink32, offsets)
    want_scale = jax.jit(jax.grad(lambda c, o: losses(sink32, c, o)[1]))(scale32, offsets)
    rows = dict(cu=cu, total=120, pad=QL.pad_rows) if packing == "varlen" else {}
    rows_per_head = np.size(x["lse"]) // np.size(sink32)
    _, dsink_magnitude = oracle.expected_dsink(np.asarray(sink32), np.asarray(x["lse"]), np.asarray(x["dpsum"]),
                                               **rows)

    def same_dsink(got, what):  # float32 values whatever got's dtype: one float32 rounding, not one float64's
        oracle.assert_dsink_reordered(np.asarray(got, np.float32), want[-1], sink32, x["lse"], x["dpsum"], what,
                                      **rows)

    def same_gradients(g_sink, g_scale):
        # d/dsink of sum(dsink * weights) sums the same terms as dsink, each times its head's weight (2 more for
        # exp, evaluated in each program's own fusion); d/dscale of sum(|dQ|) sums the magnitudes of the
        # accumulator's elements that dQ reads, without cancellation
        assert_within_roundings(np.asarray(g_sink, np.float32), want_sink, "the gradient in a float64 sink",
                                terms=rows_per_head + 2, magnitude=weights * dsink_magnitude)
        assert_within_roundings(np.asarray(g_scale, np.float32), want_scale, "the gradient in a float64 scale",
                                terms=np.size(want[0]))
    with jax.enable_x64(True):
        sink64 = jnp.asarray(np.asarray(sink32, np.float64), device=device)
        assert sink64.dtype == jnp.float64
        for scale in (float(scale32), jnp.float64(scale32), np.float64(scale32)):
            got = op(dict(x, sink=sink64, scale=scale, **offsets))
            traced = jax.jit(lambda s, c, o: op(dict(x, sink=s, scale=c, **o)))(sink64, jnp.float64(scale32), offsets)
            for outs in (got, traced):
                assert outs[-1].dtype == jnp.float64, outs[-1].dtype
                same_dsink(outs[-1], "dsink of a float64 sink and scale")
                for j in range(len(want) - 1):
                    assert_same_bits(outs[j], want[j], f"output {j} with a float64 sink and scale")
        g_sink = jax.jit(jax.grad(lambda s, o: losses(s, scale32, o)[0]))(sink64, offsets)
        g_scale = jax.jit(jax.grad(lambda c, o: losses(sink64, c, o)[1]))(jnp.float64(scale32), offsets)
        assert g_sink.dtype == jnp.float64 and g_scale.dtype == jnp.float64, (g_sink.dtype, g_scale.dtype)
        same_gradients(g_sink, g_scale)
    outs = op(dict(x, sink=np.asarray(sink32, np.float64), **offsets))  # jax's float32, without x64
    assert outs[-1].dtype == jnp.float32
    same_dsink(outs[-1], "dsink of a float64 numpy sink without x64")


# ---- dq_accum_from_dq, the op's transpose

@pytest.mark.parametrize("platform", PLATFORMS)
def test_dq_accum_from_dq_inverts_the_op_and_zeroes_padding(rng, platform):
    device = jax.devices(platform)[0]
    B, S, H = 2, 150, 3
    dq = jax.device_put(oracle.random_logical(rng, (B, S, H, D), specials=False).astype(jnp.bfloat16), device)
    acc = jax.jit(lambda x: dq_accum_from_dq(x, 1.0, layout=QL))(dq)
    assert acc.shape == QL.accum_shape(B, H, S, D) and acc.dtype == jnp.float32
    # Where each element goes: the independent producer emulation, with zeros in padding.
    want = oracle.build_accumulator(np.asarray(dq).astype(np.float32), oracle.layout_args(QL), hdim_multiple_of=32,
                                    rng=rng, padding="zeros")
    np.testing.assert_array_equal(np.asarray(acc), want)
    back = jax.jit(lambda a: dq_postprocess(a, 1.0, seqlen_q=S, head_dim=D, layout=QL))(acc)
    assert_same_bits(back, dq, "op(dq_accum_from_dq(dq)) == dq")
    # Scaled: one fp32 multiply per element.
    scaled = np.asarray(jax.jit(lambda x: dq_accum_from_dq(x, 0.375, layout=QL))(dq))
    np.testing.assert_array_equal(scaled, want * np.float32(0.375))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("offsets", ["static", "traced"])
def test_dq_accum_from_dq_varlen(rng, platform, offsets):
    device = jax.devices(platform)[0]
    cu, used, T, H = [0, 40, 40, 250], [40, 0, 100], 260, 2
    dq = oracle.random_logical(rng, (T, H, D), specials=False).astype(jnp.bfloat16)
    c, u = (cu, used) if offsets == "static" else (jnp.asarray(cu, jnp.int32), jnp.asarray(used, jnp.int32))
    acc = jax.jit(lambda x: dq_accum_from_dq(x, 1.0, cu_seqlens_q=c, seqused_q=u, layout=QL))(
        jax.device_put(dq, device))
    _, want_dq = oracle.varlen_case(rng, QL, cu, used, T, H, D, 1.0, jnp.bfloat16, logical=np.asarray(dq, np.float32))
    back = jax.jit(lambda a: dq_postprocess(a, 1.0, head_dim=D, total_q=T, cu_seqlens_q=c, seqused_q=u,
                                            layout=QL))(acc)
    assert_same_bits(back, want_dq, f"varlen round trip, {offsets} offsets")
    nonzero = int((np.asarray(acc) != 0).sum())
    assert nonzero == int((want_dq.astype(np.float32) != 0).sum()), "entries outside the read positions"


# Tiles of Dr in rows allocated for Da > Dr (alloc_hdim_multiple_of), and the head dims where the two differ.
ALLOC_CASES = [(AccumLayout(90, 64, 128, 1, False, 16, alloc_hdim_multiple_of=32), 72),
               (AccumLayout(90, 128, 256, 2, False, 16, alloc_hdim_multiple_of=32), 48),
               (AccumLayout(90, 64, 256, 1, False, 16, alloc_hdim_multiple_of=32), 104),
               (AccumLayout(None, 64, 256, 1, False, 16, alloc_hdim_multiple_of=64), 40)]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("layout, d", ALLOC_CASES, ids=["sm90-1wg-hd72", "sm90-2wg-hd48", "sm90-2wg-hd104",
                                                         "row-major-hd40"])
def test_dq_accum_from_dq_allocates_rows_wider_than_the_tiles(rng, platform, layout, d):
    """With ``alloc_hdim_multiple_of`` the transpose writes rows of ``Sr*Da`` (``Tp*Da``, packed), the tiles in the
    first ``Sr*Dr`` floats and zeros after them, as the producer emulation places them, and the op reads them back."""
    device = jax.devices(platform)[0]
    dr, da = round_up(d, 16), round_up(d, layout.alloc_hdim_multiple_of)
    assert da > dr
    B, S, H = 2, 150, 3
    dq = jax.device_put(oracle.random_logical(rng, (B, S, H, d), specials=False).astype(jnp.bfloat16), device)
    acc = np.asarray(jax.jit(lambda x: dq_accum_from_dq(x, 1.0, layout=layout))(dq))
    sr = round_up(S, layout.tile_m)
    assert acc.shape == layout.accum_shape(B, H, S, d) == (B, H, sr * da) and acc.dtype == np.float32
    assert not acc[..., sr * dr:].any(), "the unread tail"
    want = oracle.build_accumulator(np.asarray(dq).astype(np.float32), oracle.layout_args(layout), rng=rng,
                                    padding="zeros", **oracle.padding_args(layout))
    np.testing.assert_array_equal(acc, want)
    back = jax.jit(lambda a: dq_postprocess(a, 1.0, seqlen_q=S, head_dim=d, layout=layout))(acc)
    assert_same_bits(back, dq, "op(dq_accum_from_dq(dq)) == dq")
    # packed: (H, Tp*Da), the tiles in the first Tp*Dr floats of each head's row
    cu, used, T = [0, 40, 40, 250], [40, 0, 100], 260
    packed = oracle.random_logical(rng, (T, H, d), specials=False).astype(jnp.bfloat16)
    acc = np.asarray(jax.jit(lambda x: dq_accum_from_dq(x, 1.0, cu_seqlens_q=cu, seqused_q=used, layout=layout))(
        jax.device_put(packed, device)))
    tp = round_up(T + 3 * layout.tile_m, layout.tile_m)
    assert acc.shape == layout.varlen_accum_shape(3, H, T, d) == (H, tp * da)
    assert not acc[:, tp * dr:].any(), "the unread tail"
    _, want_dq = oracle.varlen_case(rng, layout, cu, used, T, H, d, 1.0, jnp.bfloat16,
                                    logical=np.asarray(packed, np.float32))
    back = jax.jit(lambda a: dq_postprocess(a, 1.0, head_dim=d, total_q=T, cu_seqlens_q=cu, seqused_q=used,
                                            layout=layout))(acc)
    assert_same_bits(back, want_dq, "varlen round trip")


# ---- sharding: 8 CPU devices, and every GPU of a machine with two or more

CPUS = jax.devices("cpu")
GPUS = jax.devices("cuda") if HAS_GPU else []
DEVICE_SETS = [pytest.param(CPUS, id=f"cpu{len(CPUS)}", marks=pytest.mark.skipif(
    len(CPUS) < 8, reason="needs --xla_force_host_platform_device_count=8"))]
DEVICE_SETS += [pytest.param(GPUS, id=f"cuda{len(GPUS)}")] if len(GPUS) >= 2 else []
SPECS = {"q": P("b", "h", None), "k": P("b", "h", None), "v": P("b", "h", None), "scale": P(), "k_scale": P(),
         "used_q": P("b"), "used_k": P("b"), "sink": P("h"), "lse": P("b", "h", None), "dpsum": P("b", "h", None)}


def _sharded(op, x, specs, devices, shape, names):
    """The compiled program's text and the result of ``op`` on ``x`` placed by ``specs`` over a mesh ``shape``."""
    mesh = Mesh(np.array(devices[: int(np.prod(shape))]).reshape(shape), names)
    shardings = {name: NamedSharding(mesh, specs[name]) for name in x}
    f = jax.jit(op, in_shardings=(shardings,))
    placed = {name: jax.device_put(v, shardings[name]) for name, v in x.items()}
    return f.lower(placed).compile().as_text(), f(placed), mesh


@pytest.mark.parametrize("devices", DEVICE_SETS)
@pytest.mark.parametrize("part, sink", [("dq", False), ("dqkv", True)])
def test_batch_and_heads_shard_without_collectives(rng, devices, part, sink):
    """Batch and heads sharded (key/value heads with their query heads): dq, dk and dv without a collective and with
    the unsharded op's bits. dsink: heads-sharded, no collective and the bits of the op on one device of that
    platform; batch-sharded, the one all-reduce of the per-shard float32 sums (close to the unsharded sum)."""
    x, static = problem(rng, part, "dense-seqused", sink=sink, batch=2, seqlens=(150, 100),
                        heads=tuple(h and 2 * h for h in HEADS[part]))
    op = make_op(part, static)
    want = jax.jit(op)(jax.device_put(x, CPUS[0]))
    one_device = jax.jit(op)(jax.device_put(x, devices[0]))
    if sink:
        _, magnitude = oracle.expected_dsink(x["sink"], x["lse"], x["dpsum"], seqused=x["used_q"])
        rows = x["lse"].shape[0] * x["lse"].shape[2]
    n = min(len(devices), 4)
    for shape in [(2, n // 2), (1, n)]:
        text, got, mesh = _sharded(op, x, SPECS, devices, shape, ("b", "h"))
        for j in range(len(got) - sink):
            assert_same_bits(got[j], want[j], f"output {j} sharded over {shape} of {devices[0].platform}")
        assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P("b", None, "h", None)), 4)
        found = COLLECTIVES.findall(text)
        if sink and shape[0] > 1:
            assert found == ["all-reduce"] and text.count("all-reduce(") == 1, found
        else:
            assert not found, f"collectives {found} in the program sharded over {shape}"
        if sink:  # per head, a float32 sum over every row of the batch, in the shards' order or one device's
            assert_within_roundings(got[-1], want[-1], f"dsink sharded over {shape}", terms=rows, magnitude=magnitude)
            assert_within_roundings(got[-1], one_device[-1], f"dsink sharded over {shape}, against one device",
                                    terms=rows, magnitude=magnitude)


@pytest.mark.parametrize("devices", DEVICE_SETS)
@pytest.mark.parametrize("part", PARTS)
def test_sharded_sequence_axis_is_gathered_correctly(rng, devices, part):
    x, static = problem(rng, part, "dense", batch=1, seqlens=(160, 128))
    op = make_op(part, static)
    want = jax.jit(op)(jax.device_put(x, CPUS[0]))
    specs = {name: P(None, None, "s") if name in ("q", "k", "v") else P() for name in x}
    text, got, _ = _sharded(op, x, specs, devices, (len(devices),), ("s",))
    assert COLLECTIVES.search(text), "a sequence-sharded accumulator must be gathered"
    for j in range(len(got)):
        assert_same_bits(got[j], want[j], f"sequence-sharded input, output {j}")


@pytest.mark.parametrize("devices", DEVICE_SETS)
@pytest.mark.parametrize("part, offsets", [("dq", "static"), ("dq", "traced"), ("dqkv", "traced")])
def test_varlen_heads_shard_without_collectives(rng, devices, part, offsets):
    cu = [0, 70, 70, 300]
    x, static = problem(rng, part, "varlen", cu=cu, total=310, heads=tuple(h and 2 * h for h in HEADS[part]))
    names = ("cu_q", "cu_k") if part == "dqkv" else ("cu_q",)
    if offsets == "static":
        static |= {ARG_NAMES[n]: cu for n in names}
    else:
        x |= {n: np.asarray(cu, np.int32) for n in names}
    op = make_op(part, static)
    want = jax.jit(op)(jax.device_put(x, CPUS[0]))
    n = min(len(devices), 4)
    specs = {name: P("h", None) if name in ("q", "k", "v") else P() for name in x}
    text, got, _ = _sharded(op, x, specs, devices, (n,), ("h",))
    assert not COLLECTIVES.search(text), f"collective in the heads-sharded varlen program ({offsets} offsets)"
    for j in range(len(got)):
        assert_same_bits(got[j], want[j], f"varlen sharded over heads ({offsets} offsets), output {j}")


@pytest.mark.skipif(len(CPUS) < 8, reason="needs --xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("part, sink", [("dq", False), ("dqkv", True)])
def test_sharded_export_through_shard_map(rng, part, sink):
    """jax.export cannot serialize custom_partitioning's callback: a plain jit over 8 devices raises one error naming
    jax_dqpost and the recipe; the recipe (jit of shard_map over batch and heads, dsink summed over the batch axis
    by the caller) exports for CPU and CUDA at once, serializes, and its round trip on 8 CPU devices gives the bits
    of the op's own sharded program (dsink, a float32 sum, within the roundings of another order)."""
    from jax_dqpost import DISABLED_CHECKS

    x, static = problem(rng, part, "dense-seqused", sink=sink, batch=2, seqlens=(150, 100),
                        heads=tuple(h and 2 * h for h in HEADS[part]))
    op = make_op(part, static)
    mesh = Mesh(np.array(CPUS[:8]).reshape(2, 4), ("b", "h"))
    shardings = {name: NamedSharding(mesh, SPECS[name]) for name in x}
    placed = {name: jax.device_put(v, shardings[name]) for name, v in x.items()}
    with pytest.raises(ValueError, match=r"^jax_dqpost: jax.export cannot serialize a program that partitions the op "
                                         r"over 8 devices .* export jax.jit\(jax.shard_map\(f, mesh=mesh"):
        jax.export.export(jax.jit(op), platforms=["cpu", "cuda"], disabled_checks=DISABLED_CHECKS)(placed)

    def per_shard(x):
        outs = op(x)
        return outs._replace(dsink=jax.lax.psum(outs.dsink, "b")) if sink else outs

    rows = P("b", None, "h", None)
    out_specs = (rows,) * (1 if part == "dq" else 3) if not sink else Gradients(rows, rows, rows, P("h"))
    recipe = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=({n: SPECS[n] for n in x},), out_specs=out_specs))
    exported = jax.export.export(recipe, platforms=["cpu", "cuda"], disabled_checks=DISABLED_CHECKS)(placed)
    restored = jax.export.deserialize(exported.serialize())
    got, want = restored.call(placed), jax.jit(op)(placed)
    for j in range(len(want) - sink):
        assert_same_bits(got[j], want[j], f"exported shard_map, output {j}")
    if sink:  # the shards' sums added by the psum: another order than the op's own sharded program may take
        oracle.assert_dsink_reordered(got[-1], want[-1], x["sink"], x["lse"], x["dpsum"], "exported shard_map",
                                      seqused=x["used_q"])


# ---- bound inside another primitive's own lowering (as fa4-jax's backward binds it)

def _outer_primitive(op, outs):
    """A primitive lowered with ``mlir.lower_fun(op)``: jax gives such a lowering no devices."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("test_outer_of_postprocess")
    prim.multiple_results = True
    prim.def_abstract_eval(lambda *args: [jax.core.ShapedArray(o.shape, o.dtype) for o in outs])
    mlir.register_lowering(prim, mlir.lower_fun(lambda *args: op(*args), multiple_results=True))
    return prim


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part", PARTS)
def test_inside_another_primitives_lowering(rng, platform, part):
    """One device, and 8 CPU devices with the operands sharded over batch: the bits of the op called directly."""
    x, static = problem(rng, part, "dense-seqused", batch=8)
    op = make_op(part, static)
    device = jax.devices(platform)[0]
    want = jax.jit(op)(jax.device_put(x, device))
    names = sorted(x)
    prim = _outer_primitive(lambda *args: op(dict(zip(names, args))), want)
    got = jax.jit(lambda x: prim.bind(*(x[n] for n in names)))(jax.device_put(x, device))
    for j in range(len(want)):
        assert_same_bits(got[j], want[j], f"nested on one {platform} device, output {j}")
    if platform == "cpu" and len(CPUS) >= 8:
        mesh = Mesh(np.array(CPUS[:8]), ("b",))
        placed = {n: jax.device_put(v, NamedSharding(mesh, P("b") if np.ndim(v) else P())) for n, v in x.items()}
        got = jax.jit(lambda x: prim.bind(*(x[n] for n in names)))(placed)
        for j in range(len(want)):
            assert_same_bits(got[j], want[j], f"nested in a program over 8 CPU devices, output {j}")


# ---- jax.grad inside shard_map with its default check (check_vma=True): the results vary as the operands do

VARYING = [("dq", "dense-seqused", False), ("dq", "varlen", False), ("dqkv", "dense-seqused", True)]
DIFFERENTIABLE = ("q", "k", "v", "scale", "k_scale", "sink", "lse", "dpsum")


def _varying(x) -> frozenset:
    from jax_dqpost import _jax_internals

    return _jax_internals.varying_axes(x)


@pytest.mark.skipif(len(CPUS) < 8, reason="needs --xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("part, packing, sink", VARYING, ids=["dq-dense", "dq-varlen", "dqkv-sink-dense"])
def test_grad_inside_shard_map_with_its_default_check(rng, part, packing, sink):
    """``jax.grad`` of a loss of the op's outputs inside ``jax.shard_map`` with its default check, over a (b, h) mesh
    (dense: batch and heads sharded; packed: heads, the offsets replicated): every output is typed varying over the
    union of its operands' axes (replicated scales, sink over ``h`` alone), and the gradients are the unsharded
    ``jax.grad``'s: the accumulators' (one multiply and one rounding) bit for bit, the replicated scales' (summed
    over the axes by jax itself) and the sink inputs' within the roundings of their float32 sums."""
    cu = [0, 30, 30, 110, 150]
    x, static = problem(rng, part, packing, sink=sink, batch=2, seqlens=(40, 24), cu=cu, total=150, specials=False,
                        heads=tuple(h and 2 * h for h in HEADS[part]))
    fixed = {n: x.pop(n) for n in list(x) if n not in DIFFERENTIABLE}
    if packing == "varlen":
        fixed |= {n: np.asarray(cu, np.int32) for n in (("cu_q", "cu_k") if part == "dqkv" else ("cu_q",))}
    op = make_op(part, static)
    with jax.default_device(CPUS[0]):  # on the sharded program's platform (another one's exp rounds otherwise)
        want_out = jax.jit(op)(dict(x, **fixed))
    # weights of the signs of the outputs: the scales' cotangents sum without cancellation
    weights = [np.where(np.asarray(o, np.float32) < 0, -1.0, 1.0).astype(np.float32)
               * rng.uniform(0.5, 1.5, o.shape).astype(np.float32) for o in want_out]
    seen = []

    def loss(x, fixed, weights):
        outs = op(dict(x, **fixed))
        seen.append([(_varying(o), "{V:" in str(jax.typeof(o))) for o in outs])
        return sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(outs, weights))

    mesh = Mesh(np.array(CPUS[:4]).reshape(2, 2), ("b", "h"))
    dense = packing != "varlen"
    specs = {n: SPECS[n] if dense or n in ("scale", "k_scale") else P("h", None) for n in x}
    fixed_specs = {n: SPECS[n] if dense else P() for n in fixed}
    rows = P("b", None, "h", None) if dense else P(None, "h", None)
    weight_specs = [rows] * (3 if part == "dqkv" else 1) + [P("h")] * sink
    got = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(specs, fixed_specs, weight_specs),
                                out_specs=specs))(x, fixed, weights)
    sharded, seen[:] = seen[:], []
    with jax.default_device(CPUS[0]):
        want = jax.jit(jax.grad(loss))(x, fixed, weights)
    axes = frozenset({"b", "h"} if dense else {"h"})
    assert sharded and all(s == [(axes, True)] * len(want_out) for s in sharded), sharded  # every output, dsink too
    assert seen and all(s == [(frozenset(), False)] * len(want_out) for s in seen), seen  # unsharded: none
    for name in ("q", "k", "v"):
        if name in x:
            assert_same_bits(got[name], want[name], f"the cotangent of {name}")
    for name in ("scale", "k_scale"):
        if name in x:
            assert_within_roundings(got[name], want[name], f"the cotangent of {name}",
                                    terms=int(np.prod(want_out[0].shape)))
    if sink:
        _, magnitude = oracle.expected_dsink(x["sink"], x["lse"], x["dpsum"], seqused=fixed["used_q"])
        rows = x["lse"].shape[0] * x["lse"].shape[2]
        assert_within_roundings(got["sink"], want["sink"], "the cotangent of the sink", roundings=2, terms=rows,
                                magnitude=magnitude * np.abs(weights[-1]))
        for name in ("lse", "dpsum"):  # elementwise: one formula, maybe fused otherwise
            assert_within_roundings(got[name], want[name], f"the cotangent of {name}", roundings=2)


@pytest.mark.skipif(len(CPUS) < 8, reason="needs --xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("packing", ["dense", "varlen"])
def test_round_trip_through_dq_accum_from_dq_inside_shard_map(rng, packing):
    """dq_accum_from_dq then dq_postprocess inside ``jax.shard_map`` with its default check: both results vary over
    the axes of dQ (a replicated traced scale and offsets added to them), and ``jax.grad`` in dQ (bits) and in the
    scale (summed over both axes by jax, within the roundings of its float32 sum) is the unsharded one's."""
    B, S, H, T = 2, 50, 4, 130
    cu = np.asarray([0, 40, 40, 130], np.int32)
    shape = (B, S, H, D) if packing == "dense" else (T, H, D)
    dq = jnp.asarray(np.abs(oracle.random_logical(rng, shape, specials=False)) + 0.5, jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 1.5, shape), jnp.float32)
    side = dict(seqlen_q=S) if packing == "dense" else dict(total_q=T)
    seen = []

    def loss(dq, scale, cu, w):
        offsets = {} if packing == "dense" else dict(cu_seqlens_q=cu)
        acc = dq_accum_from_dq(dq, scale, layout=QL, **offsets)
        out = dq_postprocess(acc, scale, head_dim=D, layout=QL, **side, **offsets)
        seen.append((_varying(acc), _varying(out)))
        return jnp.sum(out.astype(jnp.float32) * w)

    mesh = Mesh(np.array(CPUS[:4]).reshape(2, 2), ("b", "h"))
    rows = P("b", None, "h", None) if packing == "dense" else P(None, "h", None)
    grad = jax.grad(loss, argnums=(0, 1))
    got = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(rows, P(), P(), rows), out_specs=(rows, P())))(
        dq, jnp.float32(0.75), cu, w)
    axes = frozenset({"b", "h"} if packing == "dense" else {"h"})
    assert seen and all(s == (axes, axes) for s in seen), seen
    want = jax.jit(grad)(dq, jnp.float32(0.75), cu, w)
    assert_same_bits(got[0], want[0], "the cotangent of dq")
    assert_within_roundings(got[1], want[1], "the cotangent of the scale", terms=int(np.prod(shape)))
