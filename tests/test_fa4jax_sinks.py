"""Learnable sinks through ``jax_dqpost.fa4jax`` on a CUDA GPU (fa4-jax 0.1.0 and torch): FlashAttention-4's forward
kernel given the sink, fa4-jax's backward kernels, one jax-dqpost launch for dQ (dK, dV) and dsink, against plain
attention with a sink column.

The reference is torch autograd (``fa4_peer.attention_grads``) on the same bf16/fp16 inputs in float32 (float64 for
dsink), per packed sequence; the bound (``attention_judge.judge``'s ``"magnitude"`` rule) is twice the error of the
same computation in the inputs' dtype plus twice the float32 rounding and a 16-bit result's own rounding at the
reference's magnitude, for out, lse, dq, dk, dv and dsink. dsink also equals its own formula summed in float64 from
the forward's out and lse (the preprocess's ``D = rowsum(out * d_out)`` reads the rounded out, as FlashAttention's
does), within float32's rounding of the sum's scale: a reduction over a wrong row would pass a bf16-scaled bound.
Sinks N(0, 2), +20 and -inf; -inf gives the out bits of fa4-jax's own attention without a sink and its lse within a
few ulp (``LSE_ULPS``). The cross product of grouping, masking and packing at head dims 64 and 128; one case for
every other head dim fa4-jax runs on Hopper (136..160 padded).
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_judge import judge, reference, sequences, used_rows
from conftest import HAS_GPU
import fa4_peer
from support import bits, cu_seqlens

HAS_FA4JAX = importlib.util.find_spec("fa4_jax") is not None
pytestmark = pytest.mark.skipif(not (HAS_GPU and HAS_FA4JAX and importlib.util.find_spec("torch")),
                                reason="needs a CUDA GPU, fa4-jax (Python >= 3.12) and torch")

H = 8
B, S, SK = 2, 300, 333  # no tile divides them; causal rows all see a key
S_CAUSAL_SHORT_K = 333, 290  # dense causal with S > Sk: rows 0..42 see no key (lse = the sink)
LENS_Q, LENS_K = (127, 0, 200, 61, 1), (150, 5, 180, 61, 1)  # a zero-length sequence; 200 > 180: rows with no key
USED_Q, USED_K = (127, 0, 190, 61, 1), (150, 5, 180, 40, 1)
MASKS = {"full": dict(), "causal": dict(causal=True), "local": dict(window_size=(128, 0))}  # gpt-oss's window
HEADS_KV = {"mha": H, "gqa": 2, "mqa": 1}
RTOL = dict(out=2, lse=2, dq=2, dk=2, dv=2, dsink=4)
DSINK_REL = 2 ** -12
"""dsink's error against its sum taken in float64 from what the kernels computed (the forward's out and lse, the
lse's cotangent), relative to the sum's scale ``sum_rows |P_sink (D - d_lse)|``: the postprocess's float32 reduction
is far inside; a wrong row, sign or lse is far outside."""


def _cases():
    out = []
    for d in (64, 128):
        for grouping in HEADS_KV:
            for mask in MASKS:
                for packing in ("dense", "varlen"):
                    out.append(dict(head_dim=d, grouping=grouping, mask=mask, packing=packing, dtype="bf16"))
    others = [d for d in range(8, 257, 8) if d not in (64, 128)]
    for i, d in enumerate(others):  # one each, through the combinations in turn
        out.append(dict(head_dim=d, grouping=list(HEADS_KV)[i % 3], mask=list(MASKS)[i % 3],
                        packing=("dense", "varlen")[i % 2], dtype="bf16"))
    out += [dict(head_dim=128, grouping="gqa", mask="causal", packing="dense", dtype="fp16"),
            dict(head_dim=64, grouping="gqa", mask="local", packing="varlen", dtype="fp16", sink_dtype="bf16"),
            dict(head_dim=64, grouping="mha", mask="causal", packing="dense", dtype="bf16", sink_dtype="fp16",
                 short_k=True),
            dict(head_dim=128, grouping="mqa", mask="causal", packing="varlen", dtype="bf16", static=True)]
    return out


def case_id(c) -> str:
    extra = [f"sink-{c['sink_dtype']}"] if c.get("sink_dtype") else []
    extra += ["s-gt-sk"] if c.get("short_k") else []
    extra += ["static"] if c.get("static") else []
    return "-".join([f"hd{c['head_dim']}", c["grouping"], c["mask"], c["packing"], c["dtype"], *extra])


CASES = _cases()
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def _inputs(torch, seed, c):
    """Torch tensors on the GPU: q, k, v, d_out, d_lse (lse-shaped: (B, H, S) or (H, T)), in the case's dtype."""
    gen = torch.Generator(device="cuda").manual_seed(seed % 2**31)
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[c["dtype"]])

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype)

    hk, d = HEADS_KV[c["grouping"]], c["head_dim"]
    if c["packing"] == "varlen":
        rows_q, rows_k = (sum(LENS_Q),), (sum(LENS_K),)
        lse_shape = (H, sum(LENS_Q))
    else:
        s, s_k = S_CAUSAL_SHORT_K if c.get("short_k") else (S, SK)
        rows_q, rows_k, lse_shape = (B, s), (B, s_k), (B, H, s)
    return (randn(*rows_q, H, d), randn(*rows_k, hk, d), randn(*rows_k, hk, d), randn(*rows_q, H, d),
            randn(*lse_shape, dtype=torch.float32))


