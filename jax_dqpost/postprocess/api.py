"""The public entry points: the arguments checked and made operands (``_arguments.py``), the call's
:class:`~jax_dqpost._primitive.plan.Plan`, then one ``bind`` of the primitive (``_primitive/rules.py``)."""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _checks, _jax_internals
from . import arguments as _arguments
from ._primitive import rules
from ..layout import AccumLayout
from ._primitive.plan import ARG_NAMES, Operands, Plan
from ._primitive.reference import accum_from_dq_reference


class Gradients(NamedTuple):
    """What :func:`flash_attention_postprocess` returns, whatever its arguments (a caller's unpacking never depends on
    them): four members, unpacked ``dq, dk, dv, dsink = ...`` or read by name; a member the call did not compute is
    None. A pytree (jit, vmap, grad and ``jax.tree_util`` see its arrays as leaves; the None members are empty
    subtrees), registered for ``jax.export`` serialization as ``jax_dqpost.Gradients``. Under ``jax.shard_map``,
    ``out_specs`` is one spec for every member or a ``Gradients`` of specs.

    Attributes:
      dq: dQ, ``(B, S, H, D)`` or packed ``(T, H, D)``, of the call's ``dtype``.
      dk: dK, ``(B, Sk, Hkv, D)`` or ``(Tk, Hkv, D)``, of ``dtype``; None without ``dk_accum``.
      dv: dV, ``(B, Sk, Hkv, Dv)`` or ``(Tk, Hkv, Dv)``, of ``dtype``; None without ``dv_accum``.
      dsink: the learnable sink's gradient, ``(H,)`` of the sink's dtype; None without ``learnable_sink``.
    """

    dq: jax.Array
    dk: jax.Array | None
    dv: jax.Array | None
    dsink: jax.Array | None


jax.export.register_namedtuple_serialization(Gradients, serialized_name="jax_dqpost.Gradients")


