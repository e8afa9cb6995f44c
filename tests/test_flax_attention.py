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
from support import assert_within_roundings

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
    (dict(module=object()), "no attention weights to sow"),
    (dict(precision=jax.lax.Precision.HIGHEST), "takes precision=None"),
    (dict(qk_attn_weights_einsum=jnp.einsum), "qk_attn_weights_einsum must be None"),
], ids=["dropout", "sow", "precision", "einsum"])
def test_what_it_cannot_honour_is_refused_in_one_line(kwargs, words):
    q = jnp.zeros((1, T, HEADS, 8), jnp.float32)
    with pytest.raises(ValueError) as info:
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