def _attention(c) -> dict:
    """The case's keywords of ``attention_judge.reference``: its mask, scale and (packed) the used rows of each
    sequence."""
    mask = MASKS[c["mask"]]
    return dict(causal=mask.get("causal", False), window=mask.get("window_size", (None, None)),
                scale=c["head_dim"] ** -0.5,
                packed=sequences(LENS_Q, LENS_K, USED_Q, USED_K) if c["packing"] == "varlen" else None)


def _used(c, side):
    """Boolean rows a sequence uses (packed), or None (dense: all)."""
    if c["packing"] == "dense":
        return None
    return used_rows(LENS_Q, USED_Q) if side == "q" else used_rows(LENS_K, USED_K)


def _run(c, q, k, v, sink, d_out, d_lse):
    """Ours, jitted, offsets traced (static with ``c['static']``): ``(out, lse, dq, dk, dv, dsink)``; without
    ``d_lse`` the lse is not returned by the function differentiated (its cotangent is a symbolic zero)."""
    from jax_dqpost import fa4jax

    packed = c["packing"] == "varlen"
    kw = MASKS[c["mask"]]
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    used = dict(seqused_q=np.asarray(USED_Q, np.int32), seqused_k=np.asarray(USED_K, np.int32))

    def attention(q, k, v, sink, offsets):
        if packed:
            cq, ck, uq, uk = offsets if offsets is not None else (cu_q, cu_k, used["seqused_q"], used["seqused_k"])
            return fa4jax.flash_attn_varlen(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, learnable_sink=sink,
                                            return_lse=True, **kw)
        return fa4jax.flash_attn(q, k, v, learnable_sink=sink, return_lse=True, **kw)

    @jax.jit
    def run(q, k, v, sink, d_out, d_lse, offsets):
        if d_lse is None:
            out, lse = attention(q, k, v, sink, offsets)
            _, vjp = jax.vjp(lambda *a: attention(*a, offsets)[0], q, k, v, sink)
            return (out, lse, *vjp(d_out))
        (out, lse), vjp = jax.vjp(lambda *a: attention(*a, offsets), q, k, v, sink)
        return (out, lse, *vjp((d_out, d_lse)))

    offsets = None if c.get("static") or not packed else tuple(
        jnp.asarray(x, jnp.int32) for x in (cu_q, cu_k, used["seqused_q"], used["seqused_k"]))
    return run(q, k, v, sink, d_out, d_lse, offsets)


def _fa4jax_without_sink(c, q, k, v):
    """fa4-jax's own attention (its kernel backend), no sink: ``(out, lse)``."""
    import fa4_jax

    kw = dict(MASKS[c["mask"]], backend="cute", return_lse=True)
    if c["packing"] == "varlen":
        cu_q, cu_k = (jnp.asarray(cu_seqlens(x)) for x in (LENS_Q, LENS_K))
        return jax.jit(lambda q, k, v: fa4_jax.flash_attn_varlen(
            q, k, v, cu_q, cu_k, seqused_q=jnp.asarray(USED_Q, jnp.int32), seqused_k=jnp.asarray(USED_K, jnp.int32),
            **kw))(q, k, v)
    return jax.jit(lambda q, k, v: fa4_jax.flash_attn(q, k, v, **kw))(q, k, v)


