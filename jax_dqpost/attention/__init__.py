"""Attention that JAX users call: :func:`dot_product_attention`, ``jax.nn.dot_product_attention``'s signature and
meaning with learnable sinks, on FlashAttention-4's kernels where they run and in jax.numpy everywhere; and
:func:`flax_attention_fn`, the same as flax's ``attention_fn``.

One call, one checked record (:mod:`~jax_dqpost.attention.call`), and implementations behind one interface: each
has a ``name``, ``plan(call)``, which returns how it runs the call or raises
:class:`~jax_dqpost.attention.call.Unsupported` saying why, and ``run(call, plan)``.

- ``'fa4'`` (:mod:`~jax_dqpost.attention.fa4`): FlashAttention-4's forward and fa4-jax's backward kernels, the
  backward finished by one jax-dqpost launch for dQ, dK, dV and the sinks' gradient (:mod:`jax_dqpost.fa4jax`).
  GPUs whose FlashAttention-4 kernels run the call (Hopper and Blackwell; with sinks sm90 and sm100/sm110), bf16 and
  fp16, fa4-jax 0.1.0 installed. A call the kernels cannot express exactly (a bias, a mask array, a window whose
  alignment differs) is refused naming why.
- ``'xla'`` (:mod:`~jax_dqpost.attention.xla`): jax.numpy on every platform: jax.nn's ``'xla'`` computation, with
  the sinks as one more logit per row; bf16 and fp16 on CPU too. Float32 inputs multiply at jax's default matmul
  precision, as jax.nn's do (on NVIDIA GPUs since Ampere, TF32), unless ``precision`` or
  ``jax.default_matmul_precision`` says otherwise. Its logits are one ``(B, N, T, S)`` array.
- ``'xla_chunked'`` (:mod:`~jax_dqpost.attention.xla_chunked`): ``'xla'``'s attention in blocks of keys, in memory
  that grows with ``T`` times a block, not ``T * S``; reverse-mode differentiation only.
- ``'cudnn'`` (:mod:`~jax_dqpost.attention.cudnn`): ``jax.nn.dot_product_attention(implementation='cudnn')`` as it
  is, without sinks.
- ``None``: the first of :data:`ORDER` that plans the call, each planned once: ``'fa4'``; ``'xla'`` where its logits
  take at most :data:`MAX_XLA_LOGITS` elements; ``'xla_chunked'``. On a GPU, passing over ``'fa4'`` warns once per
  reason.

Context parallelism (``context_axis``): inside ``jax.shard_map``, each device keeps its rows of the sequence,
all-gathers the keys and values over the axis and computes its rows with the masks of their positions in the whole
sequence (:mod:`jax_dqpost._attention.context`: the layouts, :func:`zigzag`), or under a causal window within a
device's run of rows receives only the keys before each run; the call record holds those keys and values and their
positions. ``'xla'`` and ``'xla_chunked'`` mask by those positions; ``'fa4'`` gives its
kernels each run of consecutive rows as one packed sequence reading the keys up to its end
(:func:`jax_dqpost._attention.fa4.context_attention`). The backward's collective is JAX's: the all-gather's
transpose reduce-scatters dK and dV.
"""

from __future__ import annotations

import warnings

import jax
from jax.typing import ArrayLike

from .._attention.context import unzigzag, zigzag
from .._checks import describe
from .call import Call, Unsupported, make_call
from .cudnn import Cudnn
from .fa4 import Fa4
from .flax import flax_attention_fn
from .xla import Xla
from .xla_chunked import XlaChunked

__all__ = ["dot_product_attention", "flax_attention_fn", "zigzag", "unzigzag", "IMPLEMENTATIONS", "ORDER",
           "MAX_XLA_LOGITS"]

IMPLEMENTATIONS = {impl.name: impl for impl in (Fa4(), Xla(), XlaChunked(), Cudnn())}
"""The implementations by name, as ``implementation=`` names them."""

MAX_XLA_LOGITS = 2 ** 28
"""The most logits (``B * N * T * S``) for which ``implementation=None`` runs ``'xla'`` (1 GiB of float32 logits,
of which its backward keeps several); above it, ``'xla_chunked'``."""

ORDER = (IMPLEMENTATIONS["fa4"], Xla(max_logits=MAX_XLA_LOGITS), IMPLEMENTATIONS["xla_chunked"])
"""What ``implementation=None`` tries, in order: the first whose plan accepts the call runs it."""

