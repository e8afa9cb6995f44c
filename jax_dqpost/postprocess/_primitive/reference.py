"""The jax.numpy semantics of the op: the lowering on every platform other than CUDA.

Bit-exact with the kernel: a gather by the layout's index map, one IEEE fp32 multiply by ``scale``
(round-to-nearest-even, gradual underflow) and one conversion to bf16/fp16 (round-to-nearest-even).
Rows that no sequence covers are zero.

The multiply and the conversion to bf16 are done in integer arithmetic: XLA's CPU runtime computes with
denormals flushed to zero (FTZ/DAZ), while the GPU kernel's ``mul.f32`` and ``cvt.rn.bf16.f32`` keep them, so a
plain ``x * scale`` or ``astype`` would differ from the kernel for tiny values (whether XLA's ``convert`` sees a
denormal as zero depends on how it fuses it, and differs between jax versions). fp16 needs no such care: float32
denormals are far below its smallest subnormal and round to a signed zero either way.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .plan import Part, Plan

LOG2_E = math.log2(math.e)  # exp(x) = exp2(x * log2(e)), as FlashAttention computes it


def part_reference(acc, scale, aux, part: Part):
    """One part's result: ``round(float32(scale) * acc)`` gathered into its natural layout, zeros elsewhere."""
    x, keep = gather_accumulator(acc, aux, part)
    y = round_to(mul_f32_rn(x, jnp.asarray(scale, jnp.float32)), part.dtype)
    return jnp.where(keep, y, jnp.zeros((), part.dtype))


def postprocess_reference(*args, plan: Plan):
    """The primitive's semantics (operands and results in ``_kernel/abi.py``'s order): each part with its own scale, and
    the sink gradient (:func:`dsink_reference`)."""
    ops = plan.group(args)
    outs = [part_reference(acc, ops.scales[i], aux, p)
            for i, (p, acc, aux) in enumerate(zip(plan.parts, ops.acc, plan.part_aux(ops)))]
    if plan.has_sink:
        outs.append(dsink_reference(ops.learnable_sink, ops.lse, ops.dpsum, ops.aux[0], plan.dq)
                    .astype(plan.dsink_dtype))
    return outs


def dsink_terms(sink, lse, dpsum, q_aux, part: Part):
    """``(H, N)`` float32: every row's ``-p * dpsum`` (0 for rows outside the sequences), ``p = exp2((sink -
    lse) * log2(e))`` (1 where ``lse = -inf``). Dense rows are the ``(b, r)`` pairs, varlen rows the packed rows."""
    if part.work is not None:
        w, s = part.work, part.work.decode(q_aux)
        k, i = _row_spans(w, s)
        keep = ((k >= 1) & (k <= w.batch) & (i < s.conv_rows[k]))[None, :]  # sequences' rows, seqused honoured
        at = jnp.clip(s.acc_row[k] + i, 0, w.padded_total - 1)  # the row's padded offset in dpsum
        lse_rows, dpsum_rows = lse, jnp.take(dpsum, at, axis=1)  # (H, T)
    else:
        seqlen, batch, heads = part.seqlen, lse.shape[0], lse.shape[1]
        used = _rows_used(q_aux, seqlen) if part.seqused else jnp.ones((batch, seqlen), bool)
        keep = jnp.broadcast_to(used[None], (1, batch, seqlen)).reshape(1, batch * seqlen)
        lse_rows = jnp.moveaxis(lse, 1, 0).reshape(heads, batch * seqlen)  # (H, B * S)
        dpsum_rows = jnp.moveaxis(dpsum[:, :, :seqlen], 1, 0).reshape(heads, batch * seqlen)
    sink = jnp.asarray(sink).astype(jnp.float32)[:, None]
    lse_rows = lse_rows.astype(jnp.float32)
    attended = lse_rows != -jnp.inf
    # The exponent of a row that attended to nothing is taken at 0, so that neither branch of the where has an
    # infinite value or gradient (a where passes the other branch's NaN gradient through).
    p = jnp.where(attended, jnp.exp2((sink - jnp.where(attended, lse_rows, sink)) * jnp.float32(LOG2_E)), 1.0)
    return jnp.where(keep, -p * dpsum_rows.astype(jnp.float32), 0.0)


