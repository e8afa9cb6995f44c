"""``jax_dqpost.dot_product_attention`` on any platform: ``'xla'`` against ``jax.nn.dot_product_attention`` and,
with sinks, against float64 formulas (tests/attention_oracle.py); the ``'fa4'`` translation of jax.nn's masks
into FlashAttention's, run through ``jax_dqpost._attention.fa4``'s jax.numpy path; the choice of implementation; the
transformations; and every refusal. The kernels themselves: tests/test_gpu_attention.py."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_oracle as oracle64
from conftest import HAS_GPU
from jax_dqpost import attention, dot_product_attention
from jax_dqpost._attention import fa4 as fa4_kernels
from jax_dqpost.attention import fa4 as fa4_impl
from jax_dqpost.attention.call import FlashMask, Unsupported, make_call
from support import assert_close_to_scale as _close, assert_within_roundings

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# Of the largest magnitude: float32 arithmetic against float64, and bf16 inputs with probabilities rounded to bf16
# before they meet the values (and the cotangents that come back through that rounding).
OUT_REL = {jnp.float32: 2 ** -16, jnp.bfloat16: 2 ** -6, jnp.float16: 2 ** -9}
GRAD_REL = {jnp.float32: 2 ** -14, jnp.bfloat16: 2 ** -5, jnp.float16: 2 ** -8}


def _case(rng, dtype, *, sinks=False, masks=True, lengths=True, bias=True, gqa=True):
    """Random inputs and keywords of one call: GQA or not, T != S or not, a causal mask, a window, lengths, a boolean
    mask and a bias, each or not."""
    b = int(rng.integers(1, 3))
    t, s = (int(x) for x in rng.integers(3, 12, 2))
    heads_kv = int(rng.choice([1, 2]))
    n = heads_kv * (int(rng.choice([1, 2, 3])) if gqa else 1)
    h = int(rng.choice([8, 16]))
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, s, heads_kv, h)), dtype) for _ in range(2))
    kw = {}
    if masks and rng.random() < 0.5:
        kw["is_causal"] = True
    if masks and rng.random() < 0.5:
        kw["local_window_size"] = (int(rng.integers(0, 5)), int(rng.integers(0, 5)))
    if lengths and rng.random() < 0.5:
        kw["query_seq_lengths"] = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32)
    if lengths and rng.random() < 0.5:
        kw["key_value_seq_lengths"] = jnp.asarray(rng.integers(1, s + 1, b), jnp.int32)
    if masks and rng.random() < 0.3:
        kw["mask"] = jnp.asarray(rng.random((b, int(rng.choice([1, n])), t, s)) < 0.8)
    if bias and rng.random() < 0.3:
        kw["bias"] = jnp.asarray(rng.standard_normal((1, n, t, s)), dtype)
    if rng.random() < 0.3:
        kw["scale"] = float(rng.uniform(0.1, 0.5))
    if sinks:
        kw["sinks"] = jnp.asarray(rng.standard_normal(n) * 2, jnp.float32)
    return (q, k, v), kw


def _visible(q, k, kw):
    """The oracle's ``(B|1, N|1, T, S)`` of what jax.nn's keywords let a query see."""
    t, s = q.shape[1], k.shape[1]
    vis = oracle64.top_left(t, s, causal=kw.get("is_causal", False), window=kw.get("local_window_size"))[None, None]
    if "query_seq_lengths" in kw or "key_value_seq_lengths" in kw:
        vis = vis & oracle64.lengths_mask(t, s, kw.get("query_seq_lengths"), kw.get("key_value_seq_lengths"))
    if "mask" in kw:
        vis = vis & np.asarray(kw["mask"])
    return vis


def _rows(q, kw):
    """``(B, T, 1, 1)``: the rows jax.nn does not zero (under the query lengths)."""
    t = q.shape[1]
    if "query_seq_lengths" not in kw:
        return np.ones((q.shape[0], t, 1, 1), bool)
    return (np.arange(t)[None] < np.asarray(kw["query_seq_lengths"])[:, None])[:, :, None, None]


def _loss(attend, weights, kw):
    def loss(q, k, v, sinks=None):
        extra = {} if sinks is None else {"sinks": sinks}
        return jnp.sum(attend(q, k, v, **kw, **extra).astype(jnp.float32) * weights)
    return loss


def _call(q, k, v, **kw):
    """The checked record of a call with jax.nn's keywords."""
    names = dict(query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None, sinks=None,
                 precision=None, return_residual=False, scale=None, is_causal=False)
    names.update({key: x for key, x in kw.items() if key not in ("bias", "mask")})
    return make_call(q, k, v, kw.get("bias"), kw.get("mask"), **names)