_INSTEAD = {"fa4": "implementation='xla' runs every call",
            "cudnn": "implementation='xla' runs every call, sinks too",
            "xla": "implementation='xla_chunked' runs in less memory",
            "xla_chunked": "implementation='xla' runs every call"}


def dot_product_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, bias: ArrayLike | None = None,
                          mask: ArrayLike | None = None, *, scale: float | ArrayLike | None = None,
                          is_causal: bool = False, query_seq_lengths: ArrayLike | None = None,
                          key_value_seq_lengths: ArrayLike | None = None,
                          local_window_size: int | tuple[int, int] | None = None, sinks: ArrayLike | None = None,
                          implementation: str | None = None, return_residual: bool = False,
                          precision: jax.lax.Precision | str | None = None, context_axis: str | None = None,
                          context_layout: str = "contiguous") -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""Scaled dot-product attention: ``jax.nn.dot_product_attention`` with learnable sinks, and FlashAttention-4 on
    GPUs. Changing the import is all a caller of jax.nn's does.

    Shapes (jax.nn's letters): ``B`` batch, ``T`` query length, ``S`` key/value length, ``N`` query heads, ``K``
    key/value heads dividing ``N`` (query head ``n`` attends with key head ``n // (N // K)``), ``H`` head dim.

    Args:
      query: ``(B, T, N, H)`` or ``(T, N, H)``; an array or anything ``jnp.asarray`` takes (a list, an
        ``nnx.Param``); bfloat16, float16, float32, float64 (under x64) or complex (whose logits' imaginary part is
        dropped before the softmax, as jax.nn does).
      key, value: ``(B, S, K, H)`` or ``(S, K, H)``, of query's dtype.
      bias: added to the scaled logits, broadcastable to ``(B, N, T, S)`` with 1 or ``N`` heads; fewer than 4
        dimensions get leading axes of 1 (jax.nn's rule). Differentiable on ``'xla'`` and ``'xla_chunked'``.
      mask: boolean, broadcastable to ``(B, N, T, S)`` as ``bias``; True takes part.
      scale: multiplies ``query @ key^T``; ``1 / sqrt(H)`` by default.
      is_causal: query ``i`` sees keys ``j <= i`` (aligned top-left: ``i`` and ``j`` count from each one's start,
        also where ``T != S``).
      query_seq_lengths, key_value_seq_lengths: integer ``(B,)``: rows ``i >= query_seq_lengths[b]`` of the output
        are 0; keys ``j >= key_value_seq_lengths[b]`` are not seen.
      local_window_size: ``(left, right)`` or an int for both, not negative: query ``i`` sees keys
        ``i - left <= j <= i + right`` (gpt-oss's window of 128 is ``(127, 0)``); None: unbounded.
      sinks: ``(N,)`` floating, one learnable logit per query head in every row's softmax, in natural-log units
        (not multiplied by ``scale``), with no value vector (gpt-oss): for query head ``n``, with ``l_ij`` the scaled,
        biased and masked logit of query ``i`` and key ``j``, ``out_i = sum_j p_ij v_j`` and
        ``p_ij = exp(l_ij) / (sum_j exp(l_ij) + exp(sinks[n]))``. Read as float32; its gradient has its dtype. A
        sink of ``+inf`` takes the whole softmax (the row's output 0), one of ``-inf`` none.
      implementation: ``'fa4'``: FlashAttention-4's kernels (a GPU where they run this call, fa4-jax installed);
        ``'xla'``: jax.numpy, every platform; ``'xla_chunked'``: jax.numpy in blocks of keys, in memory that grows
        with ``T`` and not ``T * S``; ``'cudnn'``: jax.nn's cuDNN attention, without sinks; None: ``'fa4'`` where it
        runs the call, else ``'xla'``, or ``'xla_chunked'`` where ``'xla'``'s logits would exceed ``2**28``
        elements (on a GPU a one-time warning says why ``'fa4'`` did not run). The module docstring says what each
        runs.
      return_residual: also return the log-sum-exp of every row's logits (the sink's too), ``(B, T, N)`` or
        ``(T, N)`` in the keys' dtype, as a constant of differentiation.
      precision: None or ``jax.lax.Precision.DEFAULT`` (jax's default matmul precision), ``HIGH`` or ``HIGHEST``:
        the products of float32 and wider inputs on ``'xla'`` and ``'xla_chunked'`` (bf16 and fp16 products are
        exact in float32 on every implementation).
      context_axis: None, or context parallelism over this ``jax.shard_map`` mesh axis of ``n`` devices: called
        inside the shard_map with query, key and value sharded along their sequence axis over it, each device's
        ``T`` rows (self-attention's shapes: ``S == T`` on each device) are rows of one sequence of ``n T``, laid
        out as ``context_layout`` says. Each device gathers every device's keys and values
        (``jax.lax.all_gather``; its memory holds the whole sequence's) and computes its own rows, the causal mask,
        the window and the lengths counting positions in the whole sequence, the sinks once per row; the residual is
        its rows'. Under a causal window reaching back at most a run of a device's rows (``T``, or ``T / 2`` for
        ``'zigzag'``; gpt-oss's 128 keys) and no lengths, a device receives only the keys before each run
        (``jax.lax.ppermute``). The backward reduce-scatters dK and dV (or sends the received keys' back); a sink
        replicated over the axis (``P()``) gets the whole sequence's gradient, summed by shard_map's default
        ``check_vma`` (without it, ``jax.lax.psum`` it over the axis). No bias or mask array; ``'fa4'`` takes a
        causal mask (with a window ``(left, 0)``) or no mask, and no lengths.
      context_layout: ``'contiguous'``: device ``i`` holds rows ``[i T, (i + 1) T)``; ``'zigzag'`` (``T`` even):
        the sequence cut into ``2 n`` chunks of ``T / 2``, device ``i`` holding chunks ``i`` and ``2 n - 1 - i``,
        which balances a causal mask's work; :func:`zigzag` orders a sequence so, :func:`unzigzag` back.

    Returns:
      ``(B, T, N, H)`` (or ``(T, N, H)``) in the values' dtype; with ``return_residual``, ``(out, residual)``.

    Rows that see no key: jax.nn's ``'xla'`` averages every value there (its masked logits are a large finite
    number) and so do ``'xla'`` and ``'xla_chunked'`` here without sinks; with sinks such a row is 0. ``'fa4'``
    gives 0 (its masked logits are ``-inf``), and its residual there is ``-inf`` (the sink with sinks), also in rows
    past a query length.

    ``jax.grad`` for query, key, value, sinks and (``'xla'``, ``'xla_chunked'``) bias; ``jax.jit``, ``jax.vmap``,
    ``jax.checkpoint``, ``jax.shard_map``; ``jax.jit`` with sharded batches and heads runs each device's share.
    Forward mode (``jax.jvp``) runs on ``'xla'`` and ``'fa4'``, with or without sinks; not on ``'xla_chunked'``,
    which ``None`` runs above ``2**28`` logits (name ``'xla'`` for forward mode there).
    """
    call = make_call(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                     query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                     local_window_size=local_window_size, sinks=sinks, precision=precision,
                     return_residual=return_residual, context_axis=context_axis, context_layout=context_layout)
    if implementation is None:
        impl, plan = _choose(call)
    else:
        impl = IMPLEMENTATIONS.get(implementation) if isinstance(implementation, str) else None
        if impl is None:
            names = ", ".join(repr(name) for name in IMPLEMENTATIONS)
            raise ValueError(f"implementation must be one of {names} or None, got {describe(implementation)}")
        try:
            plan = impl.plan(call)
        except Unsupported as e:
            raise ValueError(f"implementation={impl.name!r} cannot run this call: {e}; {_INSTEAD[impl.name]}") \
                from None
    return call.finish(impl.run(call, plan))


_WARNED: set = set()


def _choose(call: Call):
    """The first implementation of :data:`ORDER` that plans ``call``, and its plan; on a GPU, a warning (once per
    reason) where ``'fa4'`` did not."""
    reasons = []
    for impl in ORDER:
        try:
            plan = impl.plan(call)
        except Unsupported as e:
            reasons.append((impl.name, str(e)))
            continue
        fa4_reason = next((reason for name, reason in reasons if name == "fa4"), None)
        if fa4_reason is not None and jax.default_backend() == "gpu" and fa4_reason not in _WARNED:
            _WARNED.add(fa4_reason)
            warnings.warn(f"jax_dqpost.dot_product_attention runs implementation={impl.name!r} here, as 'fa4' "
                          f"cannot: {fa4_reason} (this warning is shown once for each reason)", stacklevel=3)
        return impl, plan
    raise RuntimeError(f"no implementation planned the call: {reasons}")  # unreachable: xla_chunked plans every call
