"""One attention call, checked once: :func:`make_call` turns :func:`jax_dqpost.dot_product_attention`'s arguments
into a :class:`Call`, the value every implementation is given and trusts (nothing after it checks an argument
again). An implementation that cannot run a call raises :class:`Unsupported` from its ``plan``, saying why.

Shapes, jax.nn's letters: ``B`` batch, ``T`` query length, ``S`` key/value length, ``N`` query heads, ``K``
key/value heads dividing ``N``, ``H`` head dim.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._attention import context as cp
from .._checks import describe

DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64, jnp.complex64,
                                     jnp.complex128))
"""The dtypes of query, key and value that some implementation takes (those of jax.nn's ``'xla'`` that give
attention: not integers, whose probabilities it rounds to the integer dtype)."""

SINK_CAP = 2.0 ** 100
"""What a ``+inf`` sink is computed as: for logits below ``2**99`` every ``exp(logit - sink)`` is 0 in float32 and
the sink's own term 1, so a row's output is 0 (the limit), with finite gradients; where the sink made the residual,
it is set back to ``+inf``."""


class Unsupported(Exception):
    """An implementation cannot run this call; ``str(e)`` says why, in words, in one line."""


@dataclasses.dataclass(frozen=True)
class FlashMask:
    """A :class:`Mask` in FlashAttention's terms: the first ``keys`` of S read (no later key is seen), its
    ``(left, right)`` window aligned bottom-right (None sides unbounded), and for lengths the used lengths of its
    packed path (int32 ``(B,)``, None: all)."""

    keys: int
    window: tuple
    used_q: object = None
    used_k: object = None


@dataclasses.dataclass(frozen=True)
class Mask:
    """Which logits take part, jax.nn's way (aligned top-left: query ``i`` and key ``j`` count from each one's
    start): ``causal`` (``j <= i``), ``window`` ``(left, right)``, not negative (``i - left <= j <= i + right``;
    None: unbounded), ``q_lengths``/``kv_lengths`` integer ``(B,)`` or None (rows ``i >= q_lengths[b]`` see
    nothing and are zeroed; keys ``j >= kv_lengths[b]`` are not seen), ``same_lengths`` (the two lengths are one
    array, as self-attention passes them), and ``array``, boolean ``(B|1, N|1, T|1, S|1)`` or None.
    ``q_positions`` int32 ``(T,)`` and ``k_positions`` int32 ``(S,)`` (None: ``0 .. T-1`` and ``0 .. S-1``) are the
    positions ``i`` and ``j`` of the rows and keys in every rule above: under context parallelism (:class:`Context`)
    a device's rows and the gathered keys count in the whole sequence."""

    causal: bool = False
    window: tuple | None = None
    q_lengths: object = None
    kv_lengths: object = None
    same_lengths: bool = False
    array: object = None
    q_positions: object = None
    k_positions: object = None

    @property
    def lengths(self) -> bool:
        return self.q_lengths is not None or self.kv_lengths is not None

    def flash(self, t: int, s: int) -> FlashMask:
        """This mask as FlashAttention's bottom-right one, or :class:`Unsupported` where that cannot express it
        exactly (a mask array; lengths whose alignment differs).

        jax.nn's query ``i`` sees keys ``i - left <= j <= i + right`` (``right`` 0 when causal); FlashAttention's
        sees ``i + o - L <= j <= i + o + R`` with ``o`` the (used) key length minus the query length. Reading only
        the first ``min(S, T + right)`` keys (no later one is seen) and ``L = left + o``, ``R = right - o`` give
        jax.nn's band where ``L`` is not negative. With lengths ``o`` must be the same in every sequence: the
        lengths are one array (``o = 0``), or only the query's are given and the keys run at most ``right`` past
        them."""
        if self.array is not None:
            raise Unsupported("it takes no mask array (it takes is_causal, local_window_size and the lengths)")
        if self.q_positions is not None or self.k_positions is not None:
            raise Unsupported("its masks count positions from the start of the queries and keys it is given")
        left, right = self.window if self.window is not None else (None, None)
        if self.causal:
            right = 0 if right is None else min(right, 0)
        masked = left is not None or right is not None
        if not self.lengths:
            keys = s if right is None else min(s, t + right)
            o = keys - t
            window = (None if left is None else left + o, None if right is None else right - o)
            if window[0] is not None and window[0] < 0:
                raise Unsupported(
                    f"a causal mask or window aligned top-left with T = {t} queries and S = {s} keys leaves the first "
                    "queries fewer keys than FlashAttention's bottom-right alignment can express")
            return FlashMask(keys, window)
        used_q = None if self.q_lengths is None else jnp.clip(self.q_lengths, 0, t).astype(jnp.int32)
        if not masked:
            used_k = None if self.kv_lengths is None else jnp.clip(self.kv_lengths, 0, s).astype(jnp.int32)
            return FlashMask(s, (None, None), used_q, used_k)
        if self.same_lengths and t == s:
            return FlashMask(s, (left, right), used_q, used_q)
        if self.kv_lengths is None and right is not None and t + right <= s:
            return FlashMask(s, (None if left is None else left + right, 0), used_q, used_q + right)
        raise Unsupported(
            "with a causal mask or window and lengths, FlashAttention aligns each sequence on its own lengths; "
            "jax.nn's alignment is the same where query_seq_lengths and key_value_seq_lengths are one array and "
            "T == S, or where only query_seq_lengths is given and a window's right side stays within S")