def dsink_reference(sink, lse, dpsum, q_aux, part: Part):
    """The learnable sink's gradient, float32 ``(H,)``: the sum of :func:`dsink_terms` over the rows
    (deterministic; the GPU kernel sums in FlashAttention-4's order instead, see ``_kernel/kernel.py``)."""
    return jnp.sum(dsink_terms(sink, lse, dpsum, q_aux, part), axis=1)


def gather_accumulator(acc, aux, part: Part):
    """The accumulator values of every output element, in the output's shape, as float32, and a mask that
    is False where the output is zero (rows past seqused, rows no sequence covers)."""
    if part.work is not None:
        return _varlen_gather(acc, aux, part)
    return _dense_gather(acc, aux if part.seqused else None, part)


def accum_from_dq_reference(dq, scale, aux, part: Part):
    """The transpose of the op: the float32 accumulator with ``scale * dq[i, j]`` (one fp32 multiply) at the
    position the op reads element (i, j) from, and 0 in every other entry (padding, unread rows).
    ``dq``: ``(B, S, H, D)`` (dense) or ``(T, H, D)`` (varlen)."""
    layout, tile_m, dr = part.layout, part.layout.tile_m, part.padded_head_dim
    x = mul_f32_rn(widen(dq), jnp.asarray(scale, jnp.float32))
    inverse = jnp.asarray(np.argsort(layout.tile_index_map(part.head_dim).ravel()).astype(np.int32))
    if part.work is not None:
        heads, w = dq.shape[1], part.work
        if w.batch == 0:  # no sequence: no row is read
            return jnp.zeros((heads, w.padded_total * part.alloc_head_dim), jnp.float32)
        s = w.decode(aux)
        row_start, span_rows, conv_rows, acc_row = (f[1:-1] for f in (s.row_start, s.span_rows, s.conv_rows,
                                                                      s.acc_row))  # the sequences' spans
        # The sequence (if any) whose tiles hold each accumulator row, and the dq row it came from.
        a = jnp.arange(w.padded_total, dtype=jnp.int32)
        ends = acc_row + (span_rows + tile_m - 1) // tile_m * tile_m
        b = jnp.clip(jnp.searchsorted(acc_row, a, side="right") - 1, 0, w.batch - 1)
        local = a - acc_row[b]
        valid = (a >= acc_row[b]) & (a < ends[b]) & (local < conv_rows[b])
        src = jnp.where(valid, row_start[b] + local, 0)
        logical = jnp.where(valid[None, :, None], jnp.transpose(x[src], (1, 0, 2)), 0.0)  # (H, Tp, D)
        logical = jnp.pad(logical, ((0, 0), (0, 0), (0, dr - part.head_dim)))
        tiles = logical.reshape(heads, w.padded_total // tile_m, tile_m * dr)
        return _alloc_rows(jnp.take(tiles, inverse, axis=2).reshape(heads, w.padded_total * dr), part)
    batch, seqlen, heads = dq.shape[0], part.seqlen, dq.shape[2]
    y = jnp.transpose(x, (0, 2, 1, 3))  # (B, H, S, D)
    if part.seqused:
        y = jnp.where(_rows_used(aux, seqlen)[:, None, :, None], y, 0.0)
    padded_rows = layout.padded_seqlen(seqlen)
    y = jnp.pad(y, ((0, 0), (0, 0), (0, padded_rows - seqlen), (0, dr - part.head_dim)))
    tiles = y.reshape(batch, heads, padded_rows // tile_m, tile_m * dr)
    return _alloc_rows(jnp.take(tiles, inverse, axis=3).reshape(batch, heads, padded_rows * dr), part)


def _alloc_rows(rows, part: Part):
    """Rows of tiles (last axis ``Sr * Dr`` or ``Tp * Dr``) as the layout allocates them: ``Sr * Da`` (``Tp * Da``)
    floats, zeros after the tiles."""
    extra = rows.shape[-1] // part.padded_head_dim * (part.alloc_head_dim - part.padded_head_dim)
    return jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, extra)]) if extra else rows