# ---- 'xla' ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_xla_is_jax_nns_attention_without_sinks(rng, dtype):
    """Out, residual and the gradients of query, key and value: jax.nn's, to the rounding of a sum's order."""
    for _ in range(12):
        (q, k, v), kw = _case(rng, dtype)
        ours = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, **kw, implementation="xla",
                                                             return_residual=True))(q, k, v)
        theirs = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw, implementation="xla",
                                                                      return_residual=True))(q, k, v)
        for name, g, w in zip(("out", "residual"), ours, theirs):
            assert g.dtype == w.dtype, name
            assert_within_roundings(g, w, f"{name} {sorted(kw)}", terms=64)
        w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        grads = jax.jit(jax.grad(_loss(lambda *a, **o: dot_product_attention(*a, **o, implementation="xla"), w, kw),
                                 argnums=(0, 1, 2)))(q, k, v)
        want = jax.jit(jax.grad(_loss(lambda *a, **o: jax.nn.dot_product_attention(*a, **o, implementation="xla"),
                                      w, kw), argnums=(0, 1, 2)))(q, k, v)
        for name, g, t in zip(("dq", "dk", "dv"), grads, want):
            assert_within_roundings(g, t, f"{name} {sorted(kw)}", roundings=2, terms=256)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
def test_xla_with_sinks_is_the_float64_formula(rng, dtype):
    """Out, the residual and the gradients of query, key, value and sinks against float64 formulas, masks,
    windows, lengths, bias and grouped heads drawn at random; fp16 runs on CPU too."""
    for _ in range(10):
        (q, k, v), kw = _case(rng, dtype, sinks=True)
        sinks = kw.pop("sinks")
        scale = kw.get("scale", q.shape[-1] ** -0.5)
        vis, rows = _visible(q, k, kw), _rows(q, kw)
        bias = None if "bias" not in kw else np.asarray(kw["bias"], np.float64)
        args64 = dict(scale=scale, visible=vis, bias=bias, sinks=np.asarray(sinks))
        out64, lse64, _, _ = oracle64.forward(q, k, v, **args64)
        out, residual = jax.jit(lambda q, k, v, s: dot_product_attention(
            q, k, v, **kw, sinks=s, implementation="xla", return_residual=True))(q, k, v, sinks)
        _close(out, out64 * rows, OUT_REL[dtype], f"out {sorted(kw)}")
        _close(residual, lse64.transpose(0, 2, 1), OUT_REL[dtype], f"residual {sorted(kw)}")
        w = rng.standard_normal(out.shape)
        grads = jax.jit(jax.grad(_loss(lambda *a, **o: dot_product_attention(*a, **o, implementation="xla"),
                                       jnp.asarray(w, jnp.float32), kw), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
        want = oracle64.gradients(q, k, v, w * rows, **args64)
        for name, g, t, x in zip(("dq", "dk", "dv", "dsinks"), grads, want, (q, k, v, sinks)):
            assert g.dtype == x.dtype and g.shape == x.shape, name
            _close(g, t, GRAD_REL[dtype], f"{name} {sorted(kw)}")


def test_the_oracle_is_jax_nns_attention():
    """The float64 formulas without sinks give jax.nn's float32 attention (rows that see nothing average)."""
    rng = np.random.default_rng(5)
    for _ in range(6):
        (q, k, v), kw = _case(rng, jnp.float32)
        scale = kw.get("scale", q.shape[-1] ** -0.5)
        bias = None if "bias" not in kw else np.asarray(kw["bias"], np.float64)
        out64, _, _, _ = oracle64.forward(q, k, v, scale=scale, visible=_visible(q, k, kw), bias=bias)
        _close(jax.nn.dot_product_attention(q, k, v, **kw), out64 * _rows(q, kw), 2 ** -16, sorted(kw))


def test_a_row_that_sees_nothing_averages_without_sinks_and_is_zero_with_them(rng):
    q, k, v = (jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32) for _ in range(3))
    mask = jnp.ones((1, 1, 4, 4), bool).at[0, 0, 2].set(False)
    out = dot_product_attention(q, k, v, mask=mask, implementation="xla")
    assert_within_roundings(out[0, 2], v[0].mean(0), "a row that sees nothing", roundings=2, terms=8,
                            magnitude=np.abs(np.asarray(v)).max())
    out = dot_product_attention(q, k, v, mask=mask, sinks=jnp.zeros(2), implementation="xla")
    assert not np.asarray(out[0, 2]).any() and np.asarray(out[0, 1]).all()


# ---- 'fa4': jax.nn's masks in FlashAttention's alignment ----------------------------------------------------------

def _fa4_case(rng, kind):
    """Inputs whose masks 'fa4' expresses, of one kind: causal/window without lengths (any T, S), one lengths
    array for both, or query lengths alone."""
    b, n, heads_kv, h = 2, 4, 2, 16
    t = int(rng.integers(3, 12))
    s = t if kind != "dense" else int(rng.integers(3, 12))
    if kind == "query-lengths":
        s = t + int(rng.integers(0, 4))
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, s, heads_kv, h)), jnp.float32) for _ in range(2))
    kw = {"is_causal": bool(rng.random() < 0.5)}
    if rng.random() < 0.6 or not kw["is_causal"]:
        right = 0 if kw["is_causal"] else int(rng.integers(0, 3))
        kw["local_window_size"] = (int(rng.integers(max(0, t - s), t + 2)), right)
    if kind == "same-lengths":
        kw["query_seq_lengths"] = kw["key_value_seq_lengths"] = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32)
    if kind == "query-lengths":
        kw["query_seq_lengths"] = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32)
        if "local_window_size" in kw:
            left, right = kw["local_window_size"]
            kw["local_window_size"] = (left, min(right, s - t))
    if rng.random() < 0.5:
        kw["sinks"] = jnp.asarray(rng.standard_normal(n), jnp.float32)
    return (q, k, v), kw


