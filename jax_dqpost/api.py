"""Public entry points: argument checks with clear errors, the call's :class:`~jax_dqpost.plan.Plan`, then
``bind``."""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import _validate
from ._validate import describe
from .layout import AccumLayout
from .fused import postprocess_p
from .plan import ARG_NAMES, OUT_DTYPES, SINK_DTYPES, ArgNames, FusedPlan, Plan
from .primitive import dq_postprocess_p
from .reference import accum_from_dq_reference
from .varlen import INT32_MAX, WorkList, check_static

_LAYOUT_HINT = ("AccumLayout.flash_attention(arch, head_dim) gives FlashAttention-4's dQ order, "
                "AccumLayout.flash_attention(arch, head_dim, tensor='dkv') its dK/dV order, AccumLayout(arch=None) a "
                "row-major one")


def _layout_required(name: str):
    """The decorated function's keyword-only ``name`` (no default: an accumulator read in another order gives wrong
    values, not an error) raises, when missing, a ``TypeError`` that says how to get a layout."""
    def wrap(fn):
        @functools.wraps(fn)
        def checked(*args, **kwargs):
            if name not in kwargs:
                raise TypeError(f"{fn.__name__}() needs {name}=, the AccumLayout of the producer's accumulator: "
                                f"{_LAYOUT_HINT}")
            return fn(*args, **kwargs)
        return checked
    return wrap


@_layout_required("layout")
def dq_postprocess(dq_accum, scale, *, head_dim: int, seqlen_q: int | None = None, total_q: int | None = None,
                   cu_seqlens_q=None, seqused_q=None, dtype=jnp.bfloat16, layout: AccumLayout,
                   learnable_sink=None, lse=None, dpsum=None):
    """FlashAttention's backward dQ postprocess: ``dQ = round(scale * dq_accum)`` in natural layout.

    Dense batches (``seqlen_q`` given)::

        dq_accum: float32 (B, H, Sr * Dr)  ->  dq: (B, S, H, D)

    with ``Sr = ceil(S / P) * P`` (``P = tile_m * cluster_size``, ``layout.pad_rows``) and
    ``Dr = ceil(D / hdim_multiple_of) * hdim_multiple_of``. Tile
    ``(b, h, m)`` is ``dq_accum[b, h, m*tile_m*Dr : (m+1)*tile_m*Dr]`` in the producer's register order.
    With ``seqused_q`` (B,), rows ``>= seqused_q[b]`` of batch ``b`` are zero.

    Variable-length batches (``cu_seqlens_q`` (B+1,) and ``total_q`` given)::

        dq_accum: float32 (H, Tp * Dr)  ->  dq: (T, H, D),   Tp = ceil((T + B*P) / P) * P

    Sequence ``b`` is dq rows ``cu[b] .. cu[b] + len_b`` with ``len_b = seqused_q[b]`` if given, else
    ``cu[b+1] - cu[b]``; its accumulator starts at padded row ``(cu[b] + b*P) // P * P``
    (FlashAttention's allocation). Rows no sequence covers are zero.

    Args:
      dq_accum: the accumulator as the producer described by ``layout`` wrote it (shapes above).
      scale: the softmax scale: a Python float or a floating-point scalar, traced or not; converted to
        float32 (round-to-nearest) first. Changing it never recompiles the kernel.
      head_dim: ``D``, a multiple of 8, at most 256.
      seqlen_q: ``S`` (dense).
      total_q: ``T``, rows of the packed output (varlen).
      cu_seqlens_q: varlen offsets: Python ints or a numpy array (static: validated now, exact launch grid) or a
        jax int32 array (an operand: new values never retrace or recompile). Values this host can read now (a jax
        array passed outside ``jit``, read back with a device-to-host copy) are validated like static ones (lengths
        against traced offsets: only their sign); traced values are not: corrupt ones are clamped into a partition
        of the rows, never read or written out of bounds.
      seqused_q: lengths actually used, ``(B,)``: static ints or an int32 array, like ``cu_seqlens_q``.
      dtype: ``jnp.bfloat16`` or ``jnp.float16``, the type of dQ.
      layout: :class:`AccumLayout` of the producer (required: an accumulator read in another order gives wrong
        values, not an error). ``AccumLayout.flash_attention(arch, head_dim)`` gives FlashAttention-4's dQ order,
        ``AccumLayout(arch=None)`` a row-major one.
      learnable_sink, lse, dpsum: with a learnable sink, also return its gradient (see
        :func:`flash_attention_postprocess`), computed in the same launch.

    Returns:
      dq of ``dtype``, every element defined: ``round_to_nearest_even(float32(scale) * acc[F(i, j)])`` for
      covered rows, 0 elsewhere; ``(dq, dsink)`` with a sink.
    """
    _check_layout(layout, "layout")
    head_dim = _validate.head_dim(head_dim)
    layout.check_head_dim(head_dim)
    out_dtype = _out_dtype(dtype)
    dq_accum = _accumulator("dq_accum", dq_accum)
    scale = _scale_operand(scale)
    plan, aux = _plan(layout, head_dim, out_dtype, seqlen_q, total_q, cu_seqlens_q, seqused_q)
    sink = _sink_operands(learnable_sink, lse, dpsum)
    if sink is None and layout.cluster_size == 1:
        return dq_postprocess_p.bind(dq_accum, scale, aux, plan=plan)
    # With a sink or a clustered layout: the fused kernel, with dQ alone.
    fplan = FusedPlan(plan, sink_dtype=None if sink is None else sink[0].dtype,
                      dsink_dtype=None if sink is None else sink[0].dtype)
    scales = jnp.stack([scale, jnp.float32(1), jnp.float32(1)])
    outs = postprocess_p.bind(*fplan.join((dq_accum,), (aux,), scales, *(sink or ())), fplan=fplan)
    return outs[0] if sink is None else (outs[0], outs[1])


