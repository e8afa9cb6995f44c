""":func:`flax_attention_fn`: :func:`~jax_dqpost.dot_product_attention` as flax's ``attention_fn``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .._checks import describe


def flax_attention_fn(query: ArrayLike, key: ArrayLike, value: ArrayLike, bias: ArrayLike | None = None,
                      mask: ArrayLike | None = None, broadcast_dropout: bool = True, dropout_rng=None,
                      dropout_rate: float = 0.0, deterministic: bool | None = False, dtype=None, precision=None,
                      module=None, promote_dtype=None, is_causal: bool = False, *, scale: float | None = None,
                      query_seq_lengths: ArrayLike | None = None, key_value_seq_lengths: ArrayLike | None = None,
                      local_window_size: int | tuple[int, int] | None = None, sinks: ArrayLike | None = None,
                      implementation: str | None = None, force_fp32_for_softmax: bool = False,
                      einsum_dot_general=None, qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                      context_axis: str | None = None, context_layout: str = "contiguous") -> jax.Array:
    """:func:`~jax_dqpost.dot_product_attention` as flax's ``attention_fn``: ``flax.nnx.dot_product_attention``'s
    signature (and ``flax.linen``'s keywords), so that ``nnx.MultiHeadAttention(..., attention_fn=flax_attention_fn)``
    and ``linen.MultiHeadDotProductAttention(..., attention_fn=flax_attention_fn)`` run it.

    ``functools.partial`` sets the keyword-only options (``implementation``, ``sinks``, ``local_window_size``,
    ...). Causal attention: in nnx, call the module with ``is_causal=True``; nnx passes its own ``is_causal`` to
    every call (off while decoding one token at a time), which overrides a partial's. In linen, which passes none,
    ``functools.partial(flax_attention_fn, is_causal=True)``.

    Learnable sinks in an nnx module: keep them as an ``nnx.Param`` of shape ``(N,)`` and bind them for the call
    (an ``nnx.Param`` is taken as it is, and ``nnx.grad`` reaches it)::

        class SinkAttention(nnx.Module):
            def __init__(self, rngs):
                self.sinks = nnx.Param(jnp.zeros((8,)))
                self.mha = nnx.MultiHeadAttention(8, 512, decode=False, rngs=rngs)

            def __call__(self, x):
                self.mha.attention_fn = functools.partial(flax_attention_fn, sinks=self.sinks)
                try:
                    return self.mha(x, is_causal=True)
                finally:  # no traced value left in the module
                    self.mha.attention_fn = flax_attention_fn

    query ``(..., T, N, H)``, key and value ``(..., S, K, H)`` with any number of leading batch axes (flattened
    into one), mask and bias broadcastable to ``(..., N|1, T, S)``; ``dtype`` and ``promote_dtype`` cast the inputs
    as flax does; ``precision`` as :func:`~jax_dqpost.dot_product_attention` takes it (None, DEFAULT, HIGH or
    HIGHEST). What it cannot honour it refuses in one line: dropout while training (``dropout_rate > 0`` and not
    ``deterministic``), sowing the attention weights (``module``), and flax's einsum overrides.
    ``force_fp32_for_softmax`` is what it always does.

    Context parallelism: ``functools.partial(flax_attention_fn, context_axis='cp')`` (and ``context_layout``) in a
    module called inside ``jax.shard_map`` with the sequence sharded over mesh axis ``'cp'``, causal by
    ``is_causal`` (a mask array is not taken there), as :func:`~jax_dqpost.dot_product_attention` says."""
    from . import dot_product_attention

    if dropout_rate and not deterministic:
        raise ValueError(f"jax_dqpost.flax_attention_fn does no dropout: dropout_rate={dropout_rate!r} with "
                         f"deterministic={deterministic!r} (set the module's dropout_rate to 0, or run it "
                         "deterministic)")
    if module is not None:
        raise ValueError(f"jax_dqpost.flax_attention_fn has no attention weights to sow: it was given "
                         f"module={type(module).__name__} (flax passes the module where sow_weights=True; call "
                         "the attention module with sow_weights=False)")
    for name, given in (("einsum_dot_general", einsum_dot_general), ("qk_attn_weights_einsum", qk_attn_weights_einsum),
                        ("attn_weights_value_einsum", attn_weights_value_einsum)):
        if given is not None:
            raise ValueError(f"jax_dqpost.flax_attention_fn computes its own products: {name} must be None, got "
                             f"{describe(given)}")
    if promote_dtype is None:  # flax.nnx's: one dtype, the given one or the inputs' promoted (inexact)
        common = dtype if dtype is not None else jnp.result_type(query, key, value)
        if not jnp.issubdtype(common, jnp.inexact):
            common = jnp.promote_types(common, jnp.float32)
        query, key, value = (jnp.asarray(x, common) for x in (query, key, value))
    else:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    shape = query.shape
    if query.ndim > 4:
        lead = tuple(shape[:-3])
        batch = int(np.prod(lead))

        def flat(x):
            """``x`` with query's leading axes as one (leading axes of 1 added first, jax.nn's rule)."""
            if x is None:
                return None
            x = jnp.asarray(x)
            x = x.reshape((1,) * max(0, len(lead) + 3 - x.ndim) + tuple(x.shape))
            if all(d == 1 for d in x.shape[:-3]):
                return x.reshape(1, *x.shape[-3:])
            return jnp.broadcast_to(x, (*lead, *x.shape[-3:])).reshape(batch, *x.shape[-3:])

        query, key, value = (x.reshape(batch, *x.shape[-3:]) for x in (query, key, value))
        bias, mask = flat(bias), flat(mask)
    if mask is not None:
        mask = jnp.asarray(mask).astype(jnp.bool_)
    out = dot_product_attention(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                                query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                                local_window_size=local_window_size, sinks=sinks, implementation=implementation,
                                precision=precision, context_axis=context_axis, context_layout=context_layout)
    return out.reshape(*shape[:-1], out.shape[-1])

