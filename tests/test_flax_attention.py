"""``jax_dqpost.flax_attention_fn`` as flax's ``attention_fn``: nnx's and linen's multi-head attention give what
their own attention gives, every argument they pass honoured or refused in one line."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from jax_dqpost import dot_product_attention, flax_attention_fn
from support import assert_close_to_scale, assert_within_roundings

# flax's float32 modules: on a GPU, the default implementation runs 'xla' and says so once (tests/test_attention.py
# checks that warning)
pytestmark = pytest.mark.filterwarnings("ignore:jax_dqpost.dot_product_attention runs implementation='xla' here")

B, T, F, HEADS = 2, 12, 32, 4


def _nnx(attention_fn=nnx.dot_product_attention, **kwargs):
    return nnx.MultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(0), attention_fn=attention_fn, **kwargs)


@pytest.mark.parametrize("masking", ["none", "mask", "is_causal"])
def test_nnx_multihead_attention_runs_it(rng, masking):
    x = jnp.asarray(rng.standard_normal((B, T, F)), jnp.float32)
    kwargs = {}
    if masking == "mask":
        kwargs["mask"] = jnp.asarray(rng.random((B, 1, T, T)) < 0.7)
    elif masking == "is_causal":
        kwargs["is_causal"] = True
    theirs, ours = _nnx()(x, **kwargs), _nnx(flax_attention_fn)(x, **kwargs)
    assert_within_roundings(ours, theirs, masking, roundings=2, terms=64)
    if masking != "none":  # the mask was honoured: without it the output differs
        assert not np.allclose(ours, _nnx(flax_attention_fn)(x), atol=1e-3)


def test_linen_multihead_attention_runs_it(rng):
    x = jnp.asarray(rng.standard_normal((B, T, F)), jnp.float32)
    mask = linen.make_causal_mask(jnp.ones((B, T)))
    theirs = linen.MultiHeadDotProductAttention(num_heads=HEADS)
    ours = linen.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=flax_attention_fn)
    params = theirs.init(jax.random.key(0), x, mask=mask)
    assert_within_roundings(ours.apply(params, x, mask=mask), theirs.apply(params, x, mask=mask), "linen",
                            roundings=2, terms=64)


def test_a_partial_picks_the_options(rng):
    """``functools.partial`` sets sinks, a window, the implementation; they reach the attention."""
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, HEADS, 8)), jnp.bfloat16) for _ in range(3))
    sinks = jnp.asarray(rng.standard_normal(HEADS), jnp.float32)
    fn = functools.partial(flax_attention_fn, sinks=sinks, local_window_size=(3, 0), implementation="xla")
    want = dot_product_attention(q, k, v, sinks=sinks, local_window_size=(3, 0), implementation="xla")
    np.testing.assert_array_equal(fn(q, k, v), want)
    out = _nnx(fn)(jnp.asarray(rng.standard_normal((B, T, F)), jnp.float32))
    assert out.shape == (B, T, F)
    with pytest.raises(ValueError, match="implementation='fa4' cannot run this call"):  # (a mask array: GPUs too)
        functools.partial(flax_attention_fn, implementation="fa4")(q, k, v, mask=jnp.ones((B, 1, T, T), bool))


def test_more_than_one_batch_axis(rng):
    q, k, v = (jnp.asarray(rng.standard_normal((2, 3, T, HEADS, 8)), jnp.float32) for _ in range(3))
    got = flax_attention_fn(q, k, v, is_causal=True)
    assert got.shape == q.shape
    want = nnx.dot_product_attention(q, k, v, is_causal=True)
    assert_within_roundings(got, want, "two batch axes", roundings=2, terms=64)


@pytest.mark.parametrize("kwargs, words", [
    (dict(dropout_rate=0.1, deterministic=False), "does no dropout: dropout_rate=0.1 with deterministic=False"),
    (dict(dropout_rate=0.1, deterministic=None), "dropout_rate=0.1 with deterministic=None"),
    (dict(module=object()), "no attention weights to sow: it was given module=object (flax passes the module where "
                            "sow_weights=True"),
    (dict(precision="fast"), "precision must be None or a jax.lax.Precision"),
    (dict(qk_attn_weights_einsum=jnp.einsum), "qk_attn_weights_einsum must be None"),
], ids=["dropout", "dropout-none", "sow", "precision", "einsum"])
def test_what_it_cannot_honour_is_refused_in_one_line(kwargs, words):
    q = jnp.zeros((1, T, HEADS, 8), jnp.float32)
    with pytest.raises(TypeError if "precision" in kwargs else ValueError) as info:
        flax_attention_fn(q, q, q, **kwargs)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_dropout_off_or_deterministic_runs(rng):
    q = jnp.asarray(rng.standard_normal((1, T, HEADS, 8)), jnp.float32)
    want = flax_attention_fn(q, q, q)
    np.testing.assert_array_equal(flax_attention_fn(q, q, q, dropout_rate=0.1, deterministic=True), want)
    out = _nnx(flax_attention_fn, dropout_rate=0.1)(jnp.ones((B, T, F)), deterministic=True)
    assert out.shape == (B, T, F)
    with pytest.raises(ValueError, match="does no dropout"):
        _nnx(flax_attention_fn, dropout_rate=0.1)(jnp.ones((B, T, F)), deterministic=False, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("precision", [None, jax.lax.Precision.DEFAULT, "highest",
                                       (jax.lax.Precision.HIGH, jax.lax.Precision.HIGH)])
def test_a_precision_is_taken(rng, precision):
    """flax's modules pass their ``precision``; float32 products at HIGH or HIGHEST say so in the program."""
    q = jnp.asarray(rng.standard_normal((1, T, HEADS, 8)), jnp.float32)
    want = flax_attention_fn(q, q, q)  # at the tests' default, "highest" (conftest.py)
    got = flax_attention_fn(q, q, q, precision=precision)
    if isinstance(precision, tuple) and jax.default_backend() == "gpu":
        # HIGH on a GPU is XLA's choice of a faster float32 product (on an H100, 2**-11 of the output's scale):
        # a few roundings of a 10-bit mantissa, not float32's; the program's text below says HIGH was asked
        assert_close_to_scale(got, want, 2 ** -9, "HIGH")
    else:
        assert_within_roundings(got, want, str(precision), roundings=2, terms=64)
    with jax.default_matmul_precision("default"):  # (the tests' own default is "highest": conftest.py)
        text = str(jax.make_jaxpr(lambda q: flax_attention_fn(q, q, q, precision=precision))(q))
    named = {None: None, jax.lax.Precision.DEFAULT: None, "highest": "HIGHEST"}.get(precision, "HIGH")
    assert (named is None) == ("Precision.HIGH" not in text), text
    if named:
        assert text.count(f"Precision.{named}") >= 2, text  # both products
    assert _nnx(flax_attention_fn, precision=precision)(jnp.ones((B, T, F))).shape == (B, T, F)


