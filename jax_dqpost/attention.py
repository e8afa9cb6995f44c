"""Attention that JAX users call: :func:`dot_product_attention`, ``jax.nn.dot_product_attention``'s signature and
meaning with learnable sinks, on FlashAttention-4's kernels where they run and in jax.numpy everywhere; and
:func:`flax_attention_fn`, the same for flax's ``attention_fn``.

Implementations (``implementation=``):

- ``'fa4'``: FlashAttention-4's forward and fa4-jax's backward kernels, the backward finished by one jax-dqpost
  launch for dQ, dK, dV and the sinks' gradient (:mod:`jax_dqpost.fa4jax`). GPUs whose FlashAttention-4 kernels
  run the call (Hopper and Blackwell; with sinks sm90 and sm100/sm110), bf16 and fp16, fa4-jax 0.1.0 installed.
  Lengths run FlashAttention's packed (varlen) kernels on the batch as it is, reshaped (no copy). A call the
  kernels cannot express exactly (a bias, a mask array, a window whose alignment differs) is refused naming why.
- ``'xla'``: jax.numpy on every platform (``jax_dqpost._attention.xla``): jax.nn's ``'xla'`` computation, with the
  sinks as one more logit per row; bf16 and fp16 on CPU too. Float32 inputs multiply at jax's default matmul
  precision, as jax.nn's do: on NVIDIA GPUs since Ampere, XLA rounds their operands to TF32 unless
  ``jax.default_matmul_precision('highest')`` says otherwise.
- ``'cudnn'``: ``jax.nn.dot_product_attention(implementation='cudnn')`` as it is, without sinks.
- ``None``: ``'fa4'`` where it runs this call, else ``'xla'``; on a GPU the fallback warns once per reason.
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ._attention import xla
from ._errors import describe

IMPLEMENTATIONS = (None, "xla", "fa4", "cudnn")


@dataclasses.dataclass(frozen=True)
class _Request:
    """One call, checked: 4-D arrays ``query`` ``(B, T, N, H)``, ``key`` and ``value`` ``(B, S, K, H)``, bias and
    mask 4-D or None, the scale a float or a scalar array, the window ``(left, right)`` or None, the lengths as
    given (arrays or None), sinks ``(N,)`` or None."""

    query: object
    key: object
    value: object
    bias: object
    mask: object
    scale: object
    is_causal: bool
    q_lengths: object
    kv_lengths: object
    same_lengths: bool  # the two lengths are one array (self-attention), as the caller passed them
    window: tuple | None
    sinks: object
    return_residual: bool


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None, sinks=None,
                          implementation=None, return_residual=False):
    r"""Scaled dot-product attention: ``jax.nn.dot_product_attention`` with learnable sinks, and FlashAttention-4 on
    GPUs. Changing the import is all a caller of jax.nn's does.

    Shapes (jax.nn's letters): ``B`` batch, ``T`` query length, ``S`` key/value length, ``N`` query heads, ``K``
    key/value heads dividing ``N`` (query head ``n`` attends with key head ``n // (N // K)``), ``H`` head dim.

    Args:
      query: ``(B, T, N, H)`` or ``(T, N, H)``.
      key, value: ``(B, S, K, H)`` or ``(S, K, H)``, of query's dtype.
      bias: added to the scaled logits, broadcastable to ``(B, N, T, S)`` (4-D, heads 1 or N).
      mask: boolean, broadcastable to ``(B, N, T, S)`` (4-D, heads 1 or N); True takes part.
      scale: multiplies ``query @ key^T``; ``1 / sqrt(H)`` by default.
      is_causal: query ``i`` sees keys ``j <= i`` (aligned top-left: ``i`` and ``j`` count from each one's start,
        also where ``T != S``).
      query_seq_lengths, key_value_seq_lengths: integer ``(B,)``: rows ``i >= query_seq_lengths[b]`` of the output
        are 0; keys ``j >= key_value_seq_lengths[b]`` are not seen.
      local_window_size: ``(left, right)`` or an int for both: query ``i`` sees keys ``i - left <= j <= i + right``.
      sinks: ``(N,)`` floating, one learnable logit per query head in every row's softmax, in natural-log units
        (not multiplied by ``scale``), with no value vector (gpt-oss): for query head ``n``, with ``l_ij`` the scaled,
        biased and masked logit of query ``i`` and key ``j``, ``out_i = sum_j p_ij v_j`` and
        ``p_ij = exp(l_ij) / (sum_j exp(l_ij) + exp(sinks[n]))``. Read as float32; its gradient has its dtype.
      implementation: ``'fa4'``: FlashAttention-4's kernels (a GPU where they run this call, fa4-jax installed);
        ``'xla'``: jax.numpy, every platform; ``'cudnn'``: jax.nn's cuDNN attention, without sinks; None: ``'fa4'``
        where it runs the call, else ``'xla'`` (on a GPU with a one-time warning saying why). The module docstring
        says what ``'fa4'`` expresses.
      return_residual: also return the log-sum-exp of every row's logits (the sink's too), ``(B, T, N)`` or
        ``(T, N)`` in the keys' dtype, as a constant of differentiation.

    Returns:
      ``(B, T, N, H)`` (or ``(T, N, H)``) in the values' dtype; with ``return_residual``, ``(out, residual)``.

    Rows that see no key: jax.nn's ``'xla'`` averages every value there (its masked logits are a large finite
    number) and so does ``'xla'`` here without sinks; with sinks such a row is 0. ``'fa4'`` gives 0 (its masked
    logits are ``-inf``), and its residual there is ``-inf`` (the sink with sinks), also in rows past a query
    length.

    ``jax.grad`` for query, key, value and sinks (not bias); ``jax.jit``, ``jax.vmap``, ``jax.checkpoint``,
    ``jax.shard_map``. Forward mode (``jax.jvp``) runs on ``'xla'``, and on ``'fa4'`` without sinks.
    """
    request, out_shape = _request(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                                  key_value_seq_lengths, local_window_size, sinks, return_residual)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be 'fa4', 'xla', 'cudnn' or None, got {describe(implementation)}")
    if implementation == "cudnn":
        result = _cudnn(request)
    else:
        if implementation is None:
            implementation = _choose(request)
        if implementation == "fa4":
            result = _fa4(request)
        else:
            result = _xla(request)
    if request.return_residual:
        out, residual = result
        return out.reshape(out_shape), residual.reshape(out_shape[:-1])
    return result.reshape(out_shape)


def _xla(r: _Request):
    return xla.dot_product_attention(
        r.query, r.key, r.value, r.bias, r.mask, scale=r.scale, is_causal=r.is_causal, q_lengths=r.q_lengths,
        kv_lengths=r.kv_lengths, window=r.window, sinks=r.sinks, return_residual=r.return_residual)


def _cudnn(r: _Request):
    if r.sinks is not None:
        raise ValueError("implementation='cudnn' takes no sinks (cuDNN's attention has none): use 'fa4' or 'xla'")
    return jax.nn.dot_product_attention(
        r.query, r.key, r.value, r.bias, r.mask, scale=r.scale, is_causal=r.is_causal,
        query_seq_lengths=r.q_lengths, key_value_seq_lengths=r.kv_lengths, local_window_size=r.window,
        implementation="cudnn", return_residual=r.return_residual)


# ---- the checks: jax.nn's rules, each error naming the argument and its value ---------------------------------

def _array(name, x, *, optional=False):
    if x is None and optional:
        return None
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) or isinstance(x, jax.core.Tracer):
        return jnp.asarray(x)
    raise TypeError(f"{name} must be an array, got {describe(x)}")


def _four_d(name, x):
    if x.ndim == 3:
        return x[None]
    if x.ndim != 4:
        raise ValueError(f"{name} must be (B, T, N, H) or (T, N, H) (jax.nn's layout), got shape {x.shape}")
    return x


def _request(query, key, value, bias, mask, scale, is_causal, q_lengths, kv_lengths, window, sinks,
             return_residual):
    """The call checked and made 4-D, and the output's shape."""
    q, k, v = (_array(n, x) for n, x in (("query", query), ("key", key), ("value", value)))
    out_shape = q.shape
    q, k, v = _four_d("query", q), _four_d("key", k), _four_d("value", v)
    b, s, heads_kv, h = k.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"value must have key's shape and dtype {tuple(k.shape)} {k.dtype}, got "
                         f"{tuple(v.shape)} {v.dtype}")
    if q.shape[0] != b or q.shape[3] != h or q.dtype != k.dtype:
        raise ValueError(f"query must be (B, T, N, H) = ({b}, T, N, {h}) of key's dtype {k.dtype} (key is "
                         f"{tuple(k.shape)}), got {tuple(q.shape)} {q.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"query, key and value must be floating-point, got {q.dtype}")
    t, n = q.shape[1], q.shape[2]
    if n % heads_kv:
        raise ValueError(f"the query heads ({n}) must be a multiple of the key/value heads ({heads_kv})")
    bias, mask = _array("bias", bias, optional=True), _array("mask", mask, optional=True)
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None:
            if x.ndim != 4:
                raise ValueError(f"{name} must be 4-D, broadcastable to (B, N, T, S) = {(b, n, t, s)}, got shape "
                                 f"{x.shape}")
            if x.shape[1] not in (1, n) or any(d not in (1, w) for d, w in zip(x.shape, (b, n, t, s))):
                raise ValueError(f"{name} must broadcast to (B, N, T, S) = {(b, n, t, s)} with 1 or {n} heads, got "
                                 f"shape {x.shape}")
    if mask is not None and mask.dtype != np.bool_:
        raise TypeError(f"mask must be boolean (True takes part; an additive mask is a bias), got {mask.dtype}")
    if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias must be floating-point, got {bias.dtype}")
    lengths = []
    for name, x in (("query_seq_lengths", q_lengths), ("key_value_seq_lengths", kv_lengths)):
        x = _array(name, x, optional=True)
        if x is not None:
            if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(f"{name} must be an integer array of shape (B,) = ({b},), got {x.dtype} "
                                 f"{tuple(x.shape)}")
        lengths.append(x)
    same = q_lengths is not None and (q_lengths is kv_lengths or _equal_on_host(q_lengths, kv_lengths))
    scale = _scale(scale, h)
    window = _window(local_window_size=window)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {describe(is_causal)}")
    if not isinstance(return_residual, (bool, np.bool_)):
        raise TypeError(f"return_residual must be a bool, got {describe(return_residual)}")
    if sinks is not None:
        sinks = _array("sinks", sinks)
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise TypeError(f"sinks must be floating-point, one logit per query head, got {sinks.dtype}")
        if sinks.shape != (n,):
            raise ValueError(f"sinks must have shape (N,) = ({n},), one logit per query head, got shape "
                             f"{tuple(sinks.shape)}")
        sinks = sinks.astype(jnp.float32)
    return _Request(q, k, v, bias, mask, scale, bool(is_causal), *lengths, same, window, sinks,
                    bool(return_residual)), out_shape


def _equal_on_host(a, b) -> bool:
    """Whether two lengths arrays this host can read hold the same values."""
    if b is None or isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return False
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _scale(scale, head_dim):
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    if isinstance(scale, numbers.Real) and not isinstance(scale, (bool, np.bool_)):
        return float(scale)
    dtype = getattr(scale, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or np.shape(scale) != ():
        raise TypeError(f"scale must be a Python float or a floating-point scalar, got {describe(scale)}")
    return scale


def _window(local_window_size):
    w = local_window_size
    if w is None:
        return None
    if isinstance(w, numbers.Integral) and not isinstance(w, (bool, np.bool_)):
        return int(w), int(w)
    if (isinstance(w, (tuple, list)) and len(w) == 2
            and all(isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)) for x in w)):
        return int(w[0]), int(w[1])
    raise TypeError(f"local_window_size must be an int or a (left, right) pair of ints, got {describe(w)}")