@pytest.mark.parametrize("kind", ["dense", "same-lengths", "query-lengths"])
def test_fa4s_translation_is_jax_nns_attention(rng, kind, monkeypatch):
    """'fa4' runs jax.nn's top-left masks as FlashAttention's bottom-right ones (keys cut, the window shifted; with
    lengths, FlashAttention's packed batch on the used lengths). Run through its jax.numpy path, its out,
    residual and gradients are 'xla''s on every row that sees a key."""
    monkeypatch.setattr(fa4_kernels, "on_gpu", lambda: False)  # also on a GPU machine (its kernels take no float32)
    for _ in range(8):
        (q, k, v), kw = _fa4_case(rng, kind)
        request = _call(q, k, v, return_residual=True, **kw)
        plan = fa4_impl.translate(request)
        assert isinstance(plan, FlashMask), (kw, plan)
        vis = np.broadcast_to(_visible(q, k, kw), (q.shape[0], 1, q.shape[1], k.shape[1]))
        seen = (vis.any(-1)[:, 0] & _rows(q, kw)[:, :, 0, 0])[:, :, None, None]  # (B, T, 1, 1)
        out, residual = request.finish(fa4_impl.Fa4().run(request, plan))
        want, want_res = dot_product_attention(q, k, v, **kw, implementation="xla", return_residual=True)
        assert_within_roundings(np.where(seen, out, 0), np.where(seen, want, 0), f"out {kw}", terms=64)
        assert_within_roundings(np.where(seen[..., 0], residual, 0), np.where(seen[..., 0], want_res, 0),
                                f"residual {kw}", roundings=2, terms=64)
        assert not np.asarray(np.where(seen, 0, out)).any(), "rows that see no key are 0"
        w = jnp.asarray(rng.standard_normal(q.shape) * seen, jnp.float32)
        args = (q, k, v) + ((kw["sinks"],) if "sinks" in kw else ())
        kw_ = {key: x for key, x in kw.items() if key != "sinks"}

        def fa4_path(q, k, v, sinks=None, **o):
            r = _call(q, k, v, sinks=sinks, **o)
            return r.finish(fa4_impl.Fa4().run(r, fa4_impl.translate(r)))

        argnums = tuple(range(len(args)))
        got = jax.grad(_loss(fa4_path, w, kw_), argnums=argnums)(*args)
        want = jax.grad(_loss(lambda *a, **o: dot_product_attention(*a, **o, implementation="xla"), w, kw_),
                        argnums=argnums)(*args)
        for name, g, t in zip(("dq", "dk", "dv", "dsinks"), got, want):
            assert_within_roundings(g, t, f"{name} {kw}", roundings=2, terms=256)


