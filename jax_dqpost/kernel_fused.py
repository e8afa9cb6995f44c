"""The fused CuTe DSL kernel: dQ, dK and dV (and the learnable-sink gradient) in one launch.

Imports cutlass at module import: load this module lazily (``kernel_cache.py`` does).

One-dimensional grid, in this order: with a sink, ``H`` CTAs (one per query head) reducing ``dsink``; then
the CTAs of dQ, of dK and of dV, each part numbered as the single-tensor kernel numbers its grid (dense: heads
fastest, then tiles, then batch, ``x = (b * grid_x + m) * heads + h``; varlen: its grid's numbering). A CTA of a
part runs that part's :meth:`DqPostprocess.cta <jax_dqpost.kernel.DqPostprocess.cta>` unchanged, so each tensor's
bits are those of the single-tensor kernel. The CTA has as many threads as the widest part; a narrower part runs on
its first ``num_threads`` threads and synchronises them with a named barrier. The parts share one shared-memory buffer
(the largest part's tile).

The sink reduction follows flash-attn 4.0.0b36's (``flash_attn/cute/flash_bwd_postprocess.py``,
``dsink_row_term`` and ``block_sum``), so the GPU result has its bits: with ``n`` = dQ's ``num_threads``,
thread ``t < n`` adds ``-p * dpsum`` over rows ``t, t + n, ...`` of sequence 0, then of sequence 1, ... (``p =
exp2((sink - lse) * log2(e))`` with the fast ``ex2.approx``, 1 where ``lse = -inf``), in fp32; each warp sums its
lanes by a butterfly (offsets 1, 2, 4, 8, 16), warp 0 sums the warps' partials the same way, and thread 0
writes ``dsink[h]``. No atomics: the same bits on every run.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from . import varlen
from .kernel import DqPostprocess
from .layout import AccumLayout
from .plan import Tiling

_WARP = 32
_LOG2_E = math.log2(math.e)


class PartSpec(NamedTuple):
    """One tensor of the fused kernel: the accumulator's layout, its padded head dim and the tiling."""

    layout: AccumLayout
    padded_head_dim: int
    tiling: Tiling


class _SharedTile:
    """Hands each part its shared-memory tile on one common buffer (duck-types ``SmemAllocator.allocate_tensor``,
    which ``DqPostprocess.tile`` calls)."""

    def __init__(self, base: cute.Pointer):
        self.base = base

    def allocate_tensor(self, dtype, layout, byte_alignment=1):
        return cute.make_tensor(cute.recast_ptr(self.base, dtype=dtype), layout)