@_checks.required_arguments(layout=_arguments.LAYOUT_HINT)
def dq_postprocess(dq_accum, scale, *, head_dim: int, seqlen_q: int | None = None, total_q: int | None = None,
                   cu_seqlens_q=None, seqused_q=None, dtype=jnp.bfloat16, layout: AccumLayout):
    """FlashAttention's backward dQ postprocess: ``dQ = round(scale * dq_accum)`` in natural layout.

    Shapes (FlashAttention's letters, not jax.nn's): ``B`` batch, ``S`` query length (``seqlen_q``), ``H`` heads,
    ``D`` head dim (``head_dim``); packed, ``T`` rows in all (``total_q``).

    Dense batches (``seqlen_q`` given)::

        dq_accum: float32 (B, H, Sr * Da)  ->  dq: (B, S, H, D)

    with ``Sr = ceil(S / P) * P`` (``P = tile_m * cluster_size``, ``layout.pad_rows``),
    ``Dr = ceil(D / hdim_multiple_of) * hdim_multiple_of`` and ``Da`` the same for ``layout.alloc_hdim_multiple_of``
    (``Da = Dr`` for most producers). Tile ``(b, h, m)`` is ``dq_accum[b, h, m*tile_m*Dr : (m+1)*tile_m*Dr]`` in the
    producer's register order.
    With ``seqused_q`` (B,), rows ``>= seqused_q[b]`` of batch ``b`` are zero.

    Variable-length batches (``cu_seqlens_q`` (B+1,) and ``total_q`` given)::

        dq_accum: float32 (H, Tp * Da)  ->  dq: (T, H, D),   Tp = ceil((T + B*P) / P) * P

    Sequence ``b`` is dq rows ``cu[b] .. cu[b] + len_b`` with ``len_b = seqused_q[b]`` if given, else
    ``cu[b+1] - cu[b]``; its accumulator starts at padded row ``(cu[b] + b*P) // P * P``
    (FlashAttention's allocation). Rows no sequence covers are zero.

    Args:
      dq_accum: the accumulator as the producer described by ``layout`` wrote it (shapes above).
      scale: the softmax scale: a Python float or a floating-point scalar, traced or not; converted to
        float32 (round-to-nearest) first. Changing it never recompiles the kernel. A value this host can see (a
        Python or numpy scalar, a concrete array) must be finite in float32; a traced one is used as it is (but
        under ``checkify``, see ``cu_seqlens_q``).
      head_dim: ``D``, a multiple of 8, at most 256.
      seqlen_q: ``S`` (dense).
      total_q: ``T``, rows of the packed output (varlen).
      cu_seqlens_q: varlen offsets: Python ints or a numpy array (static: validated now, exact launch grid) or a
        jax array of int32 (an operand: new values never retrace or recompile; int8, int16, uint8 and uint16 are
        widened to int32, other types, which int32 cannot hold exactly, are a ``TypeError``, traced or not). Values
        this host can read now (a jax array passed outside ``jit``, read back with a device-to-host copy) are
        validated like static ones (lengths against traced offsets: only their sign); traced values are not:
        corrupt ones are clamped into a partition of the rows, never read or written out of bounds. With
        ``JAX_DQPOST_CHECKIFY=1`` (read when the call is traced) traced offsets, lengths and scales are checked on
        the device by the same rules in a function that ``jax.experimental.checkify.checkify`` transforms, the error
        naming the first bad index and its value (``checkify.debug_check``: dropped elsewhere; unset, nothing is
        traced).
      seqused_q: lengths actually used, ``(B,)``: static ints or an int32 array, like ``cu_seqlens_q``.
      dtype: ``jnp.bfloat16`` or ``jnp.float16``, or one of the names ``"bf16"``, ``"bfloat16"``, ``"fp16"``,
        ``"f16"``, ``"float16"`` (no other), the type of dQ.
      layout: the :class:`AccumLayout` of the producer, required (an accumulator read in another order gives wrong
        values, not an error): ``AccumLayout.flash_attention(gpu, head_dim, causal=..., tensor="dq", version=...)`` for
        FlashAttention-4's, ``AccumLayout.row_major()`` for an accumulator made in JAX.

    Returns:
      dq, one array of ``dtype`` whatever the arguments (``dq = dq_postprocess(...)``), every element defined:
      ``round_to_nearest_even(float32(scale) * acc[F(i, j)])`` for covered rows, 0 elsewhere. A learnable sink's
      gradient comes with dQ, in the same launch, from :func:`flash_attention_postprocess` with
      ``dk_accum = dv_accum = None``, which returns every gradient as a :class:`Gradients`.

    Raises:
      TypeError: a missing ``layout``, or an argument of the wrong type (a non-float32 accumulator, a non-integer
        offset, a jax array of offsets of a type int32 cannot hold exactly), naming it.
      ValueError: at trace time, on every platform, naming the argument and the value: a shape that does not fit
        the layout and the sizes; ``head_dim`` the layout cannot hold (``AccumLayout.check_head_dim``); static or
        host-visible offsets that are not non-decreasing within ``[0, total_q]``, lengths outside their sequence;
        a non-finite concrete scale; a side whose padded rows overflow int32; a launch larger than CUDA's grid
        (batch above 65535, 2^31 tiles).
    """
    _arguments.check_layout(layout, "layout")
    head_dim = _checks.head_dim(head_dim)
    layout.check_head_dim(head_dim)
    out_dtype = _arguments.out_dtype(dtype)
    dq_accum = _arguments.accumulator("dq_accum", dq_accum)
    scale = _arguments.scale_operand(scale)
    part, aux = _arguments.part(layout, head_dim, out_dtype, seqlen_q, total_q, cu_seqlens_q, seqused_q)
    return _bind(Plan((part,)), (dq_accum,), (aux,), scale.reshape(1), None)[0]


def _no_scale_for_an_accumulator(given: dict) -> None:
    """``TypeError`` where a scale (a Python number or a 0-d array) stands for ``dk_accum`` or ``dv_accum``: the
    call ``flash_attention_postprocess(dq_accum, scale, ...)`` meant for dQ alone."""
    for name in ("dk_accum", "dv_accum"):
        value = given.get(name)
        if isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0:
            shown = (_checks.describe(value) if isinstance(value, numbers.Number)
                     else f"a scalar of dtype {np.dtype(value.dtype).name}")
            raise TypeError(f"flash_attention_postprocess() took {shown} as {name}, where an accumulator (a float32 "
                            "array, or None) goes: the accumulators come first, then softmax_scale; for dQ alone call "
                            "flash_attention_postprocess(dq_accum, None, None, softmax_scale, ...) or "
                            "dq_postprocess(dq_accum, scale, ...)")