@pytest.mark.parametrize("shape, kw, expect", [
    ((8, 8), dict(is_causal=True), ((None, 0), 8)),
    ((5, 8), dict(is_causal=True), ((None, 0), 5)),  # the keys no query sees are not read
    ((8, 5), dict(is_causal=True), ((None, 3), 5)),
    ((256, 256), dict(local_window_size=(127, 0)), ((127, 0), 256)),
    ((8, 8), dict(local_window_size=(2 ** 40, 0)), ((16, 0), 8)),  # a side wider than T + S sees as much
    ((6, 9), dict(local_window_size=(2, 1)), ((3, 0), 7)),
    ((9, 6), dict(local_window_size=(4, 2)), ((1, 5), 6)),
    ((8, 8), dict(), ((None, None), 8)),
])
def test_fa4_plans_express_top_left_masks(shape, kw, expect):
    t, s = shape
    q = jnp.zeros((1, t, 2, 8), jnp.bfloat16)
    k = jnp.zeros((1, s, 2, 8), jnp.bfloat16)
    plan = fa4_impl.translate(_call(q, k, k, **kw))
    assert (plan.window, plan.keys) == expect


LENGTHS = jnp.asarray([3, 5], jnp.int32)


@pytest.mark.parametrize("kw, words", [
    (dict(bias=jnp.zeros((1, 2, 8, 8))), "takes no bias"),
    (dict(mask=jnp.ones((1, 1, 8, 8), bool)), "takes no mask array (it takes is_causal, local_window_size"),
    (dict(is_causal=True, key_value_seq_lengths=LENGTHS), "query_seq_lengths and key_value_seq_lengths are one"),
    (dict(is_causal=True, query_seq_lengths=LENGTHS, key_value_seq_lengths=jnp.asarray([3, 4], jnp.int32)),
     "aligns each sequence on its own lengths"),
    (dict(is_causal=True, bias=jnp.zeros((8, 8)), scale=jnp.float32(0.3)), "takes no bias"),
], ids=["bias", "mask", "kv-lengths-causal", "two-lengths-causal", "bias-first"])
def test_fa4_plans_refuse_what_they_cannot_express(kw, words):
    q = jnp.zeros((2, 8, 2, 8), jnp.bfloat16)
    with pytest.raises(Unsupported) as info:
        fa4_impl.translate(_call(q, q, q, **kw))
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_fa4_plans_take_one_lengths_array_for_both():
    q = jnp.zeros((2, 8, 2, 8), jnp.bfloat16)
    for q_len, kv_len in ((LENGTHS, LENGTHS), (np.array([3, 5]), np.array([3, 5]))):
        plan = fa4_impl.translate(_call(q, q, q, is_causal=True, query_seq_lengths=q_len,
                                        key_value_seq_lengths=kv_len))
        np.testing.assert_array_equal(plan.used_q, [3, 5])
        np.testing.assert_array_equal(plan.used_k, [3, 5])


# ---- which implementation runs ----------------------------------------------------------------------------------