def _tile_rows(acc, part: Part):
    """The tiles of each (batch, head) row of ``acc`` (last axis ``Sr * Da`` or ``Tp * Da``): its first ``Sr * Dr``
    (``Tp * Dr``) floats."""
    return acc[..., :acc.shape[-1] // part.alloc_head_dim * part.padded_head_dim]


def _rows_used(seqused, seqlen: int):
    """(B, S) bool: row s of batch b is below its (clamped) ``seqused[b]``."""
    used = jnp.clip(seqused.astype(jnp.int32), 0, seqlen)
    return jnp.arange(seqlen, dtype=jnp.int32)[None, :] < used[:, None]


def _dense_gather(acc, seqused, part: Part):
    batch, heads, _ = acc.shape
    layout, seqlen, head_dim = part.layout, part.seqlen, part.head_dim
    tile_m, dr = layout.tile_m, part.padded_head_dim
    num_blocks = layout.padded_seqlen(seqlen) // tile_m
    # Positions of the wanted (row, column) elements inside one tile, rows < tile_m, columns < D.
    index = layout.tile_index_map(head_dim)[:, :head_dim].astype(np.int32)
    tiles = _tile_rows(acc, part).reshape(batch, heads, num_blocks, tile_m * dr)
    x = jnp.take(tiles, jnp.asarray(index.ravel()), axis=3, unique_indices=True)
    x = x.reshape(batch, heads, num_blocks * tile_m, head_dim)[:, :, :seqlen, :]
    x = jnp.transpose(x, (0, 2, 1, 3))  # (B, S, H, D)
    if seqused is None:
        return x, jnp.ones((), bool)
    return x, _rows_used(seqused, seqlen)[:, :, None, None]


def _row_spans(w, s):
    """The span of every output row (spans partition [0, T) in order) and the row's index inside it."""
    r = jnp.arange(w.total, dtype=jnp.int32)
    k = jnp.clip(jnp.searchsorted(s.row_start + s.span_rows, r, side="right"), 0, w.num_spans - 1)
    return k, r - s.row_start[k]


def _varlen_gather(acc, work_list, part: Part):
    heads, w = acc.shape[0], part.work
    tile_m, dr, head_dim = part.layout.tile_m, part.padded_head_dim, part.head_dim
    s = w.decode(work_list)
    k, i = _row_spans(w, s)
    converted = i < s.conv_rows[k]
    # Accumulator tile of each row, and each element's position inside its tile.
    tile = jnp.where(converted, (s.acc_row[k] + i // tile_m * tile_m) // tile_m, 0)
    index = jnp.asarray(part.layout.tile_index_map(head_dim)[:, :head_dim].astype(np.int32))
    within = index[i % tile_m]  # (T, D)
    tiles = _tile_rows(acc, part).reshape(heads, -1, tile_m * dr)
    x = jnp.transpose(tiles[:, tile[:, None], within], (1, 0, 2))  # (T, H, D)
    return x, converted[:, None, None]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def round_to(x, dtype):
    """float32 ``x`` rounded to ``dtype`` (round-to-nearest-even, gradual underflow, whatever the denormal mode):
    bf16 from the bits (a NaN stays a quiet NaN with the top bits of its payload), fp16 (and any other type) by
    XLA's ``convert``. Differentiable as a conversion."""
    if np.dtype(dtype) != np.dtype(jnp.bfloat16):
        return x.astype(dtype)
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), u32)
    rounded = (bits + u32(0x7FFF) + ((bits >> 16) & u32(1))) >> 16
    nan = (bits & u32(0x7FFFFFFF)) > u32(0x7F800000)
    top = jnp.where(nan, (bits >> 16) | u32(0x40), rounded).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(top, jnp.bfloat16)


@jax.custom_jvp
def widen(x):
    """``x`` as float32, exactly, whatever the denormal mode: bf16 from the bits, other types by ``convert``.
    Differentiable as a conversion."""
    if np.dtype(x.dtype) != np.dtype(jnp.bfloat16):
        return x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@round_to.defjvp
def _round_to_jvp(dtype, primals, tangents):
    return round_to(primals[0], dtype), tangents[0].astype(dtype)


@widen.defjvp
def _widen_jvp(primals, tangents):
    return widen(primals[0]), tangents[0].astype(jnp.float32)


@jax.custom_jvp
def mul_f32_rn(x, y):
    """IEEE-754 binary32 ``x * y``, round-to-nearest-even with subnormals, whatever the denormal mode.

    Integer arithmetic on the bits (uint32 only, so it runs without x64): the 24x24-bit significand
    product is formed exactly as two 24-bit words, then rounded once. NaN results are canonical
    (0x7FFFFFFF). Differentiable as a product (custom JVP).
    """
    u32 = jnp.uint32
    ux = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), u32)
    uy = jax.lax.bitcast_convert_type(jnp.asarray(y, jnp.float32), u32)
    ux, uy = jnp.broadcast_arrays(ux, uy)
    sign = (ux ^ uy) & u32(0x80000000)

    def unpack(u):
        e = ((u >> 23) & 0xFF).astype(jnp.int32)
        f = u & u32(0x7FFFFF)
        is_nan = (e == 255) & (f != 0)
        is_inf = (e == 255) & (f == 0)
        is_zero = (e == 0) & (f == 0)
        # value = m * 2**exp with m normalised into [2**23, 2**24) (subnormals shifted up).
        m = jnp.where(e == 0, f, f | u32(0x800000))
        exp = jnp.where(e == 0, -149, e - 150)
        shift = jnp.where(e == 0, jax.lax.clz(jnp.maximum(f, u32(1))).astype(jnp.int32) - 8, 0)
        return m << shift.astype(u32), exp - shift, is_nan, is_inf, is_zero

    mx, ex, nan_x, inf_x, zero_x = unpack(ux)
    my, ey, nan_y, inf_y, zero_y = unpack(uy)
    # Exact 48-bit product (hi * 2**24 + lo) from 12-bit halves; every partial product fits in 32 bits.
    xh, xl = mx >> 12, mx & u32(0xFFF)
    yh, yl = my >> 12, my & u32(0xFFF)
    mid = xh * yl + xl * yh  # < 2**25
    lo = xl * yl + ((mid & u32(0xFFF)) << 12)  # < 2**25
    hi = xh * yh + (mid >> 12) + (lo >> 24)
    lo = lo & u32(0xFFFFFF)
    exp = ex + ey + 24  # value = (hi + lo / 2**24) * 2**exp, hi in [2**22, 2**24)
    small = hi < u32(0x800000)
    hi = jnp.where(small, (hi << 1) | (lo >> 23), hi)
    lo = jnp.where(small, (lo << 1) & u32(0xFFFFFF), lo)
    exp = exp - small.astype(jnp.int32)
    biased = exp + 23 + 127  # binary32 exponent field of hi * 2**exp, hi in [2**23, 2**24)

    # Normal result: round hi at the lo boundary.
    half = u32(0x800000)
    up = (lo > half) | ((lo == half) & ((hi & 1) == 1))
    n_hi = hi + up.astype(u32)
    carry = n_hi >> 24
    n_exp = biased + carry.astype(jnp.int32)
    n_man = (n_hi >> carry) & u32(0x7FFFFF)
    normal = jnp.where(n_exp >= 255, u32(0x7F800000), (n_exp.astype(u32) << 23) | n_man)

    # Subnormal result: drop k = 1 - biased more bits of hi (k >= 25 rounds to zero).
    k = jnp.clip(1 - biased, 1, 25).astype(u32)
    kk = jnp.minimum(k, u32(24))
    kept = jnp.where(k >= 25, u32(0), hi >> kk)
    rem = jnp.where(k >= 25, hi, hi & ((u32(1) << kk) - 1))
    halfk = jnp.where(k >= 25, u32(1) << 24, u32(1) << (kk - 1))  # hi < 2**24: k == 25 never ties
    sub_up = (rem > halfk) | ((rem == halfk) & ((lo != 0) | ((kept & 1) == 1)))
    subnormal = kept + sub_up.astype(u32)  # 2**23 here is the smallest normal, bits line up

    bits = jnp.where(biased >= 1, normal, subnormal)
    bits = jnp.where(zero_x | zero_y, u32(0), bits)
    bits = jnp.where(inf_x | inf_y, u32(0x7F800000), bits)
    bits = sign | bits
    nan = nan_x | nan_y | (inf_x & zero_y) | (zero_x & inf_y)
    bits = jnp.where(nan, u32(0x7FFFFFFF), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@mul_f32_rn.defjvp
def _mul_f32_rn_jvp(primals, tangents):
    x, y = primals
    x_dot, y_dot = tangents
    return mul_f32_rn(x, y), jnp.asarray(x_dot, jnp.float32) * y + x * jnp.asarray(y_dot, jnp.float32)