@dataclasses.dataclass(frozen=True)
class Context:
    """Context parallelism: the call runs inside ``jax.shard_map`` on each of the ``devices`` devices of mesh axis
    ``axis``, each holding ``T`` rows of the sequence laid out as ``layout`` says (``'contiguous'`` or
    ``'zigzag'``, ``jax_dqpost._attention.context``), this one ``index`` (its traced ``lax.axis_index``); the
    :class:`Call`'s key and value are every device's,
    gathered in device order, or where ``halo`` is an int (a causal window of at most a run's length, ``context
    .halo``) each run's ``halo`` keys before it and its own (``context.neighbours``); its :class:`Mask` counts
    global positions."""

    axis: str
    layout: str
    devices: int
    index: object = None  # int32, this device's lax.axis_index
    halo: int | None = None


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of :func:`jax_dqpost.dot_product_attention`, checked: ``query`` ``(B, T, N, H)``, ``key`` and
    ``value`` ``(B, S, K, H)`` of one dtype of :data:`DTYPES`; ``bias`` ``(B|1, N|1, T|1, S|1)`` floating or None;
    the :class:`Mask`; ``scale`` a Python float or a floating scalar array (traced or not); ``sinks`` float32
    ``(N,)`` with ``+inf`` as :data:`SINK_CAP`, or None; ``precision`` None (jax's default) or
    ``lax.Precision.HIGH``/``HIGHEST``; ``return_residual``; the caller's query shape, ``(B, T, N, H)`` or
    ``(T, N, H)``, which :meth:`finish` gives the result; and the :class:`Context` of context parallelism or None
    (with one, ``S`` counts every device's keys, gathered)."""

    query: object
    key: object
    value: object
    bias: object
    mask: Mask
    scale: object
    sinks: object
    precision: object
    return_residual: bool
    query_shape: tuple
    infinite_sinks: object = None  # bool (N,): the sinks given as +inf
    context: Context | None = None

    @property
    def logits(self) -> int:
        """How many logits the call has, ``B * N * T * S``."""
        b, t, n, _ = self.query.shape
        return b * n * t * self.key.shape[1]

    def finish(self, result):
        """An implementation's result (``out``, or ``(out, residual)`` ``(B, T, N)``) in the caller's shapes, the
        residual ``+inf`` where a ``+inf`` sink made it (not in rows that FlashAttention leaves at ``-inf``)."""
        if not self.return_residual:
            return result.reshape(self.query_shape)
        out, residual = result
        if self.infinite_sinks is not None:
            from_sink = self.infinite_sinks & (residual.astype(jnp.float32) >= SINK_CAP / 2)
            residual = jnp.where(from_sink, jnp.asarray(jnp.inf, residual.dtype), residual)
        return out.reshape(self.query_shape), residual.reshape(self.query_shape[:-1])


def make_call(query, key, value, bias, mask, *, scale, is_causal, query_seq_lengths, key_value_seq_lengths,
              local_window_size, sinks, precision, return_residual, context_axis=None,
              context_layout="contiguous") -> Call:
    """The :class:`Call` of these arguments (jax.nn's rules; the module docstring's letters), or a ``TypeError`` or
    ``ValueError`` naming the argument and what it got (its shape and dtype, never its values). With
    ``context_axis`` (:func:`_context`), the keys and values of every device of that axis gathered, or only those a
    causal window reaches (:class:`Context`)."""
    q, k, v = (_array(name, x) for name, x in (("query", query), ("key", key), ("value", value)))
    query_shape = tuple(q.shape)
    q, k, v = _four_d("query", q), _four_d("key", k), _four_d("value", v)
    b, s, heads_kv, h = k.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"value must have key's shape and dtype {tuple(k.shape)} {k.dtype}, got "
                         f"{tuple(v.shape)} {v.dtype}")
    if q.shape[0] != b or q.shape[3] != h or q.dtype != k.dtype:
        raise ValueError(f"query must be (B, T, N, H) = ({b}, T, N, {h}) of key's dtype {k.dtype} (key is "
                         f"{tuple(k.shape)}), got {tuple(q.shape)} {q.dtype}")
    if q.dtype not in DTYPES:
        raise TypeError(f"query, key and value must be of one of {', '.join(d.name for d in DTYPES)}, got "
                        f"{q.dtype}" + (" (cast them to a floating dtype)" if not jnp.issubdtype(q.dtype, jnp.inexact)
                                        else ""))
    t, n = q.shape[1], q.shape[2]
    if heads_kv == 0 or n % heads_kv:
        raise ValueError(f"the query heads ({n}) must be a multiple of the key/value heads ({heads_kv})")
    full = (b, n, t, s)
    bias = _broadcastable("bias", _array("bias", bias, optional=True), full)
    array = _broadcastable("mask", _array("mask", mask, optional=True), full)
    if array is not None and array.dtype != np.bool_:
        raise TypeError(f"mask must be boolean (True takes part; an additive mask is a bias), got {array.dtype}")
    if bias is not None and not jnp.issubdtype(bias.dtype, jnp.inexact):
        raise TypeError(f"bias must be floating-point, got {bias.dtype}")
    lengths = []
    for name, x in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths)):
        x = _array(name, x, optional=True)
        if x is not None and (x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer)):
            raise ValueError(f"{name} must be an integer array of shape (B,) = ({b},), got {x.dtype} "
                             f"{tuple(x.shape)}")
        lengths.append(x)
    same = query_seq_lengths is not None and (query_seq_lengths is key_value_seq_lengths
                                              or _equal_on_host(*lengths))
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {describe(is_causal)}")
    if not isinstance(return_residual, (bool, np.bool_)):
        raise TypeError(f"return_residual must be a bool, got {describe(return_residual)}")
    context = _context(context_axis, context_layout, q, k, bias, array)
    if context is None:
        the_mask = Mask(bool(is_causal), _window(local_window_size, t, s), *lengths, same, array)
    else:
        window = _window(local_window_size, context.devices * (t + s), 0)  # at most the whole sequence's T + S
        index = lax.axis_index(context.axis)
        halo = cp.halo(bool(is_causal), window, context.layout, t, any(x is not None for x in lengths))
        context = dataclasses.replace(context, index=index, halo=halo)
        if halo is None:
            k_positions = jnp.asarray(cp.gathered_positions(context.layout, s, context.devices))
            k, v = cp.gather(k, context.axis), cp.gather(v, context.axis)
        else:
            k_positions = cp.neighbour_positions(context.layout, s, context.devices, index, halo)
            k, v = (cp.neighbours(x, context.axis, context.layout, context.devices, index, halo) for x in (k, v))
        the_mask = Mask(bool(is_causal), window, *lengths, same, None,
                        cp.positions(context.layout, t, context.devices, index), k_positions)
    sinks, infinite = _sinks(sinks, n)
    return Call(q, k, v, bias, the_mask, _scale(scale, h), sinks, _precision(precision), bool(return_residual),
                query_shape, infinite, context)