@pytest.mark.skipif(HAS_GPU, reason="a GPU machine runs 'fa4': tests/test_gpu_attention.py")
def test_without_a_gpu_fa4_is_refused_and_none_runs_xla_quietly(rng):
    (q, k, v), kw = _case(rng, jnp.bfloat16, masks=False, lengths=False, bias=False)
    with pytest.raises(ValueError) as info:
        dot_product_attention(q, k, v, implementation="fa4")
    assert "implementation='fa4' cannot run this call: it runs on NVIDIA GPUs and JAX's default backend is 'cpu'" \
        in str(info.value) and "\n" not in str(info.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = dot_product_attention(q, k, v, **kw)
    np.testing.assert_array_equal(got, dot_product_attention(q, k, v, **kw, implementation="xla"))


def test_fa4_refuses_what_it_cannot_express_before_looking_for_a_gpu(monkeypatch):
    """On a GPU machine the same refusals come first: a bias names itself, float32 the dtypes."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q = jnp.zeros((1, 8, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="its kernels take bfloat16 and float16, and the query is float32"):
        dot_product_attention(q, q, q, implementation="fa4")
    q = q.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="cannot run this call: it takes no bias; implementation='xla' runs"):
        dot_product_attention(q, q, q, bias=jnp.zeros((1, 1, 8, 8)), implementation="fa4")


def test_on_a_gpu_none_falls_back_with_one_warning_per_reason(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention, "_WARNED", set())
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 2, 8)), jnp.bfloat16)
    bias = jnp.zeros((1, 1, 8, 8), jnp.bfloat16)
    with pytest.warns(UserWarning, match="runs implementation='xla' here, as 'fa4' cannot: it takes no bias"):
        got = dot_product_attention(q, q, q, bias=bias)
    np.testing.assert_array_equal(got, dot_product_attention(q, q, q, bias=bias, implementation="xla"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dot_product_attention(q, q, q, bias=bias)  # the same reason: no second warning


def test_cudnn_is_jax_nns_and_takes_no_sinks():
    q = jnp.zeros((1, 8, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='cudnn' cannot run this call: cuDNN's attention takes no "
                                         "sinks; implementation='xla' runs every call, sinks too"):
        dot_product_attention(q, q, q, sinks=jnp.zeros(2), implementation="cudnn")


@pytest.mark.skipif(HAS_GPU, reason="cuDNN runs on a GPU machine")
def test_cudnn_without_a_gpu_points_to_xla():
    q = jnp.zeros((1, 8, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError) as info:
        dot_product_attention(q, q, q, implementation="cudnn")
    assert str(info.value) == ("implementation='cudnn' cannot run this call: cuDNN's attention runs on NVIDIA GPUs, "
                               "and JAX's default backend is 'cpu'; implementation='xla' runs every call, sinks too")


# ---- transformations ----------------------------------------------------------------------------------------------

def test_vmap_jit_checkpoint_and_forward_mode(rng):
    (q, k, v), kw = _case(rng, jnp.float32, sinks=True, gqa=True)
    sinks = kw.pop("sinks")
    f = lambda q, k, v, s: dot_product_attention(q, k, v, **kw, sinks=s, implementation="xla")  # noqa: E731
    qs, ks, vs = (jnp.stack([x, x[::-1]]) for x in (q, k, v))
    mapped = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None)))(qs, ks, vs, sinks)
    for i in range(2):
        assert_within_roundings(mapped[i], f(qs[i], ks[i], vs[i], sinks), f"vmap {i}", terms=64)
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    loss = _loss(lambda *a, **o: dot_product_attention(*a, **o, implementation="xla"), w, kw)
    plain = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), remat, plain):
        assert_within_roundings(g, r, name, terms=256)
    _, tangent = jax.jvp(lambda s: f(q, k, v, s), (sinks,), (jnp.ones_like(sinks),))
    assert np.isfinite(np.asarray(tangent)).all() and np.asarray(tangent).any()


def test_three_dimensional_inputs(rng):
    q, k, v = (jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.float32) for _ in range(3))
    out, res = dot_product_attention(q, k, v, is_causal=True, implementation="xla", return_residual=True)
    want, want_res = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    assert out.shape == (6, 2, 8) and res.shape == (6, 2)
    assert_within_roundings(out, want, "out", terms=16)
    assert_within_roundings(res, want_res, "residual", terms=16)


@pytest.mark.parametrize("check_vma", [True, False], ids=["default-checks", "unchecked"])
def test_shard_map_over_the_batch_sums_the_sinks_gradient(rng, check_vma):
    """jax.grad inside jax.shard_map: with jax's default checks, the replicated sinks' gradient comes back summed
    over the batch shards by jax; without them, a psum of each shard's does."""
    from jax.sharding import Mesh, PartitionSpec as P

    q, k, v = (jnp.asarray(rng.standard_normal((4, 6, 4, 8)), jnp.bfloat16) for _ in range(3))
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def grads(q, k, v, s, w):
        return jax.grad(lambda q, k, v, s: jnp.sum(dot_product_attention(q, k, v, is_causal=True, sinks=s,
                                                                         implementation="xla")
                                                   .astype(jnp.float32) * w), argnums=(0, 1, 2, 3))(q, k, v, s)

    def local(q, k, v, s, w):
        g = grads(q, k, v, s, w)
        return (*g[:3], g[3] if check_vma else jax.lax.psum(g[3], "d"))

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    spec = P("d")
    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(), spec),
                                out_specs=(spec, spec, spec, P()), check_vma=check_vma))(q, k, v, sinks, w)
    want = jax.jit(grads)(q, k, v, sinks, w)
    for name, g, t in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert_within_roundings(g, t, name, terms=256 + (q.shape[0] * q.shape[1] if name == "dsinks" else 0))