def _dsink_of(c, out, lse, d_out, d_lse, sink, rows):
    """``(dsink, scale)`` in float64 from what the kernels computed: ``sum -P_sink (D - d_lse)`` over the used rows,
    ``D = rowsum(out * d_out)`` of the rounded out, ``P_sink = exp(sink - lse)`` (1 where lse is -inf, as the op
    defines it), and ``sum |P_sink (D - d_lse)|``."""
    out, d_out, lse = np.asarray(out), np.asarray(d_out), np.asarray(lse)
    d_lse = None if d_lse is None else np.asarray(d_lse)
    if rows is not None:  # the used rows alone (before any cast: the others may hold anything)
        out, d_out, lse = out[rows], d_out[rows], lse[:, rows]
        d_lse = None if d_lse is None else d_lse[:, rows]
    d = (out.astype(np.float64) * d_out.astype(np.float64)).sum(-1)  # (B, S, H) or (T, H)
    d = d.transpose(0, 2, 1) if c["packing"] == "dense" else d.T  # as the lse: (B, H, S) or (H, T)
    if d_lse is not None:
        d = d - d_lse.astype(np.float64)
    lse = lse.astype(np.float64)
    s = np.asarray(jnp.asarray(fa4_peer.to_numpy(sink)), np.float64).reshape(-1, 1)
    with np.errstate(invalid="ignore"):
        p = np.where(np.isneginf(lse), 1.0, np.exp(s - lse))
    term = -p * d
    axes = (0, 2) if c["packing"] == "dense" else (1,)
    return term.sum(axis=axes), np.abs(term).sum(axis=axes)


SINKS = ("normal", "+20", "-inf")
LSE_ULPS = 4
"""How far a -inf sink's lse may be from fa4-jax's own (no sink), in ulps of the largest lse: its finalize fuses
``row_max * scale_log2 + log2(row_sum)`` into one fma, the sink path rounds the product first, an error of an ulp of
the product, which can be many ulps of a small lse."""