# ---- 'fa4': FlashAttention-4 where it runs the call exactly ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Fa4Plan:
    """How FlashAttention-4 runs a call: the keys it reads (the first ``keys`` of S), its ``(left, right)`` window
    (bottom-right aligned, None: unbounded), and for lengths its packed path's used lengths."""

    keys: int
    window: tuple
    used_q: object = None
    used_k: object = None


def _fa4_plan(r: _Request):
    """A :class:`_Fa4Plan` for ``r``, or the reason FlashAttention-4 cannot express it exactly (a string).

    jax.nn's query ``i`` sees keys ``i - left <= j <= i + right`` (``right`` 0 when causal); FlashAttention's sees
    ``i + o - L <= j <= i + o + R`` with ``o`` the (used) key length minus the query length. Reading only the first
    ``min(S, T + right)`` keys (no later one is seen) and ``L = left + o``, ``R = right - o`` give jax.nn's band
    where ``L`` is not negative. With lengths ``o`` must be the same in every sequence: the lengths are one array
    (``o = 0``), or only the query's are given and the keys run at most ``right`` past them."""
    if r.bias is not None:
        return "it takes no bias"
    if r.mask is not None:
        return "it takes no mask array (it takes is_causal, local_window_size and the lengths)"
    if isinstance(r.scale, jax.core.Tracer):
        return "its kernels are compiled for a scale known when tracing, and this one is traced"
    b, t = r.query.shape[:2]
    s = r.key.shape[1]
    left, right = r.window if r.window is not None else (None, None)
    if r.is_causal:
        right = 0 if right is None else min(right, 0)
    if (left is not None and left < 0) or (right is not None and right < 0):
        return f"its windows do not reach behind the query's own position (left, right) = {(left, right)}"
    masked = left is not None or right is not None
    lengths = r.q_lengths is not None or r.kv_lengths is not None
    if not lengths:
        keys = s if right is None else min(s, t + right)
        o = keys - t
        window = (None if left is None else left + o, None if right is None else right - o)
        if window[0] is not None and window[0] < 0:
            return (f"a causal mask or window aligned top-left with T = {t} queries and S = {s} keys leaves the "
                    "first queries fewer keys than FlashAttention's bottom-right alignment can express")
        return _Fa4Plan(keys, window)
    used_q = None if r.q_lengths is None else jnp.clip(r.q_lengths, 0, t).astype(jnp.int32)
    if not masked:
        used_k = None if r.kv_lengths is None else jnp.clip(r.kv_lengths, 0, s).astype(jnp.int32)
        return _Fa4Plan(s, (None, None), used_q, used_k)
    if r.same_lengths and t == s:
        return _Fa4Plan(s, (left, right), used_q, used_q)
    if r.kv_lengths is None and right is not None and t + right <= s:
        return _Fa4Plan(s, (None if left is None else left + right, 0), used_q, used_q + right)
    return ("with a causal mask or window and lengths, FlashAttention aligns each sequence on its own lengths; "
            "jax.nn's alignment is the same where query_seq_lengths and key_value_seq_lengths are one array and "
            "T == S, or where only query_seq_lengths is given and a window's right side stays within S")