class FusedPostprocess:
    """dQ, and optionally dK and dV and the sink gradient, in one kernel (module docstring).

    ``parts``: :class:`PartSpec` of dQ, then (optionally) of dK and dV. ``sink``: ``(sink type, dsink type)``
    (CuTe numeric types), or None. The binary depends on these, the output dtype and the target GPU only
    (``FusedPlan.kernel_key``).
    """

    def __init__(self, dtype, parts: tuple[PartSpec, ...], sink=None, *, target_sm: int = 90):
        if len(parts) not in (1, 3):
            raise ValueError(f"the fused kernel takes dQ, or dQ, dK and dV; got {len(parts)} parts")
        self.dtype = dtype
        self.parts = tuple(DqPostprocess(dtype, p.layout, p.padded_head_dim, tiling=p.tiling, target_sm=target_sm)
                           for p in parts)
        self.num_threads = max(p.num_threads for p in self.parts)
        for part in self.parts:
            part.cta_threads = self.num_threads
        self.sink = sink
        self.sink_threads = self.parts[0].num_threads  # FlashAttention-4 reduces with the dQ postprocess's CTA
        self.smem_bytes = max(max(p.smem_bytes for p in self.parts), 4 * _WARP)
        self.min_ctas_per_sm = min(p.min_ctas_per_sm for p in self.parts)

    @cute.jit
    def __call__(
        self,
        acc_q: cute.Pointer, out_q: cute.Pointer, aux_q: cute.Pointer,
        acc_k: cute.Pointer, out_k: cute.Pointer, acc_v: cute.Pointer, out_v: cute.Pointer, aux_k: cute.Pointer,
        scales: cute.Pointer,  # fp32 (3,): dQ's, dK's, dV's
        sink: cute.Pointer, lse: cute.Pointer, dpsum: cute.Pointer, dsink: cute.Pointer,
        # Plan.launch_extents of dQ, dK, dV: (dim0, heads, rows, head_dim, grid_x) each (zeros when absent)
        q0: Int32, q1: Int32, q2: Int32, q3: Int32, q4: Int32,
        k0: Int32, k1: Int32, k2: Int32, k3: Int32, k4: Int32,
        v0: Int32, v1: Int32, v2: Int32, v3: Int32, v4: Int32,
        stream: cuda.CUstream,
    ):
        extents = ((q0, q1, q2, q3, q4), (k0, k1, k2, k3, k4), (v0, v1, v2, v3, v4))
        ctas = q1 if const_expr(self.sink is not None) else 0
        for i in cutlass.range_constexpr(len(self.parts)):
            ctas = ctas + self._part_ctas(i, extents[i])
        self.kernel(acc_q, out_q, aux_q, acc_k, out_k, acc_v, out_v, aux_k, scales, sink, lse, dpsum, dsink,
                    q0, q1, q2, q3, q4, k0, k1, k2, k3, k4, v0, v1, v2, v3, v4).launch(
            grid=[ctas, 1, 1],
            block=[self.num_threads, 1, 1],
            smem=self.smem_bytes,
            stream=stream,
            min_blocks_per_mp=self.min_ctas_per_sm,
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(self, acc_q, out_q, aux_q, acc_k, out_k, acc_v, out_v, aux_k, scales, sink, lse, dpsum, dsink,
               q0: Int32, q1: Int32, q2: Int32, q3: Int32, q4: Int32,
               k0: Int32, k1: Int32, k2: Int32, k3: Int32, k4: Int32,
               v0: Int32, v1: Int32, v2: Int32, v3: Int32, v4: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate_array(cutlass.Uint8, self.smem_bytes, byte_alignment=1024)
        tensors = ((acc_q, out_q, aux_q), (acc_k, out_k, aux_k), (acc_v, out_v, aux_k))
        extents = ((q0, q1, q2, q3, q4), (k0, k1, k2, k3, k4), (v0, v1, v2, v3, v4))
        start = Int32(0)
        if const_expr(self.sink is not None):
            start = q1
            if bid < q1:
                if tidx < self.sink_threads:
                    self._reduce_sink(bid, tidx, sink, lse, dpsum, dsink, aux_q, q0, q1, q2, q4, base)
        for i in cutlass.range_constexpr(len(self.parts)):
            acc, out, aux = tensors[i]
            dim0, heads, rows, head_dim, grid_x = extents[i]
            count = self._part_ctas(i, extents[i])
            self._part_tile(i, bid - start, count, tidx, acc, out, scales, aux, dim0, heads, rows, head_dim, grid_x,
                            base)
            start = start + count

    def _part_ctas(self, i: int, extents):
        """CTAs of part ``i`` with these extents (the dense tilings: every batch)."""
        dim0, heads, _, _, grid_x = extents
        count = self.parts[i].num_ctas(dim0, heads, grid_x)
        return count if const_expr(self.parts[i].tiling == Tiling.VARLEN) else count * dim0

    @cute.jit
    def _part_tile(self, i: cutlass.Constexpr, local, count, tidx, acc, out, scales, aux, dim0, heads, rows,
                   head_dim, grid_x, base):
        """CTA ``local`` of part ``i``'s ``count`` CTAs, if it is one (numbered as the single kernel's grid)."""
        if local >= 0 and local < count and tidx < self.parts[i].num_threads:
            if const_expr(self.parts[i].tiling == Tiling.VARLEN):
                self.parts[i].cta(acc, out, scales + i, aux, dim0, heads, rows, head_dim, grid_x, local, Int32(0),
                                  tidx, _SharedTile(base))
            else:
                per_batch = heads * grid_x
                self.parts[i].cta(acc, out, scales + i, aux, dim0, heads, rows, head_dim, grid_x, local % per_batch,
                                  local // per_batch, tidx, _SharedTile(base))

    # ---- the sink gradient ------------------------------------------------------------------------
    def _sink_sync(self):
        if const_expr(self.sink_threads == self.num_threads):
            cute.arch.barrier()
        else:
            cute.arch.barrier(barrier_id=1, number_of_threads=self.sink_threads)

    @cute.jit
    def _reduce_sink(self, head, tidx, sink_ptr, lse_ptr, dpsum_ptr, dsink_ptr, aux_ptr, dim0, heads, rows, grid_x,
                     base):
        """``dsink[head]`` in FlashAttention-4's order (module docstring); threads ``< sink_threads`` only."""
        n = self.sink_threads
        q = self.parts[0]
        sink_val = Float32(cute.make_tensor(sink_ptr, cute.make_layout(heads))[head])
        total = Float32(0.0)
        if const_expr(q.tiling == Tiling.VARLEN):
            num_spans = dim0
            spans_at, tile_span_at = varlen.sections(num_spans)
            meta = cute.make_tensor(aux_ptr, cute.make_layout(tile_span_at + grid_x))
            padded_total = varlen.padded_total(rows, num_spans - 2, q.layout.pad_rows)
            lse_t = cute.make_tensor(lse_ptr, cute.make_layout(Int64(heads) * Int64(rows)))
            dpsum_t = cute.make_tensor(dpsum_ptr, cute.make_layout(Int64(heads) * Int64(padded_total)))
            b = Int32(0)
            while b < num_spans - 2:
                field = spans_at + len(varlen.SPAN_FIELDS) * (b + 1)  # span b + 1 is sequence b
                offset = meta[field + varlen.ROW_START]
                padded_offset = meta[field + varlen.ACC_ROW]
                length = meta[field + varlen.CONV_ROWS]
                # Defence in depth (the work list guarantees them): rows inside lse's and dpsum's.
                length = cutlass.min(length, cutlass.min(rows - offset, padded_total - padded_offset))
                if offset < 0 or padded_offset < 0:
                    length = 0
                lse_at = Int64(head) * Int64(rows) + Int64(offset)
                dpsum_at = Int64(head) * Int64(padded_total) + Int64(padded_offset)
                r = tidx
                while r < length:
                    total += self._row_term(sink_val, lse_t[lse_at + Int64(r)], dpsum_t[dpsum_at + Int64(r)])
                    r += n
                b += 1
        else:
            batch = dim0
            pad = q.layout.pad_rows
            padded_rows = (rows + pad - 1) // pad * pad
            lse_t = cute.make_tensor(lse_ptr, cute.make_layout(Int64(batch) * Int64(heads) * Int64(rows)))
            dpsum_t = cute.make_tensor(dpsum_ptr, cute.make_layout(Int64(batch) * Int64(heads) * Int64(padded_rows)))
            b = Int32(0)
            while b < batch:
                length = rows
                if const_expr(q.tiling == Tiling.DENSE_SEQUSED):
                    seqused = cute.make_tensor(aux_ptr, cute.make_layout(batch))
                    length = cutlass.max(cutlass.min(seqused[b], rows), 0)
                bh = Int64(b) * Int64(heads) + Int64(head)
                r = tidx
                while r < length:
                    total += self._row_term(sink_val, lse_t[bh * Int64(rows) + Int64(r)],
                                            dpsum_t[bh * Int64(padded_rows) + Int64(r)])
                    r += n
                b += 1
        total = self._block_sum(total, tidx, cute.make_tensor(cute.recast_ptr(base, dtype=Float32),
                                                              cute.make_layout(_WARP)))
        if tidx == 0:
            dsink = cute.make_tensor(dsink_ptr, cute.make_layout(heads))
            dsink[head] = total.to(dsink.element_type)

    @cute.jit
    def _row_term(self, sink_val: Float32, lse_val: Float32, dpsum_val: Float32) -> Float32:
        """One row's ``-p * dpsum``; a row with ``lse = -inf`` attended to nothing: the sink holds all of it."""
        p = Float32(1.0)
        if lse_val != -Float32.inf:
            p = cute.math.exp2((sink_val - lse_val) * _LOG2_E, fastmath=True)
        return -p * dpsum_val

    @cute.jit
    def _warp_sum(self, val: Float32) -> Float32:
        for i in cutlass.range_constexpr(int(math.log2(_WARP))):
            val = val + cute.arch.shuffle_sync_bfly(val, offset=1 << i)
        return val

    @cute.jit
    def _block_sum(self, val: Float32, tidx, scratch) -> Float32:
        """The sum over the ``sink_threads`` threads, valid in thread 0."""
        lane, warp = tidx % _WARP, tidx // _WARP
        val = self._warp_sum(val)
        if lane == 0:
            scratch[warp] = val
        self._sink_sync()
        total = Float32(0.0)
        if warp == 0:
            partial = Float32(0.0)
            if lane < self.sink_threads // _WARP:
                partial = scratch[lane]
            total = self._warp_sum(partial)
        self._sink_sync()
        return total