def test_causal_by_nnxs_call_and_by_linens_partial(rng):
    """nnx passes its own ``is_causal`` (the module's call sets it); linen passes none, so a partial's holds."""
    x = jnp.asarray(rng.standard_normal((B, T, F)), jnp.float32)
    assert_within_roundings(_nnx(flax_attention_fn)(x, is_causal=True), _nnx()(x, is_causal=True), "nnx",
                            roundings=2, terms=64)
    theirs = linen.MultiHeadDotProductAttention(num_heads=HEADS)
    ours = linen.MultiHeadDotProductAttention(num_heads=HEADS,
                                              attention_fn=functools.partial(flax_attention_fn, is_causal=True))
    params = theirs.init(jax.random.key(0), x)
    mask = linen.make_causal_mask(jnp.ones((B, T)))
    assert_within_roundings(ours.apply(params, x), theirs.apply(params, x, mask=mask), "linen partial", roundings=2,
                            terms=64)


class _SinkAttention(nnx.Module):
    """flax's multi-head attention with one learnable sink per head, as flax_attention_fn's docstring shows."""

    def __init__(self, rngs):
        self.sinks = nnx.Param(jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32))
        self.mha = _nnx(flax_attention_fn)

    def __call__(self, x):
        self.mha.attention_fn = functools.partial(flax_attention_fn, sinks=self.sinks)
        try:
            return self.mha(x, is_causal=True)
        finally:
            self.mha.attention_fn = flax_attention_fn


def test_sinks_learned_through_an_nnx_param(rng):
    """An ``nnx.Param`` is taken as the sinks, and ``nnx.grad`` under ``nnx.jit`` reaches it: the sinks' gradient
    is the derivative of the loss, checked by a central difference in float32."""
    x = jnp.asarray(rng.standard_normal((B, T, F)), jnp.float32)
    layer = _SinkAttention(nnx.Rngs(0))

    def loss(layer, x):
        return jnp.sum(layer(x) ** 2)

    grads = nnx.jit(nnx.grad(loss))(layer, x)
    g = np.asarray(grads["sinks"][...])
    assert g.shape == (HEADS,) and np.abs(g).min() > 0
    for h in range(HEADS):
        step = np.zeros(HEADS, np.float32)
        step[h] = 1e-2
        values = []
        for sign in (1, -1):
            shifted = _SinkAttention(nnx.Rngs(0))
            shifted.sinks[...] = layer.sinks[...] + sign * step
            values.append(float(loss(shifted, x)))
        np.testing.assert_allclose(g[h], (values[0] - values[1]) / 2e-2, rtol=2e-2)


def test_decode_mode_on_an_unbatched_input(rng):
    """nnx's decode mode on an unbatched ``(T, F)`` input passes a ``(1, 1, 1)`` mask, which jax.nn takes: so do
    we, with flax's own result."""
    x = jnp.asarray(rng.standard_normal((1, F)), jnp.float32)
    outs = []
    for fn in (nnx.dot_product_attention, flax_attention_fn):
        layer = nnx.MultiHeadAttention(HEADS, F, decode=True, rngs=nnx.Rngs(0), attention_fn=fn)
        layer.init_cache((4, F))
        outs.append(layer(x))
    assert_within_roundings(outs[1], outs[0], "decode", roundings=2, terms=16)