def test_float64_sinks_and_scale_under_x64(rng):
    """Under jax_enable_x64 a float64 sink and scale are taken as jax's own ops take them: read in float32, the
    sinks' gradient float64."""
    with jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64():
        q, k, v = (jnp.asarray(rng.standard_normal((1, 5, 2, 8)), jnp.bfloat16) for _ in range(3))
        sinks = jnp.zeros(2)
        assert sinks.dtype == jnp.float64
        g = jax.grad(lambda s: jnp.sum(dot_product_attention(q, k, v, sinks=s, scale=jnp.float64(0.3),
                                                             implementation="xla").astype(jnp.float32)))(sinks)
        assert g.dtype == jnp.float64 and np.isfinite(np.asarray(g)).all()
        want = jax.grad(lambda s: jnp.sum(dot_product_attention(q, k, v, sinks=s, scale=0.3, implementation="xla")
                                          .astype(jnp.float32)))(sinks.astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(g, np.float32), want)


# ---- refusals: the argument and its value, one line ---------------------------------------------------------------

Q = jnp.zeros((2, 8, 4, 16), jnp.bfloat16)
KV = jnp.zeros((2, 8, 2, 16), jnp.bfloat16)


@pytest.mark.parametrize("args, kw, error, words", [
    ((Q, KV, KV[..., :8]), {}, ValueError, "value must have key's shape and dtype (2, 8, 2, 16) bfloat16, got "
                                           "(2, 8, 2, 8) bfloat16"),
    ((Q.astype(jnp.float16), KV, KV), {}, ValueError, "query must be (B, T, N, H) = (2, T, N, 16) of key's dtype"),
    ((Q[..., :3, :], KV, KV), {}, ValueError, "the query heads (3) must be a multiple of the key/value heads (2)"),
    ((Q[0, 0], KV, KV), {}, ValueError, "query must be (B, T, N, H) or (T, N, H) (jax.nn's layout), got shape "
                                        "(4, 16)"),
    (("q", KV, KV), {}, TypeError, "query must be an array, got 'q' (str)"),
    ((Q.astype(jnp.int32), KV.astype(jnp.int32), KV.astype(jnp.int32)), {}, TypeError,
     "query, key and value must be of one of bfloat16, float16, float32, float64, complex64, complex128, got int32 "
     "(cast them to a floating dtype)"),
    ((Q, KV, KV), dict(mask=jnp.ones((2, 4, 8, 8), jnp.int32)), TypeError, "mask must be boolean"),
    ((Q, KV, KV), dict(mask=jnp.ones((1, 2, 4, 8, 8), bool)), ValueError, "mask must have at most 4 dimensions, "
                                                                          "broadcastable to (B, N, T, S) = "
                                                                          "(2, 4, 8, 8), got shape (1, 2, 4, 8, 8)"),
    ((Q, KV, KV), dict(mask=jnp.ones((3, 8, 8), bool)), ValueError, "mask must broadcast to (B, N, T, S) = (2, 4, 8, "
                                                                     "8) with 1 or 4 heads, got shape (1, 3, 8, 8) "
                                                                     "(leading axes of 1 added to make it 4-D)"),
    ((Q, KV, KV), dict(bias=jnp.ones((2, 3, 8, 8))), ValueError, "bias must broadcast to (B, N, T, S) = "
                                                                  "(2, 4, 8, 8) with 1 or 4 heads, got shape"),
    ((Q, KV, KV), dict(query_seq_lengths=jnp.ones(3, jnp.int32)), ValueError,
     "query_seq_lengths must be an integer array of shape (B,) = (2,), got int32 (3,)"),
    ((Q, KV, KV), dict(key_value_seq_lengths=jnp.ones(2)), ValueError, "key_value_seq_lengths must be an integer"),
    ((Q, KV, KV), dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size must be an int or a (left, "
                                                                 "right) pair of ints, got (1, 2, 3) (tuple)"),
    ((Q, KV, KV), dict(scale="0.1"), TypeError, "scale must be a Python float or a floating-point scalar, got "
                                                 "'0.1' (str)"),
    ((Q, KV, KV), dict(sinks=jnp.zeros(2)), ValueError, "sinks must have shape (N,) = (4,), one logit per query "
                                                         "head, got shape (2,)"),
    ((Q, KV, KV), dict(sinks=jnp.zeros(4, jnp.int32)), TypeError, "sinks must be floating-point"),
    ((Q, KV, KV), dict(implementation="flash"), ValueError, "implementation must be one of 'fa4', 'xla', "
                                                            "'xla_chunked', 'cudnn' or None, got 'flash' (str)"),
    ((Q, KV, KV), dict(local_window_size=(-1, 0)), ValueError, "local_window_size must not be negative, got (-1, 0)"),
    ((Q, KV, KV), dict(precision="fast"), TypeError, "precision must be None or a jax.lax.Precision (DEFAULT, HIGH, "
                                                     "HIGHEST), got 'fast' (str)"),
    ((Q, KV, KV), dict(sinks=np.zeros((4, 10000))), ValueError, "sinks must have shape (N,) = (4,), one logit per "
                                                                 "query head, got shape (4, 10000)"),
    ((Q, KV, KV), dict(scale=np.zeros(10000)), TypeError, "scale must be a Python float or a floating-point scalar, "
                                                           "got ndarray of shape (10000,) and dtype float64"),
    ((Q, KV, KV), dict(is_causal=1), TypeError, "is_causal must be a bool, got 1 (int)"),
], ids=["value-shape", "dtypes", "heads", "rank", "str", "integers", "mask-dtype", "mask-rank", "mask-heads",
        "bias-heads", "q-lengths", "kv-lengths-dtype", "window", "scale", "sinks-shape", "sinks-dtype",
        "implementation", "negative-window", "precision", "large-sinks", "large-scale", "is-causal"])
def test_a_wrong_argument_is_named_in_one_line(args, kw, error, words):
    with pytest.raises(error) as info:
        dot_product_attention(*args, **kw)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


# ---- what jax.nn takes, taken ---------------------------------------------------------------------------------------

def test_masks_and_biases_of_fewer_dimensions_are_jax_nns(rng):
    """jax.nn adds leading axes of 1 to a mask or bias of fewer than 4 dimensions: ``(S,)``, ``(1, 1, S)``,
    ``(T, S)``, and a ``(T, S)`` bias under ``jax.vmap`` of unbatched calls."""
    q, k, v = (jnp.asarray(rng.standard_normal((2, 6, 4, 8)), jnp.float32) for _ in range(3))
    for kw in (dict(mask=jnp.asarray(rng.random(6) < 0.7).at[0].set(True)),
               dict(mask=jnp.asarray(rng.random((1, 1, 6)) < 0.7).at[..., 0].set(True)),
               dict(bias=jnp.asarray(rng.standard_normal((6, 6)), jnp.float32)),
               dict(bias=jnp.asarray(rng.standard_normal((4, 6, 6)), jnp.float32), is_causal=True)):
        got = dot_product_attention(q, k, v, **kw, implementation="xla")
        assert_within_roundings(got, jax.nn.dot_product_attention(q, k, v, **kw), sorted(kw), terms=64)
    bias = jnp.asarray(rng.standard_normal((2, 6, 6)), jnp.float32)
    got = jax.vmap(lambda q, k, v, b: dot_product_attention(q, k, v, bias=b))(q, k, v, bias)
    want = jax.vmap(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b))(q, k, v, bias)
    assert_within_roundings(got, want, "vmapped (T, S) bias", terms=64)