def _context(axis, layout, query, key, bias, mask) -> Context | None:
    """The :class:`Context` of ``context_axis`` and ``context_layout`` (None without an axis), checked: an axis of
    an enclosing ``jax.shard_map``, a layout of ``LAYOUTS``, ``T == S`` on each device (even for ``'zigzag'``), no
    bias or mask array."""
    if not (isinstance(layout, str) and layout in cp.LAYOUTS):
        raise ValueError(f"context_layout must be one of {', '.join(map(repr, cp.LAYOUTS))}, got {describe(layout)}")
    if axis is None:
        return None
    if not isinstance(axis, str):
        raise TypeError(f"context_axis must be None or the name (a str) of a jax.shard_map mesh axis, got "
                        f"{describe(axis)}")
    try:
        devices = int(lax.axis_size(axis))
    except NameError:
        raise ValueError(f"context_axis={axis!r} names no axis of an enclosing jax.shard_map: call "
                         "dot_product_attention inside jax.shard_map over a mesh with that axis, the sequence "
                         "sharded along it") from None
    t, s = query.shape[1], key.shape[1]
    if t != s:
        raise ValueError(f"context_axis={axis!r} takes self-attention's shapes, each device's T queries and S keys "
                         f"equal: got query {tuple(query.shape)} and key {tuple(key.shape)} (T = {t}, S = {s})")
    if layout == "zigzag" and t % 2:
        raise ValueError(f"context_layout='zigzag' holds two chunks of each device's T rows: T must be even, got "
                         f"query {tuple(query.shape)} (T = {t}) on each device")
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None:
            raise ValueError(f"{name} is not taken with context_axis={axis!r} (is_causal, local_window_size and "
                             f"the lengths are), got {describe(x)}")
    return Context(axis, layout, devices)