def _fa4_unavailable(r: _Request) -> str | None:
    """Why ``'fa4'`` cannot run ``r`` on this machine (None: it can): the platform, fa4-jax, the dtype, the GPU and
    what its kernels compile for, then what the call asks (:func:`_fa4_plan`)."""
    from . import fa4jax

    if jax.default_backend() != "gpu":
        return f"it runs on NVIDIA GPUs and JAX's default backend is {jax.default_backend()!r}"
    if r.query.dtype not in (jnp.bfloat16, jnp.float16):
        return f"its kernels take bfloat16 and float16, and the query is {r.query.dtype}"
    plan = _fa4_plan(r)
    if isinstance(plan, str):
        return plan
    return fa4jax.unavailable(r.query, r.key[:, :plan.keys], r.value[:, :plan.keys], window_size=plan.window,
                              scale=r.scale, packed=plan.used_q is not None or plan.used_k is not None,
                              sink=r.sinks is not None)


_WARNED: set = set()


def _choose(r: _Request) -> str:
    reason = _fa4_unavailable(r)
    if reason is None:
        return "fa4"
    if jax.default_backend() == "gpu" and reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"jax_dqpost.dot_product_attention runs implementation='xla' here, as 'fa4' cannot: {reason} "
                      "(this warning is shown once for each reason)", stacklevel=3)
    return "xla"