@_layout_required("dq_layout")
def flash_attention_postprocess(dq_accum, dk_accum, dv_accum, softmax_scale, *, head_dim: int,
                                head_dim_v: int | None = None, dtype=jnp.bfloat16, dq_layout: AccumLayout,
                                dkv_layout: AccumLayout | None = None, dk_scale=None, seqlen_q: int | None = None,
                                seqlen_k: int | None = None, total_q: int | None = None, total_k: int | None = None,
                                cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                                learnable_sink=None, lse=None, dpsum=None):
    """FlashAttention's whole backward postprocess in one kernel launch: dQ, dK and dV (grouped-query attention,
    where the backward accumulates dK/dV in fp32 too) and the learnable sink's gradient.

    Each tensor is converted as :func:`dq_postprocess` converts dQ (one fp32 multiply, one rounding), with its
    own layout, head dim, sequence side and scale::

        dQ: dq_accum (B, H, Sr*Dr) or (H, Tp*Dr)        -> dq (B, S, H, D) or (T, H, D)      scale softmax_scale
        dK: dk_accum (B, Hkv, Skr*Dr) or (Hkv, Tkp*Dr)  -> dk (B, Sk, Hkv, D) or (Tk, Hkv, D)  scale dk_scale
        dV: dv_accum (B, Hkv, Skr*Dvr) or (Hkv, Tkp*Dvr) -> dv (B, Sk, Hkv, Dv) or (Tk, Hkv, Dv)  scale 1

    ``Sr``, ``Tp`` (q side, ``dq_layout``) and ``Skr``, ``Tkp`` (k side, ``dkv_layout``; its rows are key rows)
    as :func:`dq_postprocess` defines them; ``Dr``, ``Dvr``: ``head_dim``, ``head_dim_v`` padded by the layout.
    ``Hkv`` must divide ``H``. The q side is dense (``seqlen_q``) or packed (``cu_seqlens_q``, ``total_q``,
    optional ``seqused_q``), the k side likewise with ``seqlen_k`` / ``cu_seqlens_k``, ``total_k``,
    ``seqused_k``; offsets static or traced, independently; both sides hold the same ``B`` sequences (a packed
    side's ``B`` is ``len(cu_seqlens) - 1``). ``dk_accum`` and ``dv_accum`` may both be None (no
    grouped-query attention: the backward wrote dK and dV itself); dk and dv are then None.

    With a learnable sink (``learnable_sink`` (H,) of float32, bfloat16 or float16, and ``lse`` and ``dpsum``
    float32, as FlashAttention's backward has them: dense ``lse`` (B, H, S), ``dpsum`` (B, H, Sr); packed ``lse``
    (H, T), ``dpsum`` (H, Tp)), also ``dsink`` (H,) of the sink's dtype::

        dsink[h] = sum over sequences b, rows r < len_b of  -exp(sink[h] - lse[b, h, r]) * dpsum[b, h, r]

    (the exponential is 1 where ``lse = -inf``; packed rows at ``lse[h, cu_q[b] + r]`` and ``dpsum[h,
    padded_offset_b + r]``; ``len_b`` honours ``seqused_q``). On the GPU it is reduced in FlashAttention-4's
    order, deterministically (bit-identical to flash-attn 4.0.0b36); elsewhere by a float32 sum.

    Args:
      dq_accum, dk_accum, dv_accum: the float32 accumulators (shapes above).
      softmax_scale: dQ's scale (a Python float or a floating-point scalar, traced or not).
      head_dim, head_dim_v: ``D`` and ``Dv`` (default ``D``).
      dtype: ``jnp.bfloat16`` or ``jnp.float16``, the type of dq, dk, dv.
      dq_layout, dkv_layout: the producer's :class:`AccumLayout` of dQ and of dK/dV
        (``AccumLayout.flash_attention(arch, head_dim, tensor="dq" | "dkv")``).
      dk_scale: dK's scale; default ``softmax_scale`` (FlashAttention-4; FlashAttention-3 passes 1.0).

    Returns:
      ``(dq, dk, dv)``, or ``(dq, dk, dv, dsink)`` with a sink.
    """
    _check_layout(dq_layout, "dq_layout")
    head_dim = _validate.head_dim(head_dim)
    head_dim_v_arg = head_dim_v
    head_dim_v = head_dim if head_dim_v is None else _validate.head_dim(head_dim_v, name="head_dim_v")
    dq_layout.check_head_dim(head_dim)
    out_dtype = _out_dtype(dtype)
    dq_accum = _accumulator("dq_accum", dq_accum)
    scale = _scale_operand(softmax_scale, "softmax_scale")
    k_scale = scale if dk_scale is None else _scale_operand(dk_scale, "dk_scale")
    q_plan, q_aux = _plan(dq_layout, head_dim, out_dtype, seqlen_q, total_q, cu_seqlens_q, seqused_q)
    if (dk_accum is None) != (dv_accum is None):
        raise ValueError("dk_accum and dv_accum must be given together (grouped-query attention) or both be None, "
                         f"got dk_accum={'None' if dk_accum is None else 'an array'}, "
                         f"dv_accum={'None' if dv_accum is None else 'an array'}")
    sink = _sink_operands(learnable_sink, lse, dpsum)
    sink_dtype = None if sink is None else sink[0].dtype
    if dk_accum is None:
        unused = {name: v for name, v in (("dkv_layout", dkv_layout), ("head_dim_v", head_dim_v_arg),
                                          ("dk_scale", dk_scale), ("seqlen_k", seqlen_k), ("total_k", total_k),
                                          ("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k)) if v is not None}
        if unused:
            raise ValueError(f"{', '.join(unused)} only apply with dk_accum and dv_accum")
        fplan = FusedPlan(q_plan, sink_dtype=sink_dtype, dsink_dtype=sink_dtype)
        args = fplan.join((dq_accum,), (q_aux,), jnp.stack([scale, k_scale, jnp.float32(1)]), *(sink or ()))
        outs = postprocess_p.bind(*args, fplan=fplan)
        return (outs[0], None, None) + ((outs[1],) if sink is not None else ())
    if dkv_layout is None:
        raise ValueError("dkv_layout is required with dk_accum and dv_accum (AccumLayout.flash_attention(arch, "
                         "head_dim, tensor='dkv') gives FlashAttention-4's)")
    _check_layout(dkv_layout, "dkv_layout")
    dkv_layout.check_head_dim(head_dim)
    dkv_layout.check_head_dim(head_dim_v, "head_dim_v")
    dk_accum = _accumulator("dk_accum", dk_accum)
    dv_accum = _accumulator("dv_accum", dv_accum)
    k_plan, k_aux = _plan(dkv_layout, head_dim, out_dtype, seqlen_k, total_k, cu_seqlens_k, seqused_k,
                           ARG_NAMES["dk"])
    v_plan = dataclasses.replace(k_plan, head_dim=head_dim_v)
    fplan = FusedPlan(q_plan, k_plan, v_plan, sink_dtype=sink_dtype, dsink_dtype=sink_dtype)
    fplan.check_batch((dq_accum.shape, dk_accum.shape))
    args = fplan.join((dq_accum, dk_accum, dv_accum), (q_aux, k_aux), jnp.stack([scale, k_scale, jnp.float32(1)]),
                      *(sink or ()))
    return tuple(postprocess_p.bind(*args, fplan=fplan))


@_layout_required("layout")
def dq_accum_from_dq(dq, scale, *, layout: AccumLayout, cu_seqlens_q=None, seqused_q=None):
    """The transpose of :func:`dq_postprocess`: build the float32 accumulator a producer would have written.

    Dense: ``dq`` ``(B, S, H, D)`` -> ``(B, H, Sr * Dr)``. Varlen (``cu_seqlens_q`` given): ``dq`` ``(T, H, D)``
    -> ``(H, Tp * Dr)``. Every position that ``dq_postprocess`` reads element ``(i, j)`` from holds
    ``float32(scale) * float32(dq[i, j])`` (one fp32 multiply); every other entry (padding rows and columns,
    rows past ``seqused_q``, rows no sequence covers) is 0. With ``scale = 1`` it inverts
    ``dq_postprocess`` on bf16/fp16 values; it is also how to build an accumulator in a given order.
    ``layout`` (required), ``cu_seqlens_q`` / ``seqused_q``: as in :func:`dq_postprocess`.
    """
    _check_layout(layout)
    dq = jnp.asarray(dq)
    if not jnp.issubdtype(dq.dtype, jnp.floating):
        raise TypeError(f"dq must be a floating-point array, got dtype {dq.dtype}")
    packed = cu_seqlens_q is not None
    if dq.ndim != (3 if packed else 4):
        want = "(T, H, D) with cu_seqlens_q" if packed else "(B, S, H, D)"
        raise ValueError(f"dq must have shape {want}, got shape {dq.shape}")
    head_dim = int(dq.shape[-1])
    layout.check_head_dim(head_dim)
    scale = _scale_operand(scale)
    if packed:
        plan, aux = _plan(layout, head_dim, dq.dtype, None, int(dq.shape[0]), cu_seqlens_q, seqused_q)
    else:
        plan, aux = _plan(layout, head_dim, dq.dtype, int(dq.shape[1]), None, None, seqused_q)
        if aux.shape != plan.aux_shape(dq.shape[0]):
            raise ValueError(f"seqused_q must have shape {plan.aux_shape(dq.shape[0])}, got {aux.shape}")
    return accum_from_dq_reference(dq, scale, aux, plan)


def _plan(layout, head_dim, dtype, seqlen_q, total_q, cu_seqlens_q, seqused_q,
          names: ArgNames = ARG_NAMES["dq"]) -> tuple[Plan, object]:
    """The call's plan and its int32 aux operand (empty, seqused or the work list), with the checks of
    dq_postprocess; messages name the arguments as ``names`` does."""
    seqlen_n, total_n, cu_n, used_n = names.seqlen, names.total, names.cu_seqlens, names.seqused
    if cu_seqlens_q is None:
        if total_q is not None:
            raise ValueError(f"{total_n}={total_q!r} is only for variable-length batches (with {cu_n})")
        if seqlen_q is None:
            raise ValueError(f"{seqlen_n} is required for dense batches (or pass {cu_n} and {total_n})")
        plan = Plan(layout, head_dim, dtype, seqlen_q=_validate.static_int(seqlen_n, seqlen_q, minimum=0),
                    seqused_q=seqused_q is not None)
        if seqused_q is None:
            return plan, jnp.zeros((0,), jnp.int32)
        if _is_static(seqused_q):
            used = _static_ints(used_n, seqused_q)
            _check_dense_seqused(used, plan.seqlen_q, names)
            return plan, jnp.asarray(np.asarray(used, np.int32).reshape(-1))
        used, values = _int_array(used_n, seqused_q), _visible_ints(used_n, seqused_q)
        if values is not None:  # still an operand the kernel reads at run time; the values seen now are checked
            _check_dense_seqused(values, plan.seqlen_q, names)
        return plan, used

    if seqlen_q is not None:
        raise ValueError(f"{seqlen_n}={seqlen_q!r} is only for dense batches; variable-length batches take {total_n}")
    if total_q is None:
        raise ValueError(f"{total_n} (rows of the packed output) is required with {cu_n}")
    total_q = _validate.static_int(total_n, total_q, minimum=0)
    if _is_static(cu_seqlens_q) and (seqused_q is None or _is_static(seqused_q)):
        cu = _static_ints(cu_n, cu_seqlens_q)
        used = None if seqused_q is None else _static_ints(used_n, seqused_q)
        check_static(cu, used, total_q, names)
        _check_int32_range(total_q, len(cu) - 1, layout.pad_rows, total_n)
        work, meta = WorkList.build(np, np.asarray(cu), None if used is None else np.asarray(used),
                                    total_q=total_q, layout=layout)
        return Plan(layout, head_dim, dtype, work=work), jnp.asarray(meta)
    cu = _int_array(cu_n, _static_as_array(cu_seqlens_q))
    used = None if seqused_q is None else _int_array(used_n, _static_as_array(seqused_q))
    cu_values = _visible_ints(cu_n, cu_seqlens_q)
    used_values = None if used is None else _visible_ints(used_n, seqused_q)
    if cu_values is not None:  # still operands the kernel reads at run time; the values seen now are checked
        check_static(cu_values, used_values, total_q, names)
    elif used_values is not None:  # traced offsets: only the lengths' sign can be checked without them
        bad = [(b, u) for b, u in enumerate(used_values) if u < 0]
        if bad:
            raise ValueError(f"{used_n}[{bad[0][0]}]={bad[0][1]} must be >= 0")
    if cu.shape[0] < 2:
        raise ValueError(f"{cu_n} must have at least 2 entries (batch + 1), got shape {cu.shape}")
    batch = cu.shape[0] - 1
    if used is not None and used.shape != (batch,):
        raise ValueError(f"{used_n} must have shape ({batch},) to match {cu_n}, got {used.shape}")
    _check_int32_range(total_q, batch, layout.pad_rows, total_n)
    work, meta = WorkList.build(jnp, cu, used, total_q=total_q, layout=layout,
                                num_tiles=WorkList.max_tiles(total_q, batch, layout))
    return Plan(layout, head_dim, dtype, work=work), meta


def _check_layout(layout, name: str = "layout") -> None:
    if not isinstance(layout, AccumLayout):
        raise TypeError(f"{name} must be an AccumLayout, got {describe(layout)} ({_LAYOUT_HINT})")


def _accumulator(name: str, x):
    """A float32 accumulator operand (``TypeError`` naming the argument otherwise)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None and isinstance(x, (list, tuple)):
        x = np.asarray(x, np.float32)
        dtype = x.dtype
    if dtype is None or np.dtype(dtype) != np.float32:
        raise TypeError(f"{name} must be float32, got {describe(x) if dtype is None else np.dtype(dtype).name}")
    return jnp.asarray(x)


def _sink_operands(learnable_sink, lse, dpsum):
    """``(learnable_sink, lse, dpsum)`` as operands, or None without a sink; all three or none."""
    given = {name: v is not None for name, v in (("learnable_sink", learnable_sink), ("lse", lse), ("dpsum", dpsum))}
    if not any(given.values()):
        return None
    if not all(given.values()):
        missing = [name for name, g in given.items() if not g]
        raise ValueError(f"the sink gradient needs learnable_sink, lse and dpsum; missing {', '.join(missing)}")
    sink_dtype = getattr(learnable_sink, "dtype", None)
    if sink_dtype is None or np.dtype(sink_dtype) not in SINK_DTYPES:
        raise TypeError("learnable_sink must be a float32, bfloat16 or float16 array, got "
                        + (describe(learnable_sink) if sink_dtype is None else f"dtype {sink_dtype}"))
    return (jnp.asarray(learnable_sink), _accumulator("lse", lse), _accumulator("dpsum", dpsum))


def _out_dtype(dtype) -> np.dtype:
    """dQ's dtype: bfloat16 or float16 (``None`` is not float64 here)."""
    try:
        out = None if dtype is None else np.dtype(dtype)
    except TypeError:
        out = None
    if out is None:
        raise TypeError(f"dtype must be jnp.bfloat16 or jnp.float16, got {describe(dtype)}")
    if out not in OUT_DTYPES:
        raise ValueError(f"dtype must be jnp.bfloat16 or jnp.float16, got {out.name}")
    return out


def _is_static(x) -> bool:
    """Python sequences of ints and numpy arrays are static; jax arrays (and tracers) are device data."""
    return isinstance(x, (list, tuple, range, np.ndarray))


def _visible_ints(name: str, x) -> list[int] | None:
    """The values of offsets or lengths if this host can read them now: static ones, or a jax array that is not a
    tracer (outside jit, or a constant inside it); None for traced values."""
    concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_fully_addressable
    return _static_ints(name, x) if concrete or _is_static(x) else None


def _check_dense_seqused(used: list[int], seqlen: int, names: ArgNames) -> None:
    bad = [(b, u) for b, u in enumerate(used) if not 0 <= u <= seqlen]
    if bad:
        raise ValueError(f"{names.seqused}[{bad[0][0]}]={bad[0][1]} must be in [0, {names.seqlen}={seqlen}]")


def _static_ints(name: str, x) -> list[int]:
    arr = np.asarray(x)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{name} must be a 1-D sequence of ints, got {describe(x)}")
    return [int(v) for v in arr]


def _static_as_array(x):
    return np.asarray(x) if isinstance(x, (list, tuple, range)) else x


def _int_array(name: str, x):
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array or a sequence of Python ints, got {type(x).__name__} "
                        f"of dtype {dtype}")
    if np.ndim(x) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {np.shape(x)}")
    return jnp.asarray(x).astype(jnp.int32)


def _check_int32_range(total_q: int, batch: int, pad_rows: int, name: str = "total_q") -> None:
    if total_q + (batch + 2) * pad_rows > INT32_MAX:
        raise ValueError(f"{name}={total_q} with batch={batch} overflows the int32 row offsets")


def _scale_operand(scale, name: str = "scale"):
    """scale as a float32 scalar operand: a Python real or a floating-point scalar array (traced or not)."""
    if isinstance(scale, numbers.Real) and not isinstance(scale, (bool, np.bool_)):
        return jnp.float32(scale)
    dtype = getattr(scale, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a Python float or a floating-point scalar, got {describe(scale)}"
                        + ("" if dtype is None else f" of dtype {dtype}"))
    if np.shape(scale) != ():
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(scale)}")
    return jnp.asarray(scale).astype(jnp.float32)