@pytest.mark.parametrize("c", CASES, ids=[case_id(c) for c in CASES])
def test_attention_with_a_sink_is_right(seed, c):
    """Forward and backward for sinks N(0, 2) (with a cotangent on the lse), +20 and -inf (the out cotangent alone),
    against the reference (module docstring)."""
    import torch

    tq, tk, tv, td, tdl = _inputs(torch, seed, c)
    q, k, v, d_out = (jnp.asarray(fa4_peer.to_numpy(t)) for t in (tq, tk, tv, td))
    d_lse = jnp.asarray(tdl.cpu().numpy())
    sink_torch = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(c.get("sink_dtype"), torch.float32)
    gen = torch.Generator(device="cuda").manual_seed((seed + 1) % 2**31)
    low_dtype = tq.dtype
    rows_q, rows_k = _used(c, "q"), _used(c, "k")
    failures = {}
    for value in SINKS:
        sink = {"normal": torch.randn(H, generator=gen, device="cuda") * 2, "+20": torch.full((H,), 20.0),
                "-inf": torch.full((H,), float("-inf"))}[value].to("cuda", sink_torch)
        with_lse = value == "normal"
        got = _run(c, q, k, v, jnp.asarray(fa4_peer.to_numpy(sink)), d_out, d_lse if with_lse else None)
        out, lse, dq, dk, dv, dsink = got
        assert dsink.dtype == jnp.dtype(fa4_peer.to_numpy(sink).dtype) and dsink.shape == (H,)
        refs = {dt: reference(tq, tk, tv, td, dtype=dt, sink=sink.float(), d_lse=tdl if with_lse else None,
                              **_attention(c))
                for dt in (torch.float32, torch.float64, low_dtype)}
        for name, g, rows in (("out", out, rows_q), ("lse", lse, rows_q), ("dq", dq, rows_q), ("dk", dk, rows_k),
                              ("dv", dv, rows_k), ("dsink", dsink, None)):
            ref = refs[torch.float64 if name == "dsink" else torch.float32][name]
            err, tol = judge(g, ref, refs[low_dtype][name], RTOL[name], rule="magnitude", rows=rows,
                             lse=name == "lse", finite=True)
            if not err <= tol:
                failures[f"{value} {name}"] = (err, tol)
        want, terms = _dsink_of(c, out, lse, d_out, d_lse if with_lse else None, sink, rows_q)
        dsink_err = np.abs(np.asarray(dsink, np.float64) - want)
        allowed = DSINK_REL * terms + float(jnp.finfo(dsink.dtype).eps) * np.abs(want)  # dsink in the sink's dtype
        if not np.all(dsink_err <= allowed):
            failures[f"{value} dsink vs its sum"] = (float(np.max(dsink_err / np.maximum(terms, 1e-30))), DSINK_REL)
        # Rows no sequence uses: dq 0 (and dk, dv under grouped-query attention, which our op writes).
        for name, g, rows in (("dq", dq, rows_q),) + ((("dk", dk, rows_k), ("dv", dv, rows_k))
                                                      if c["grouping"] != "mha" else ()):
            if rows is not None:
                assert not np.asarray(g)[~rows].any(), f"{value}: {name} on rows no sequence uses"
        # Rows with no key and a -inf sink: lse -inf (the reference's is its -1e4 sink); out is judged above.
        if value == "-inf":
            no_key = refs[torch.float32]["lse"].cpu().numpy() < -1e3
            if rows_q is not None:
                no_key &= rows_q[None]
            assert np.all(np.asarray(lse)[no_key] == -np.inf), "lse of rows with no key and a -inf sink"
        if value == "-inf" and c["head_dim"] in (64, 128) and not c.get("sink_dtype") and c["dtype"] == "bf16":
            own_out, own_lse = _fa4jax_without_sink(c, q, k, v)
            keep = slice(None) if rows_q is None else rows_q
            np.testing.assert_array_equal(bits(out)[keep], bits(own_out)[keep], err_msg="-inf sink: out")
            a, b_ = (np.asarray(x)[..., keep] for x in (lse, own_lse))
            finite = np.isfinite(b_)
            assert np.array_equal(np.isfinite(a), finite) and np.array_equal(a[~finite], b_[~finite])
            bound = LSE_ULPS * float(np.finfo(np.float32).eps) * float(np.max(np.abs(b_[finite]), initial=0))
            assert np.all(np.abs(a[finite] - b_[finite]) <= bound), "-inf sink: lse beyond fa4-jax's own"
    assert not failures, f"{case_id(c)}: beyond the tolerance against the mathematics: {failures}"


@pytest.mark.parametrize("c", [dict(head_dim=64, grouping="gqa", mask="causal", packing="dense", dtype="bf16"),
                               dict(head_dim=128, grouping="mha", mask="full", packing="varlen", dtype="bf16")],
                         ids=case_id)
def test_the_lse_cotangent_without_a_sink(seed, c):
    """fa4-jax's own attention through our backend (no sink), differentiated through out and the lse."""
    import torch

    from jax_dqpost import fa4jax

    tq, tk, tv, td, tdl = _inputs(torch, seed, c)
    q, k, v, d_out = (jnp.asarray(fa4_peer.to_numpy(t)) for t in (tq, tk, tv, td))
    packed = c["packing"] == "varlen"
    cu_q, cu_k = (jnp.asarray(cu_seqlens(x)) for x in (LENS_Q, LENS_K))
    used = dict(seqused_q=jnp.asarray(USED_Q, jnp.int32), seqused_k=jnp.asarray(USED_K, jnp.int32))

    def attention(q, k, v):
        if packed:
            return fa4jax.flash_attn_varlen(q, k, v, cu_q, cu_k, return_lse=True, **used, **MASKS[c["mask"]])
        return fa4jax.flash_attn(q, k, v, return_lse=True, **MASKS[c["mask"]])

    @jax.jit
    def grads(q, k, v, d_out, d_lse):
        _, vjp = jax.vjp(attention, q, k, v)
        return vjp((d_out, d_lse))

    got = grads(q, k, v, d_out, jnp.asarray(tdl.cpu().numpy()))
    refs = {dt: reference(tq, tk, tv, td, dtype=dt, d_lse=tdl, **_attention(c)) for dt in (torch.float32, tq.dtype)}
    for name, g, rows in zip(("dq", "dk", "dv"), got, (_used(c, "q"), _used(c, "k"), _used(c, "k"))):
        err, tol = judge(g, refs[torch.float32][name], refs[tq.dtype][name], RTOL[name], rule="magnitude", rows=rows,
                         finite=True)
        assert err <= tol, f"{name}: {err} beyond {tol}"