def _fa4(r: _Request):
    reason = _fa4_unavailable(r)
    if reason is not None:
        raise ValueError(f"implementation='fa4' cannot run this call: {reason}; implementation='xla' runs every "
                         "call")
    return _run_fa4(r, _fa4_plan(r))


def _run_fa4(r: _Request, plan: _Fa4Plan):
    """``r`` as :mod:`jax_dqpost.fa4jax` runs it by ``plan``: dense, or packed where there are lengths (which
    without a GPU is its jax.numpy path, FlashAttention's conventions: what the tests compare with jax.nn's)."""
    from . import fa4jax

    q, k, v = r.query, r.key[:, :plan.keys], r.value[:, :plan.keys]
    options = dict(window_size=plan.window, scale=float(r.scale), return_lse=r.return_residual)
    if r.sinks is not None:
        options["learnable_sink"] = r.sinks
    b, t, n, h = q.shape
    if plan.used_q is None and plan.used_k is None:
        result = fa4jax.flash_attn(q, k, v, **options)
        out, lse = result if r.return_residual else (result, None)
    else:
        s = k.shape[1]
        cu_q, cu_k = (jnp.arange(b + 1, dtype=jnp.int32) * length for length in (t, s))
        try:
            result = fa4jax.flash_attn_varlen(
                q.reshape(b * t, n, h), k.reshape(b * s, *k.shape[2:]), v.reshape(b * s, *v.shape[2:]), cu_q, cu_k,
                seqused_q=plan.used_q, seqused_k=plan.used_k, defined_padding=True, **options)
        except NotImplementedError as e:  # fa4-jax's packed kernels under jax.vmap
            raise ValueError(f"implementation='fa4' with sequence lengths cannot run under jax.vmap ({e}); fold the "
                             "mapped axis into the batch, or use implementation='xla'") from None
        out, lse = result if r.return_residual else (result, None)
        out = out.reshape(b, t, n, -1)
        if lse is not None:
            lse = lse.reshape(n, b, t).transpose(1, 0, 2)
    if not r.return_residual:
        return out
    return out, jax.lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)).astype(r.key.dtype))