def test_array_likes_are_taken(rng):
    """Python lists for q, k, v, the mask, the lengths and the sinks, and an ``nnx.Param`` as the sinks: the result
    of the same call with arrays."""
    from flax import nnx

    q, k, v = (rng.standard_normal((2, 5, 2, 8)).astype(np.float32) for _ in range(3))
    mask, lengths, sinks = rng.random((5, 5)) < 0.8, [3, 5], [0.5, -1.0]
    want = dot_product_attention(*(jnp.asarray(x) for x in (q, k, v)), mask=jnp.asarray(mask),
                                 query_seq_lengths=jnp.asarray(lengths), sinks=jnp.asarray(sinks))
    got = dot_product_attention(q.tolist(), k.tolist(), v.tolist(), mask=mask.tolist(), query_seq_lengths=lengths,
                                sinks=sinks)
    np.testing.assert_array_equal(got, want)
    param = nnx.Param(jnp.asarray(sinks, jnp.float32))
    np.testing.assert_array_equal(dot_product_attention(q, k, v, mask=mask, query_seq_lengths=lengths, sinks=param),
                                  want)


def test_complex_inputs_and_head_dim_zero_are_jax_nns(rng):
    q = jnp.asarray(rng.standard_normal((1, 5, 2, 8)) + 1j * rng.standard_normal((1, 5, 2, 8)), jnp.complex64)
    got = dot_product_attention(q, q, q, is_causal=True)
    assert got.dtype == jnp.complex64
    with warnings.catch_warnings():  # jax.nn casts the complex logits to float32 (jax deprecates the cast)
        warnings.simplefilter("ignore", DeprecationWarning)
        want = jax.nn.dot_product_attention(q, q, q, is_causal=True)
    for part in (np.real, np.imag):
        assert_within_roundings(part(got), part(want), f"complex {part.__name__}", terms=64)
    empty = jnp.zeros((2, 5, 2, 0), jnp.float32)
    out, residual = dot_product_attention(empty, empty, empty, return_residual=True)
    assert out.shape == (2, 5, 2, 0)
    np.testing.assert_allclose(residual, np.log(5), rtol=1e-6)  # every logit 0: log(S)