@_checks.required_arguments(_no_scale_for_an_accumulator, dq_layout=_arguments.LAYOUT_HINT)
def flash_attention_postprocess(dq_accum, dk_accum, dv_accum, softmax_scale, *, head_dim: int,
                                head_dim_v: int | None = None, dtype=jnp.bfloat16, dq_layout: AccumLayout,
                                dkv_layout: AccumLayout | None = None, dk_scale=None, seqlen_q: int | None = None,
                                seqlen_k: int | None = None, total_q: int | None = None, total_k: int | None = None,
                                cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                                learnable_sink=None, lse=None, dpsum=None):
    """FlashAttention's whole backward postprocess in one kernel launch: dQ, dK and dV (grouped-query attention,
    where the backward accumulates dK/dV in fp32 too) and the learnable sink's gradient.

    Each tensor is converted as :func:`dq_postprocess` converts dQ (one fp32 multiply, one rounding), with its
    own layout, head dim, sequence side and scale; the letters are :func:`dq_postprocess`'s, and on the k side
    ``Hkv`` key/value heads, ``Sk`` key length (``seqlen_k``), ``Tk`` packed key rows (``total_k``), ``Dv`` the
    value head dim (``head_dim_v``)::

        dQ: dq_accum (B, H, Sr*Da) or (H, Tp*Da)        -> dq (B, S, H, D) or (T, H, D)      scale softmax_scale
        dK: dk_accum (B, Hkv, Skr*Da) or (Hkv, Tkp*Da)  -> dk (B, Sk, Hkv, D) or (Tk, Hkv, D)  scale dk_scale
        dV: dv_accum (B, Hkv, Skr*Dva) or (Hkv, Tkp*Dva) -> dv (B, Sk, Hkv, Dv) or (Tk, Hkv, Dv)  scale 1

    ``Sr``, ``Tp`` (q side, ``dq_layout``) and ``Skr``, ``Tkp`` (k side, ``dkv_layout``; its rows are key rows)
    as :func:`dq_postprocess` defines them; ``Da``, ``Dva``: ``head_dim``, ``head_dim_v`` padded as the layout's
    allocation pads them.
    ``Hkv`` must divide ``H``. The q side is dense (``seqlen_q``) or packed (``cu_seqlens_q``, ``total_q``,
    optional ``seqused_q``), the k side likewise with ``seqlen_k`` / ``cu_seqlens_k``, ``total_k``,
    ``seqused_k``; offsets static or traced, independently; both sides hold the same ``B`` sequences (a packed
    side's ``B`` is ``len(cu_seqlens) - 1``). ``dk_accum`` and ``dv_accum`` may both be None (no
    grouped-query attention: the backward wrote dK and dV itself); dk and dv are then None.

    With a learnable sink (``learnable_sink`` (H,) of float32, bfloat16, float16 or float64 (read as float32), and
    ``lse`` and ``dpsum`` float32, as FlashAttention's backward has them: dense ``lse`` (B, H, S), ``dpsum`` (B, H, Sr); packed ``lse``
    (H, T), ``dpsum`` (H, Tp)), also ``dsink`` (H,) of the sink's dtype::

        dsink[h] = sum over sequences b, rows r < len_b of  -exp(sink[h] - lse[b, h, r]) * dpsum[b, h, r]

    (the exponential is 1 where ``lse = -inf``; packed rows at ``lse[h, cu_q[b] + r]`` and ``dpsum[h,
    padded_offset_b + r]``; ``len_b`` honours ``seqused_q``). On the GPU it is reduced in FlashAttention-4's
    order, deterministically (bit-identical to flash-attn 4.0.0b36); elsewhere by a float32 sum.

    Args:
      dq_accum, dk_accum, dv_accum: the float32 accumulators (shapes above).
      softmax_scale: dQ's scale, as :func:`dq_postprocess`'s ``scale``.
      head_dim, head_dim_v: ``D`` and ``Dv`` (default ``D``).
      dtype: the type of dq, dk, dv, as in :func:`dq_postprocess`.
      dq_layout, dkv_layout: the producer's :class:`AccumLayout` of dQ (required) and of dK/dV (required with
        ``dk_accum``): ``AccumLayout.flash_attention(gpu, head_dim, causal=..., tensor="dq", version=...)`` and
        ``tensor="dkv"`` for FlashAttention-4's.
      dk_scale: dK's scale; default ``softmax_scale`` (FlashAttention-4; FlashAttention-3 passes 1.0).
      seqlen_q, total_q, cu_seqlens_q, seqused_q: the q side, as in :func:`dq_postprocess`.
      seqlen_k, total_k, cu_seqlens_k, seqused_k: the k side, likewise (only with ``dk_accum``).
      learnable_sink, lse, dpsum: the sink operands (above), all three or none.

    Returns:
      :class:`Gradients` ``(dq, dk, dv, dsink)`` whatever the arguments: dk and dv None without ``dk_accum`` and
      ``dv_accum``, dsink None without a sink, so that ``dq, dk, dv, dsink = flash_attention_postprocess(...)``
      unpacks every call alike.

    Raises:
      TypeError, ValueError: as :func:`dq_postprocess`, for each side and tensor, naming its own arguments; also
        a scale where ``dk_accum`` or ``dv_accum`` goes (``flash_attention_postprocess(dq_accum, scale, ...)``),
        ``dk_accum`` without ``dv_accum`` or ``dkv_layout``, k-side arguments without ``dk_accum``, sides with
        different batches, key/value heads that do not divide the query heads, sink operands of the wrong
        shapes or only some of them.
    """
    head_dim = _checks.head_dim(head_dim)
    head_dim_v_arg = head_dim_v
    head_dim_v = head_dim if head_dim_v is None else _checks.head_dim(head_dim_v, name="head_dim_v")
    q_part, dq_accum, q_aux, scale = _q_side(dq_accum, softmax_scale, head_dim, dtype, dq_layout, seqlen_q, total_q,
                                             cu_seqlens_q, seqused_q)
    k_scale = scale if dk_scale is None else _arguments.scale_operand(dk_scale, "dk_scale")
    if (dk_accum is None) != (dv_accum is None):
        raise ValueError("dk_accum and dv_accum must be given together (grouped-query attention) or both be None, "
                         f"got dk_accum={'None' if dk_accum is None else 'an array'}, "
                         f"dv_accum={'None' if dv_accum is None else 'an array'}")
    sink = _arguments.sink_operands(learnable_sink, lse, dpsum)
    sink_dtype = None if sink is None else sink[0].dtype  # the kernel's (a float64 sink is read as float32)
    dsink_dtype = None if sink is None else _arguments.dsink_dtype(learnable_sink)  # the sink's own
    if dk_accum is None:
        unused = {name: v for name, v in (("dkv_layout", dkv_layout), ("head_dim_v", head_dim_v_arg),
                                          ("dk_scale", dk_scale), ("seqlen_k", seqlen_k), ("total_k", total_k),
                                          ("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k)) if v is not None}
        if unused:
            raise ValueError(f"{' and '.join(', '.join(unused).rsplit(', ', 1))} "
                             f"{'applies' if len(unused) == 1 else 'apply'} only with dk_accum and dv_accum "
                             "(grouped-query attention)")
        plan = Plan((q_part,), sink_dtype=sink_dtype, dsink_dtype=sink_dtype)
        outs = _bind(plan, (dq_accum,), (q_aux,), scale.reshape(1), sink)
        return Gradients(outs[0], None, None, _dsink(outs, dsink_dtype))
    k_part, v_part, dk_accum, dv_accum, k_aux = _k_side(dk_accum, dv_accum, head_dim, head_dim_v, q_part.dtype,
                                                        dkv_layout, seqlen_k, total_k, cu_seqlens_k, seqused_k)
    plan = Plan((q_part, k_part, v_part), sink_dtype=sink_dtype, dsink_dtype=sink_dtype)
    plan.check_batch((dq_accum.shape, dk_accum.shape))
    outs = _bind(plan, (dq_accum, dk_accum, dv_accum), (q_aux, k_aux), jnp.stack([scale, k_scale, jnp.float32(1)]),
                 sink)
    return Gradients(*outs[:3], _dsink(outs, dsink_dtype))


def _dsink(outs, dtype):
    """dsink (the last result) in the sink's own ``dtype`` (float64 where the kernel read a float64 sink as
    float32), or None without a sink (``dtype`` None)."""
    if dtype is None:
        return None
    return outs[-1] if outs[-1].dtype == dtype else outs[-1].astype(dtype)


def _q_side(dq_accum, scale, head_dim, dtype, layout, seqlen, total, cu_seqlens, seqused):
    """``(part, dq_accum, q_aux, scale)`` of :func:`flash_attention_postprocess`'s q side, checked."""
    _arguments.check_layout(layout, "dq_layout")
    layout.check_head_dim(head_dim)
    out_dtype = _arguments.out_dtype(dtype)
    dq_accum = _arguments.accumulator("dq_accum", dq_accum)
    scale = _arguments.scale_operand(scale, "softmax_scale")
    part, aux = _arguments.part(layout, head_dim, out_dtype, seqlen, total, cu_seqlens, seqused)
    return part, dq_accum, aux, scale


def _k_side(dk_accum, dv_accum, head_dim, head_dim_v, out_dtype, layout, seqlen, total, cu_seqlens, seqused):
    """``(dK's part, dV's part, dk_accum, dv_accum, k_aux)`` of :func:`flash_attention_postprocess`'s k side,
    checked."""
    if layout is None:
        raise TypeError(f"flash_attention_postprocess() needs dkv_layout= with dk_accum and dv_accum: "
                        f"{_arguments.LAYOUT_HINT}")
    _arguments.check_layout(layout, "dkv_layout")
    layout.check_head_dim(head_dim)
    layout.check_head_dim(head_dim_v, "head_dim_v")
    dk_accum = _arguments.accumulator("dk_accum", dk_accum)
    dv_accum = _arguments.accumulator("dv_accum", dv_accum)
    k_part, aux = _arguments.part(layout, head_dim, out_dtype, seqlen, total, cu_seqlens, seqused, ARG_NAMES["dk"])
    return k_part, dataclasses.replace(k_part, head_dim=head_dim_v), dk_accum, dv_accum, aux


def _bind(plan: Plan, accs, side_aux, scales, sink) -> list:
    """The primitive on the API's operands (``sink``: the three sink operands, or None); its abstract evaluation
    checks their shapes, naming the arguments, and CUDA's launch limits, at trace time and on every platform. Inside
    ``jax.shard_map`` the operands are cast to the union of their varying manual axes first, and so are the results
    (``rules.bind``)."""
    return rules.bind(plan.join(Operands(tuple(accs), tuple(side_aux), scales, *(sink or ()))), plan)


@_checks.required_arguments(layout=_arguments.LAYOUT_HINT)
def dq_accum_from_dq(dq, scale, *, layout: AccumLayout, cu_seqlens_q=None, seqused_q=None):
    """The transpose of :func:`dq_postprocess`, which scales too: ``dq_postprocess(dq_accum_from_dq(dq, s), s)``
    is ``dq * s**2`` (rounded; exactly where ``s`` is a power of two).

    Dense: ``dq`` ``(B, S, H, D)`` -> ``(B, H, Sr * Da)``. Varlen (``cu_seqlens_q`` given): ``dq`` ``(T, H, D)``
    -> ``(H, Tp * Da)``. Every position that ``dq_postprocess`` reads element ``(i, j)`` from holds
    ``float32(scale) * float32(dq[i, j])`` (one fp32 multiply); every other entry (padding rows and columns,
    rows past ``seqused_q``, rows no sequence covers) is 0. With ``scale = 1`` it builds the accumulator a producer
    would have written for ``dq`` (in ``layout``'s order) and inverts ``dq_postprocess`` on bf16/fp16 values.

    Args:
      dq: a floating-point array, ``(B, S, H, D)`` or, with ``cu_seqlens_q``, ``(T, H, D)``.
      scale: as :func:`dq_postprocess`'s.
      layout: the :class:`AccumLayout` to write in, required (``AccumLayout.row_major()`` for an accumulator made
        in JAX).
      cu_seqlens_q, seqused_q: as in :func:`dq_postprocess`.

    Returns:
      The float32 accumulator, shaped as ``layout.accum_shape`` or ``layout.varlen_accum_shape`` say.

    Raises:
      TypeError, ValueError: as :func:`dq_postprocess`, naming the argument; a ``dq`` of the wrong rank.
    """
    _arguments.check_layout(layout)
    dq = jnp.asarray(dq)
    if not jnp.issubdtype(dq.dtype, jnp.floating):
        raise TypeError(f"dq must be a floating-point array, got dtype {dq.dtype}")
    packed = cu_seqlens_q is not None
    if dq.ndim != (3 if packed else 4):
        want = "(T, H, D) with cu_seqlens_q" if packed else "(B, S, H, D)"
        raise ValueError(f"dq must have shape {want}, got shape {dq.shape}")
    head_dim = int(dq.shape[-1])
    layout.check_head_dim(head_dim)
    scale = _arguments.scale_operand(scale)
    if packed:
        part, aux = _arguments.part(layout, head_dim, dq.dtype, None, int(dq.shape[0]), cu_seqlens_q, seqused_q)
    else:
        part, aux = _arguments.part(layout, head_dim, dq.dtype, int(dq.shape[1]), None, None, seqused_q)
        if aux.shape != part.aux_shape(dq.shape[0]):
            raise ValueError(f"seqused_q must have shape {part.aux_shape(dq.shape[0])}, got {aux.shape}")
    dq, scale, aux = _jax_internals.vary_alike(dq, scale, aux)  # inside shard_map: the result varies as they do
    return accum_from_dq_reference(dq, scale, aux, part)