# ---- flax ------------------------------------------------------------------------------------------------------

def flax_attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                      dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                      promote_dtype=None, is_causal=False, *, scale=None, query_seq_lengths=None,
                      key_value_seq_lengths=None, local_window_size=None, sinks=None, implementation=None,
                      force_fp32_for_softmax=False, einsum_dot_general=None, qk_attn_weights_einsum=None,
                      attn_weights_value_einsum=None):
    """:func:`dot_product_attention` as flax's ``attention_fn``: ``flax.nnx.dot_product_attention``'s signature
    (and ``flax.linen``'s keywords), so that ``nnx.MultiHeadAttention(..., attention_fn=flax_attention_fn)`` and
    ``linen.MultiHeadDotProductAttention(..., attention_fn=flax_attention_fn)`` run it. ``functools.partial`` picks
    the keyword-only options (``implementation``, ``sinks``, ``local_window_size``, ...); nnx passes ``is_causal``
    from its own call (``module(x, is_causal=True)``), which a partial's cannot override.

    query ``(..., T, N, H)``, key and value ``(..., S, K, H)`` with any number of leading batch axes (flattened
    into one), mask and bias ``(..., N|1, T, S)``; ``dtype`` and ``promote_dtype`` cast the inputs as flax does.
    What it cannot honour it refuses in one line: dropout while training (``dropout_rate > 0`` and not
    ``deterministic``), sowing the attention weights (``module``), a ``precision`` (the logits are float32 sums of
    the products, as jax.nn's), and flax's einsum overrides. ``force_fp32_for_softmax`` is what it always does."""
    if dropout_rate and not deterministic:
        raise ValueError(f"jax_dqpost.flax_attention_fn does no dropout: dropout_rate={dropout_rate!r} with "
                         "deterministic=False (set the module's dropout_rate to 0, or run it deterministic)")
    if module is not None:
        raise ValueError("jax_dqpost.flax_attention_fn has no attention weights to sow (module was passed: "
                         "sow_weights=False)")
    if precision is not None:
        raise ValueError(f"jax_dqpost.flax_attention_fn takes precision=None (its logits are float32 sums of the "
                         f"products, as jax.nn's), got precision={precision!r}")
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
        def flat(x):
            return None if x is None else jnp.reshape(x, (int(np.prod(x.shape[:-3])), *x.shape[-3:]))

        query, key, value, bias, mask = (flat(x) for x in (query, key, value, bias, mask))
    if mask is not None:
        mask = jnp.asarray(mask).astype(jnp.bool_)
    out = dot_product_attention(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                                query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                                local_window_size=local_window_size, sinks=sinks, implementation=implementation)
    return out.reshape(*shape[:-1], out.shape[-1])