def test_a_window_wider_than_the_sequences_is_none():
    q = jnp.asarray(np.random.default_rng(1).standard_normal((1, 6, 2, 8)), jnp.float32)
    want = dot_product_attention(q, q, q, is_causal=True)
    np.testing.assert_array_equal(dot_product_attention(q, q, q, is_causal=True, local_window_size=(2 ** 40, 0)),
                                  want)
    np.testing.assert_array_equal(dot_product_attention(q, q, q, is_causal=True, local_window_size=2 ** 70), want)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_an_infinite_sink_takes_the_whole_row(rng, implementation):
    """``sinks=+inf``: the limit of a growing sink, every output of its head 0 and its residual ``+inf``; the
    other heads are the finite call's; the gradients finite, 0 for that sink."""
    q, k, v = (jnp.asarray(rng.standard_normal((2, 5, 4, 8)), jnp.float32) for _ in range(3))
    sinks = jnp.asarray([np.inf, 0.5, -np.inf, 1.0], jnp.float32)
    out, residual = dot_product_attention(q, k, v, sinks=sinks, is_causal=True, implementation=implementation,
                                          return_residual=True)
    finite, finite_res = dot_product_attention(q, k, v, sinks=sinks.at[0].set(0.0), is_causal=True,
                                               implementation=implementation, return_residual=True)
    assert not np.asarray(out[:, :, 0]).any() and np.isposinf(np.asarray(residual[:, :, 0])).all()
    np.testing.assert_array_equal(out[:, :, 1:], finite[:, :, 1:])
    np.testing.assert_array_equal(residual[:, :, 1:], finite_res[:, :, 1:])
    grads = jax.grad(lambda q, s: jnp.sum(dot_product_attention(q, k, v, sinks=s, is_causal=True,
                                                                implementation=implementation) ** 2),
                     argnums=(0, 1))(q, sinks)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert grads[1][0] == 0 and grads[1][2] == 0 and not np.asarray(grads[0][:, :, 0]).any()


def test_none_plans_each_implementation_at_most_once(monkeypatch):
    """On a GPU (faked) a call 'fa4' cannot run plans 'fa4' once and 'xla' once, runs 'xla' and warns; above the
    logits limit it runs 'xla_chunked'."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention, "_WARNED", set())
    counts = {}
    for impl in attention.ORDER:
        def counting(self, call, _plan=type(impl).plan):
            counts[self.name] = counts.get(self.name, 0) + 1
            return _plan(self, call)
        monkeypatch.setattr(type(impl), "plan", counting)
    q = jnp.zeros((1, 8, 2, 8), jnp.bfloat16)
    with pytest.warns(UserWarning, match="runs implementation='xla' here, as 'fa4' cannot: it takes no bias"):
        dot_product_attention(q, q, q, bias=jnp.zeros((8, 8), jnp.bfloat16))
    assert counts == {"fa4": 1, "xla": 1}, counts
    counts.clear()
    from jax_dqpost.attention import xla as xla_impl

    monkeypatch.setattr(attention, "ORDER", (attention.ORDER[0], xla_impl.Xla(max_logits=8 * 8 * 2 - 1),
                                             attention.ORDER[2]))
    monkeypatch.setattr(attention, "_WARNED", set())  # (the reason was warned once already)
    with pytest.warns(UserWarning, match="runs implementation='xla_chunked' here, as 'fa4' cannot: it takes no"):
        got = dot_product_attention(q, q, q, bias=jnp.zeros((8, 8), jnp.bfloat16))
    assert counts == {"fa4": 1, "xla": 1, "xla_chunked": 1}, counts
    np.testing.assert_array_equal(got, dot_product_attention(q, q, q, bias=jnp.zeros((8, 8), jnp.bfloat16),
                                                             implementation="xla_chunked"))