def _array(name, x, *, optional=False):
    """``x`` as a jax array: arrays, tracers, and what ``jnp.asarray`` takes (lists, numpy arrays and scalars,
    objects with ``__jax_array__`` such as flax's ``nnx.Param``)."""
    if x is None and optional:
        return None
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return x
    if isinstance(x, (str, bytes, dict)) or x is None:
        raise TypeError(f"{name} must be an array, got {describe(x)}")
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be an array, got {describe(x)}, which jnp.asarray does not take: "
                        f"{str(e).splitlines()[0][:120] if str(e) else type(e).__name__}") from None


def _four_d(name, x):
    if x.ndim == 3:
        return x[None]
    if x.ndim != 4:
        raise ValueError(f"{name} must be (B, T, N, H) or (T, N, H) (jax.nn's layout), got shape {tuple(x.shape)}")
    return x


def _broadcastable(name, x, full):
    """A bias or mask of at most 4 dimensions with leading axes of 1 added (jax.nn's rule), checked to broadcast
    to ``full`` ``(B, N, T, S)`` with 1 or N heads."""
    if x is None:
        return None
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dimensions, broadcastable to (B, N, T, S) = {full}, got shape "
                         f"{tuple(x.shape)}")
    x = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    if any(d not in (1, w) for d, w in zip(x.shape, full)):
        raise ValueError(f"{name} must broadcast to (B, N, T, S) = {full} with 1 or {full[1]} heads, got shape "
                         f"{tuple(x.shape)} (leading axes of 1 added to make it 4-D)")
    return x


def _equal_on_host(a, b) -> bool:
    """Whether two lengths arrays this host can read hold the same values."""
    if a is None or b is None or isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return False
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _scale(scale, head_dim):
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim)) if head_dim else 1.0  # head dim 0: every logit is 0 at any scale
    if isinstance(scale, numbers.Real) and not isinstance(scale, (bool, np.bool_)):
        return float(scale)
    dtype = getattr(scale, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or np.shape(scale) != ():
        raise TypeError(f"scale must be a Python float or a floating-point scalar, got {describe(scale)}")
    return scale


def _window(window, t: int, s: int):
    """``(left, right)`` of ``local_window_size`` (an int for both), each at most ``T + S`` (a wider side sees as
    much), or None."""
    if window is None:
        return None
    if isinstance(window, numbers.Integral) and not isinstance(window, (bool, np.bool_)):
        window = (window, window)
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)) for x in window)):
        raise TypeError(f"local_window_size must be an int or a (left, right) pair of ints, got {describe(window)}")
    if min(window) < 0:
        raise ValueError(f"local_window_size must not be negative, got {tuple(int(x) for x in window)}: a side "
                         "without bound is None for both sides or a side as long as the sequence (FlashAttention's "
                         "-1 for 'unbounded' is not jax.nn's, whose query i sees keys i - left <= j <= i + right)")
    return tuple(min(int(x), t + s) for x in window)


def _sinks(sinks, heads: int):
    """``(sinks, infinite)``: the sinks as float32 with ``+inf`` computed as :data:`SINK_CAP`, and where they were
    ``+inf`` (None without sinks)."""
    if sinks is None:
        return None, None
    sinks = _array("sinks", sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must be floating-point, one logit per query head, got {sinks.dtype}")
    if sinks.shape != (heads,):
        raise ValueError(f"sinks must have shape (N,) = ({heads},), one logit per query head, got shape "
                         f"{tuple(sinks.shape)}")
    sinks = sinks.astype(jnp.float32)
    infinite = jnp.isposinf(sinks)
    return jnp.where(infinite, jnp.float32(SINK_CAP), sinks), infinite


_PRECISIONS = {lax.Precision.DEFAULT: None, lax.Precision.HIGH: lax.Precision.HIGH,
               lax.Precision.HIGHEST: lax.Precision.HIGHEST}


def _precision(precision):
    """None (jax's default) or ``lax.Precision.HIGH``/``HIGHEST`` from a ``lax.Precision``, its name, or a pair of
    one precision for both operands (flax's ``PrecisionLike``)."""
    if precision is None:
        return None
    given = precision
    if isinstance(precision, (tuple, list)) and len(precision) == 2 and precision[0] == precision[1]:
        precision = precision[0]
    try:
        precision = lax.Precision(precision) if isinstance(precision, str) else precision
    except ValueError:
        pass
    if isinstance(precision, lax.Precision) and precision in _PRECISIONS:
        return _PRECISIONS[precision]
    raise TypeError(f"precision must be None or a jax.lax.Precision (DEFAULT, HIGH, HIGHEST), got {describe(given)}")