# ---- transformations with the real kernels

def _small(rng, heads_kv, batch=2):
    """Sequences of 64 rows: one q tile and one kv tile per head, so each accumulator element sums at most two terms
    and two backward runs agree bit for bit (tests/test_fa4jax.py)."""
    def arr(*shape, dtype=jnp.bfloat16):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    return (arr(batch, 64, 4, 64), arr(batch, 64, heads_kv, 64), arr(batch, 64, heads_kv, 64),
            arr(4, dtype=jnp.float32) * 2, arr(batch, 64, 4, 64, dtype=jnp.float32))


def _loss(q, k, v, sink, w):
    from jax_dqpost import fa4jax

    return jnp.sum(fa4jax.flash_attn(q, k, v, learnable_sink=sink, causal=True).astype(jnp.float32) * w)


def _same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{what}: gradient {i}")


@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
def test_vmap_remat_and_the_sink_alone(rng, heads_kv):
    """vmap of grad with a shared sink (folded into the batch: per-example dsink), remat, and the sink's gradient
    alone give the bits of the plain gradient."""
    grad = jax.grad(_loss, argnums=(0, 1, 2, 3))
    q, k, v, sink, w = _small(rng, heads_kv)
    q2, k2, v2, _, w2 = _small(rng, heads_kv)
    stacked = [jnp.stack(pair) for pair in ((q, q2), (k, k2), (v, v2), (w, w2))]
    batched = jax.jit(jax.vmap(grad, in_axes=(0, 0, 0, None, 0)))(*stacked[:3], sink, stacked[3])
    for i, args in enumerate(((q, k, v, sink, w), (q2, k2, v2, sink, w2))):
        one = jax.jit(grad)(*args)
        _same([g[i] for g in batched], one, f"vmap, example {i}")
        assert np.count_nonzero(np.asarray(one[3])) == 4
    whole = jax.jit(grad)(q, k, v, sink, w)
    _same(jax.jit(jax.grad(jax.checkpoint(_loss), argnums=(0, 1, 2, 3)))(q, k, v, sink, w), whole, "remat")
    _same([jax.jit(jax.grad(_loss, argnums=3))(q, k, v, sink, w)], whole[3:], "the sink alone")


@pytest.mark.parametrize("check_vma", [True, False], ids=["default-checks", "unchecked"])
def test_shard_map_over_the_batch_sums_dsink(rng, check_vma):
    """Each device runs its batch shard; dsink summed over the devices is the whole batch's: by jax's AD under
    shard_map's default checks (the kernels' results typed with their inputs' varying axes), by a ``psum``
    without them."""
    from jax.sharding import Mesh, PartitionSpec as P

    n = len(jax.devices())
    q, k, v, sink, w = _small(rng, 2, batch=2 * n)
    grad = jax.grad(_loss, argnums=(0, 1, 2, 3))

    def per_shard(q, k, v, sink, w):
        dq, dk, dv, dsink = grad(q, k, v, sink, w)
        return dq, dk, dv, dsink if check_vma else jax.lax.psum(dsink, "d")

    spec = P("d")
    sharded = jax.jit(jax.shard_map(per_shard, mesh=Mesh(np.array(jax.devices()), ("d",)),
                                    in_specs=(spec, spec, spec, P(), spec), out_specs=(spec, spec, spec, P()),
                                    check_vma=check_vma))
    got = sharded(q, k, v, sink, w)
    want = jax.jit(grad)(q, k, v, sink, w)
    _same(got[:3], want[:3], "shard_map")
    # (summed in another order: to float32's rounding of the terms' scale)
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want[3]), rtol=1e-5,
                               atol=1e-5 * float(np.abs(np.asarray(want[3])).max()))
