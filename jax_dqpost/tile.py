"""One part's tiles: how a CTA of the kernel (``kernel.py``) converts one accumulator tile of dQ, dK or dV.

Imports cutlass at module import: load this module lazily (``kernel_cache.py`` does).

Which tile a CTA takes depends on the tiling (``plan.Tiling``, compiled in); ``x`` numbers the part's CTAs
(:meth:`TileConverter.num_ctas`). Dense tilings: ``H * grid_x`` CTAs per batch ``b``, ``grid_x = ceil(S / tile_m)``,
heads fastest: CTA ``x`` takes tile ``(b, h, m) = (b, x % H, x // H)`` (so the CTAs in flight write whole rows of
dQ, every head of them, as a copy would). Varlen: ``varlen.grid_ctas(...)`` CTAs over the work list's slots
(varlen.py): for orders with short tiles, first one CTA per span and group of ``short_heads`` heads (the span's
short tile, if it has one), then, heads fastest, one CTA per long-tile slot and head: slot ``m`` looks its span up
(:func:`read_span`) and converts tile ``m - tile_start[span]`` of it. A
tile has ``rows_total`` rows to write, of which the first ``rows_conv`` come from the accumulator and the rest
are zeros (seqused shorter than the sequence, rows no sequence covers).

Per tile with rows to convert, every thread
  1. loads its fp32 accumulator fragment straight from global memory, coalesced, in the order the
     producer's threads stored it (no shared-memory staging of the fp32 tile); outside the dense tiling it
     skips the loads whose rows are all past ``rows_conv`` (those rows are written as zeros),
  2. multiplies by ``scale`` (one fp32 multiply, round-to-nearest) and rounds to bf16/fp16 (RNE),
  3. writes the values into a swizzled shared-memory dQ tile at their (row, column) (see
     :class:`TileConverter` for how each order family does it),
  4. after one barrier, copies rows of the dQ tile to global memory as 16-byte vectors, predicated on
     the tile's rows and ``column < head_dim``, zeros for rows past the converted ones.

A short tile (1 .. ``short_rows`` rows: many short sequences; swapped Hopper orders) takes no shared memory and no
barrier: its CTA converts it for a group of heads, each thread a row pair and 16 columns of one head at a time,
with eight 16-byte loads (each vector of the wgmma fragment holds two adjacent rows at two columns 8 apart) and
four 16-byte stores (:meth:`TileConverter._short_tile`).

Every address is derived from the launch grid and the extents passed in, and the work list's values are clamped
into the accumulator and the output (``varlen.py``), so corrupt device data never makes an access out of bounds.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.tensor_utils import LayoutEnum

from . import varlen
from .layout import AccumLayout
from .plan import Tiling

_VEC_BYTES = 16
_REGS_PER_SM = 65536
_THREADS_PER_SM = 2048


def _aligned(ptr: cute.Pointer, space) -> cute.Pointer:
    """``ptr`` re-declared 16-byte aligned: offsets here are whole 16-byte vectors (head dims and
    tile sizes are multiples of 8 elements), which the DSL cannot infer through runtime offsets."""
    return cute.make_ptr(ptr.dtype, ptr.toint(), space, assumed_align=_VEC_BYTES)


class PartArgs(NamedTuple):
    """One part's arguments of the kernel entry: its device pointers and its extents (``abi.EXTENTS``)."""

    acc: cute.Pointer  # fp32 accumulator: (B, H, Sr * Dr), varlen (H, Tp * Dr)
    out: cute.Pointer  # the result: (B, S, H, D), varlen (T, H, D)
    scale: cute.Pointer  # its fp32 scale, in device memory
    aux: cute.Pointer  # int32: seqused (DENSE_SEQUSED) or the work list (VARLEN); else unused
    dim0: Int32  # B; varlen: the number of spans K = B + 2
    heads: Int32
    rows: Int32  # S, varlen: T
    head_dim: Int32
    grid_x: Int32  # tiles per head: ceil(S / tile_m), varlen: the work list's num_tiles


@cute.jit
def read_span(aux_ptr: cute.Pointer, num_spans: Int32, span: Int32):
    """``(row_start, span_rows, conv_rows, acc_row)`` of span ``span`` of the work list at ``aux_ptr``
    (``varlen.py``), as stored: the callers clamp them for their use."""
    spans_at, _ = varlen.sections(num_spans)
    fields = cute.make_tensor(aux_ptr + spans_at + len(varlen.SPAN_FIELDS) * span,
                              cute.make_layout(len(varlen.SPAN_FIELDS)))
    return (fields[varlen.ROW_START], fields[varlen.SPAN_ROWS], fields[varlen.CONV_ROWS], fields[varlen.ACC_ROW])


class TileConverter:
    """The conversion of one part's tiles, for an accumulator in any :class:`AccumLayout` order.

    Its code depends on the output dtype, the layout, the padded head dim, the tiling and the target GPU only
    (``Part.kernel_key``); batch, heads, sequence lengths and head_dim are run-time arguments.

    How the fragment is read, by order family:

    * ``mma`` (arch 90 and 80): each thread loads the registers the producer's thread stored (90: 16-byte
      vectors; 80: one float per register, consecutive threads adjacent), and the producer's own tiled MMA
      places them into shared memory (``stmatrix``, ``.trans`` for swap_ab, on sm_90+; 32/16-bit stores
      below). A Hopper-order fragment compiled for a GPU without WGMMA is placed element by element from
      the wgmma fragment coordinates.
    * ``rows`` (arch 100): thread t reads TMEM lane t's row (2-CTA: two half rows) as 16-byte vectors,
      32 columns at a time, and writes the converted values element by element into its row.
    * ``rowmajor`` (arch None): 16-byte loads of 4 consecutive floats, written element by element.

    The element-by-element shared-memory writes are correct but not tuned (2-byte stores).
    """

    def __init__(self, dtype: type[cutlass.Numeric], layout: AccumLayout, padded_head_dim: int, *,
                 tiling: Tiling = Tiling.DENSE, target_sm: int = 90, min_ctas_per_sm: int | None = None,
                 short_heads: int = varlen.SHORT_HEADS):
        """``padded_head_dim``: ``Dr``, the head dim as padded in the accumulator. ``tiling``: how a CTA finds its
        tile (see the module docstring). ``target_sm``: the GPU generation compiled for (e.g. 80, 90, 100).
        Tuning (benchmarks/ncu_kernels.py compares them): ``min_ctas_per_sm``, the launch-bounds hint given to ptxas
        (None: chosen here; 0: none); ``short_heads``, the heads per CTA of a short varlen tile."""
        if not self.can_implement(dtype, layout, padded_head_dim):
            raise ValueError(f"cannot implement dtype={dtype}, {layout}, padded_head_dim={padded_head_dim}")
        self.tiling = Tiling(tiling)
        # Short varlen tiles (varlen.short_rows: the swapped Hopper orders); the work list is built for the same rule.
        self.short_rows = varlen.short_rows(layout) if self.tiling == Tiling.VARLEN else 0
        self.short_heads = short_heads
        self.family = {90: "mma", 80: "mma", 100: "rows", None: "rowmajor"}[layout.arch]
        self.use_stmatrix = target_sm >= 90
        # WGMMA atoms exist only on sm_90: elsewhere a Hopper-order fragment is placed by its coordinates.
        self.wgmma_atoms = layout.arch != 90 or target_sm == 90
        self.dtype = dtype
        self.layout = layout
        self.tile_m = layout.tile_m
        self.padded_head_dim = padded_head_dim
        self.num_threads = layout.num_threads
        self.cta_threads = layout.num_threads  # threads of the CTA (more when another part is wider, kernel.py)
        geom = layout.mma_geometry(padded_head_dim)
        self.mma_mn = (geom["m"], geom["n"])
        self.atoms_mn = (geom["atoms_m"], geom["atoms_n"])
        self.n_atom = geom["n_atom"]
        self.regs = geom["regs"]  # fp32 values per thread and tile
        if self.family == "rows":
            # Units of (row, first column, columns) per thread, and the columns converted per step.
            self.row_cols = padded_head_dim // 2 if layout.two_cta else padded_head_dim
            self.step_cols = math.gcd(self.row_cols, 32)
            live = self.step_cols
        else:
            live = self.regs if self.family == "mma" else 16
        self.chunk = self.tile_m * padded_head_dim // max(1, layout.num_threads // 128)  # arch 90: per warpgroup
        self.store_threads = layout.store_tiling(padded_head_dim)
        self.smem_bytes = layout.smem_bytes(padded_head_dim)
        if min_ctas_per_sm is None:
            # Room for the whole fp32 fragment (all its loads in flight at once) plus ~24 registers of
            # addresses and converted values, and as many CTAs per SM as that allows.
            min_ctas_per_sm = _REGS_PER_SM // (self.num_threads * (live + 24))
        self.min_ctas_per_sm = max(0, min(min_ctas_per_sm, _THREADS_PER_SM // self.num_threads))

    @staticmethod
    def can_implement(dtype, layout: AccumLayout, padded_head_dim: int) -> bool:
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return False
        if padded_head_dim % layout.hdim_multiple_of:
            return False
        try:
            layout.check_head_dim(padded_head_dim)  # every rule the kernel relies on, as the API checks it
        except ValueError:
            return False
        return True

    # ----------------------------------------------------------------------------------------------
    def _tiled_mma(self):
        """The producer's dQ tiled MMA. 90: 64 x n_atom WGMMA atoms, warpgroups tiled atoms_mn. 80:
        m16n8k16 atoms, warps tiled atoms_mn, 16 x 16 permutation tile per warp."""
        if const_expr(self.layout.arch == 80):
            am, an = self.atoms_mn
            return cute.make_tiled_mma(
                warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)), (am, an, 1),
                permutation_mnk=(16 * am, 16 * an, 16))
        return sm90_helpers.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            cute.nvgpu.OperandMajorMode.K,  # operand modes do not change the accumulator layout
            cute.nvgpu.OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(*self.atoms_mn, 1),
            tiler_mn=(64, self.n_atom),
        )

    def _smem_layout(self):
        """Row-major (tile_m, padded_head_dim) dQ tile, swizzled; 16-byte row chunks stay contiguous.

        The swizzle atom must not straddle two warpgroups' column slabs, so its width is chosen from
        one warpgroup's extent along the head dim (n_atom, or the 64-row atom when swapped).
        """
        if self.family != "mma" or self.layout.arch == 80:
            slab = 64
        else:
            slab = 64 if self.layout.swap_ab else self.n_atom
        kind = sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, math.gcd(slab, self.padded_head_dim))
        atom = warpgroup.make_smem_layout_atom(kind, self.dtype)
        return cute.tile_to_shape(atom, (self.tile_m, self.padded_head_dim), (0, 1))

    def num_ctas(self, dim0, heads, grid_x):
        """The part's CTAs for these extents (dense tilings: per batch)."""
        if const_expr(self.tiling == Tiling.VARLEN):
            return varlen.grid_ctas(heads, grid_x, dim0, self.short_rows, self.short_heads)
        return heads * grid_x

    @cute.jit
    def cta(self, part: PartArgs, x, bz, tidx, smem):
        """CTA ``x`` of :meth:`num_ctas` (and batch ``bz``, dense tilings): the module docstring's numbering. Only the
        CTA's first ``num_threads`` threads call it. ``smem`` allocates the shared-memory tile
        (``allocate_tensor``)."""
        if const_expr(self.short_rows > 0):
            dim0, heads = part.dim0, part.heads
            short_ctas = dim0 * ((heads + self.short_heads - 1) // self.short_heads)
            if x < short_ctas:
                self._short_tile(part, x % dim0, x // dim0, tidx)
            else:
                slot = (x - short_ctas) // heads
                # tile_start[K], the long tiles: the slots past them (traced offsets' bound) stop after one load
                if slot < cute.make_tensor(part.aux, cute.make_layout(dim0 + 1))[dim0]:
                    self.tile(part, slot, (x - short_ctas) % heads, bz, tidx, smem)
        else:
            self.tile(part, x // part.heads, x % part.heads, bz, tidx, smem)

    @cute.jit
    def tile(self, part: PartArgs, bx, head, bz, tidx, smem):
        """Tile ``bx`` of head ``head`` (and batch ``bz``, dense tilings; varlen: long-tile slot ``bx``) through the
        shared-memory tile."""
        tile_m, padded_head_dim = self.tile_m, self.padded_head_dim
        acc_ptr, dq_ptr, scale_ptr, aux_ptr, dim0, heads, rows, head_dim, grid_x = part

        # ---- 0. this CTA's tile: accumulator tile, first dQ row, rows to write and to convert ------
        if const_expr(self.tiling == Tiling.VARLEN):
            num_spans = dim0
            # the work list (varlen.py): tile_start[K + 1] | spans[K][SPAN_FIELDS] | tile_span[grid_x]
            _, tile_span_at = varlen.sections(num_spans)
            meta = cute.make_tensor(aux_ptr, cute.make_layout(tile_span_at + grid_x))
            span = meta[tile_span_at + bx]
            tile_in_span = bx - meta[span]
            row_start, span_rows, conv_rows, span_acc_row = read_span(aux_ptr, num_spans, span)
            row0 = row_start + tile_in_span * tile_m
            rows_total = cutlass.min(span_rows - tile_in_span * tile_m, tile_m)
            rows_conv = cutlass.max(cutlass.min(conv_rows - tile_in_span * tile_m, tile_m), 0)
            acc_row = span_acc_row + tile_in_span * tile_m
            padded_total = varlen.padded_total(rows, num_spans - 2, self.layout.pad_rows)
            # Defence in depth; the work list already guarantees all of these.
            if bx >= meta[num_spans] or row0 < 0 or rows_total > rows - row0:
                rows_total = 0
            if acc_row < 0 or acc_row + tile_m > padded_total:
                rows_conv = 0
            rows_conv = cutlass.min(rows_conv, rows_total)
            tile_elem = (Int64(head) * Int64(padded_total) + Int64(acc_row)) * Int64(padded_head_dim)
            dq_row0 = Int64(row0)
        else:
            batch, m_block = bz, bx
            rows_total = cutlass.min(rows - m_block * tile_m, tile_m)
            rows_conv = rows_total
            if const_expr(self.tiling == Tiling.DENSE_SEQUSED):
                seqused = cute.make_tensor(aux_ptr, cute.make_layout(dim0))
                used = cutlass.max(cutlass.min(seqused[batch], rows), 0)
                rows_conv = cutlass.max(cutlass.min(used - m_block * tile_m, tile_m), 0)
            tiles_per_head = grid_x  # the accumulator's tiles per (batch, head): Sr / tile_m
            if const_expr(self.layout.cluster_size > 1):
                pad = self.layout.pad_rows
                tiles_per_head = (rows + pad - 1) // pad * self.layout.cluster_size
            tile_index = (Int64(batch) * Int64(heads) + Int64(head)) * Int64(tiles_per_head) + Int64(m_block)
            tile_elem = tile_index * Int64(tile_m * padded_head_dim)
            dq_row0 = Int64(batch) * Int64(rows) + Int64(m_block * tile_m)

        s_layout = self._smem_layout()
        s_dq = smem.allocate_tensor(self.dtype, s_layout, byte_alignment=1024)
        if const_expr(self.short_rows > 0):
            if rows_total > 0:  # (slots past the long tiles of traced offsets: nothing to do)
                self._tile_via_smem(acc_ptr, tile_elem, scale_ptr, dq_ptr, dq_row0, heads, head, head_dim, s_dq,
                                    s_layout, rows_total, rows_conv, tidx)
        else:
            self._tile_via_smem(acc_ptr, tile_elem, scale_ptr, dq_ptr, dq_row0, heads, head, head_dim, s_dq, s_layout,
                                rows_total, rows_conv, tidx)

    @cute.jit
    def _tile_via_smem(self, acc_ptr, tile_elem, scale_ptr, dq_ptr, dq_row0, heads, head, head_dim, s_dq, s_layout,
                       rows_total, rows_conv, tidx):
        """Steps 1-4 (module docstring): the fragment into the shared-memory tile, then its rows out."""
        if rows_conv > 0:
            self._convert_tile(acc_ptr, tile_elem, scale_ptr, s_dq, s_layout, rows_conv, tidx)
        self.sync()
        dq_offset = (dq_row0 * Int64(heads) + Int64(head)) * Int64(head_dim)
        self._store_tile(dq_ptr, dq_offset, heads * head_dim, head_dim, s_dq, rows_total, rows_conv, tidx)

    @cute.jit
    def _short_tile(self, part: PartArgs, span, group, tidx):
        """Span ``span``'s short tile (its last tile, if it has ``1 .. short_rows`` rows), for heads ``group *
        short_heads ..`` (at most ``short_heads`` of them). No shared memory, no barrier.

        In a swapped wgmma fragment dQ's rows are the MMA's N and its columns the M; the 16-byte vector of
        registers ``4k .. 4k+3`` holds rows ``(2p, 2p + 1)`` at columns ``(c, c + 8)`` (``v % 2`` and ``(v / 2) % 2``
        of :meth:`_place_wgmma_fragment`), and the threads ``t = 32 (j % 4) + 4 c + q`` (``c = 0..7``) hold columns
        ``16 j .. 16 j + 15`` of the same row pair. So one work item, a row pair ``p``, 16 columns ``16 j ..`` and a
        head, is eight 16-byte loads and four 16-byte stores (rows ``2p, 2p + 1``, columns ``16 j, 16 j + 8``),
        every float loaded used (``tests/test_accepted_layouts.py`` checks this map against ``tile_index_map``)."""
        tile_m, dr = self.tile_m, self.padded_head_dim
        acc_ptr, dq_ptr, scale_ptr, aux_ptr, num_spans, heads, rows, head_dim, _ = part
        row_start, span_rows, conv_rows, span_acc_row = read_span(aux_ptr, num_spans, span)
        tile_in_span = span_rows // tile_m
        rows_total = span_rows - tile_in_span * tile_m
        row0 = row_start + tile_in_span * tile_m
        rows_conv = cutlass.max(cutlass.min(conv_rows - tile_in_span * tile_m, rows_total), 0)
        acc_row = span_acc_row + tile_in_span * tile_m
        padded_total = varlen.padded_total(rows, num_spans - 2, self.layout.pad_rows)
        # Defence in depth; the work list already guarantees all of these.
        if rows_total > self.short_rows or span_rows < 0 or row0 < 0 or rows_total > rows - row0:
            rows_total = 0  # no short tile (a long one, or none)
        if acc_row < 0 or acc_row + tile_m > padded_total:
            rows_conv = 0
        rows_conv = cutlass.min(rows_conv, rows_total)

        # Thread (slot, g0): row pair p and columns 16 j .. of heads head0 + g0, g0 + step, ... (slot = p + pairs * j)
        pairs, blocks = (rows_total + 1) // 2, dr // 16
        if rows_total > 0:
            slots = pairs * blocks
            step = self.num_threads // slots  # heads per round (slots <= 8 pairs * 16 blocks <= num_threads)
            slot, g0 = tidx % slots, tidx // slots
            p, j = slot % pairs, slot // pairs  # row pair fastest: 4 lanes read 64 contiguous bytes
            src_at = Int64(acc_row) * Int64(dr) + Int64(self.short_vector(p, j))
            head_elems = Int64(padded_total) * Int64(dr)
            row_stride = Int64(heads) * Int64(head_dim)
            dst_at = (Int64(row0) + Int64(2 * p)) * row_stride + Int64(16 * j)
            scale = cute.make_tensor(scale_ptr, cute.make_layout(1))[0]
            vec_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
            head0 = group * self.short_heads
            group_heads = cutlass.min(heads - head0, self.short_heads)
            if g0 < step:
                for g in cutlass.range(g0, group_heads, step):
                    head = head0 + g
                    vals = cute.make_rmem_tensor(cute.make_layout((4, 8)), Float32)  # (element, c): the 8 vectors
                    if 2 * p < rows_conv:
                        src = cute.make_tensor(_aligned(acc_ptr + src_at + Int64(head) * head_elems,
                                                        cute.AddressSpace.gmem),
                                               cute.make_layout((4, 8), stride=(1, 16)))
                        for c in cutlass.range_constexpr(8):
                            cute.copy(vec_atom, src[None, c], vals[None, c])
                    for o in cutlass.range_constexpr(2):
                        if 2 * p + o < rows_total:
                            for e in cutlass.range_constexpr(2):
                                if 16 * j + 8 * e < head_dim:
                                    out = cute.make_rmem_tensor(cute.make_layout(8), self.dtype)
                                    out.fill(0.0)  # rows past rows_conv: zeros (not 0 * scale, -0 if scale < 0)
                                    if 2 * p + o < rows_conv:
                                        out.store((vals[2 * e + o, None].load() * scale).to(self.dtype))
                                    dst_elem = dst_at + Int64(o) * row_stride + Int64(head * head_dim + 8 * e)
                                    dst = cute.make_tensor(_aligned(dq_ptr + dst_elem, cute.AddressSpace.gmem),
                                                           cute.make_layout(8))
                                    cute.copy(store_atom, out, dst)

    def short_vector(self, p, j):
        """Float offset, in a tile of a swapped Hopper order, of the first of the eight 16-byte vectors holding rows
        ``2p, 2p + 1`` and columns ``16 j .. 16 j + 15``; vector ``c`` is ``16 c`` floats further, its element
        ``2 e + o`` is ``(2p + o, 16 j + 8 e + c)`` (:meth:`_short_tile`). The wgmma fragment coordinates of
        :meth:`_place_wgmma_fragment` with dQ's row as N and its column as M. Plain arithmetic: also evaluated on
        the kernel's run-time integers."""
        per_atom, atoms_m, n_atom = self.n_atom // 2, self.atoms_mn[0], self.n_atom
        cn, wn = (2 * p) % n_atom, (2 * p) // n_atom  # N: rows 2p, 2p + 1 are registers v, v + 1 of one thread
        w = (j // 4) % atoms_m + atoms_m * wn  # M: the 64-column atom of columns 16 j .., and its warpgroup
        k = (j // (4 * atoms_m)) * (per_atom // 4) + cn // 8  # the thread's vector: registers 4k .. 4k + 3
        t = 32 * (j % 4) + (cn % 8) // 2  # the thread holding column 16 j (c = 0); column 16 j + c: t + 4c
        return w * (self.tile_m * self.padded_head_dim // self.layout.num_warpgroups) + 512 * k + 4 * t

    def sync(self):
        """The barrier between the shared-memory writes and reads: the whole CTA, or (a part with fewer threads
        than its CTA) a named barrier of this part's threads."""
        if const_expr(self.cta_threads == self.num_threads):
            cute.arch.barrier()
        else:
            cute.arch.barrier(barrier_id=1, number_of_threads=self.num_threads)

    @cute.jit
    def _convert_tile(self, acc_ptr, tile_elem, scale_ptr, s_dq, s_layout, rows_conv, tidx):
        """Steps 1-3: fragment from global memory, scale and round, into the shared-memory tile ``s_dq``.
        Outside the dense tiling, loads whose rows are all >= ``rows_conv`` are skipped (partial tiles of
        varlen sequences and of seqused): those rows are written as zeros, their values never read."""
        scale = cute.make_tensor(scale_ptr, cute.make_layout(1))[0]
        if const_expr(self.family == "mma"):
            self._convert_mma(acc_ptr, tile_elem, scale, s_dq, s_layout, rows_conv, tidx)
        elif const_expr(self.family == "rows"):
            self._convert_rows(acc_ptr, tile_elem, scale, s_dq, rows_conv, tidx)
        else:
            self._convert_rowmajor(acc_ptr, tile_elem, scale, s_dq, rows_conv, tidx)

    def _wgmma_vector_row(self, k: int, tidx):
        """The lower dQ row of 16-byte vector ``k`` (registers 4k..4k+3) of a Hopper-order fragment: its
        registers are rows (row, row + 8) at two adjacent columns, or (swap_ab) rows (row, row + 1)."""
        per_atom, atoms_m = self.n_atom // 2, self.atoms_mn[0]
        v, mm = (4 * k) % per_atom, (4 * k) // per_atom
        w, t = tidx // 128, tidx % 128
        if const_expr(self.layout.swap_ab):
            return self.n_atom * (w // atoms_m) + 8 * (v // 4) + 2 * (t % 4)
        return 64 * (w % atoms_m) + 64 * atoms_m * mm + 16 * (t // 32) + (t % 32) // 4

    @cute.jit
    def _convert_mma(self, acc_ptr, tile_elem, scale, s_dq, s_layout, rows_conv, tidx):
        tile_m, padded_head_dim = self.tile_m, self.padded_head_dim
        # ---- 1. the fp32 fragment, in the producer's thread order ------------------------------
        if const_expr(self.wgmma_atoms):
            tiled_mma = self._tiled_mma()
            acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C(self.mma_mn), Float32)
        else:
            acc = cute.make_rmem_tensor(cute.make_layout(self.regs), Float32)
        if const_expr(self.layout.arch == 90):
            wg, t = tidx // 128, tidx % 128
            src_base = _aligned(acc_ptr + tile_elem + Int64(wg * self.chunk + 4 * t), cute.AddressSpace.gmem)
            # (4 floats of one 16-byte vector, vectors 512 floats apart) -> registers r = 4 * k + e
            src = cute.make_tensor(src_base, cute.make_layout((4, self.regs // 4), stride=(1, 512)))
            acc_flat = cute.make_tensor(acc.iterator, cute.make_layout((4, self.regs // 4)))
            load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            if const_expr(self.tiling == Tiling.DENSE):
                for k in cutlass.range_constexpr(self.regs // 4):
                    cute.copy(load_atom, src[None, k], acc_flat[None, k])
            else:
                acc.fill(0.0)
                for k in cutlass.range_constexpr(self.regs // 4):
                    if self._wgmma_vector_row(k, tidx) < rows_conv:
                        cute.copy(load_atom, src[None, k], acc_flat[None, k])
        else:
            # mma.sync: register r of thread tid at tid + num_threads * r (coalesced 4-byte loads).
            src = cute.make_tensor(acc_ptr + tile_elem + Int64(tidx),
                                   cute.make_layout(self.regs, stride=self.num_threads))
            cute.autovec_copy(src, cute.make_tensor(acc.iterator, cute.make_layout(self.regs)))

        # ---- 2. scale (fp32 multiply) and round to the output type (RNE) ------------------------
        frag = cute.make_rmem_tensor_like(acc, self.dtype)
        frag.store((acc.load() * scale).to(self.dtype))

        # ---- 3. registers -> swizzled shared-memory tile, by the producer's MMA coordinates ----
        if const_expr(not self.wgmma_atoms):
            self._place_wgmma_fragment(frag, s_dq, tidx)
            return
        swap = self.layout.swap_ab
        if const_expr(swap):
            # The MMA's (m, n) is dQ's (column, row): view the tile transposed.
            s_mma = cute.make_tensor(
                s_dq.iterator,
                cute.composition(s_layout, cute.make_layout((padded_head_dim, tile_m), stride=(tile_m, 1))),
            )
        else:
            s_mma = s_dq
        if const_expr(self.use_stmatrix):
            n_matrices = 4 if const_expr((self.n_atom or 16) % 16 == 0) else 2
            atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=swap, num_matrices=n_matrices), self.dtype)
        else:
            # Two adjacent registers are adjacent columns of a row, or (swapped) of a column.
            bits = 16 if const_expr(swap) else 32
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=bits)
        r2s = cute.make_tiled_copy_C(atom, tiled_mma)
        thr_r2s = r2s.get_slice(tidx)
        cute.copy(r2s, thr_r2s.retile(frag), thr_r2s.partition_D(s_mma))

    @cute.jit
    def _place_wgmma_fragment(self, frag, s_dq, tidx):
        """Hopper-order fragment into the tile by its wgmma D-fragment coordinates (targets without
        WGMMA): register r of thread (warpgroup w, warp q, lane) is row 16 q + lane / 4 + 8 ((v / 2) % 2),
        column 8 (v / 4) + 2 (lane % 4) + v % 2 of atom r / (n_atom / 2), v = r % (n_atom / 2)."""
        atoms_m = self.atoms_mn[0]
        per_atom = self.n_atom // 2
        w, t = tidx // 128, tidx % 128
        q, lane = t // 32, t % 32
        wm, wn = w % atoms_m, w // atoms_m
        for r in cutlass.range_constexpr(self.regs):
            v, mm = r % per_atom, r // per_atom
            m = 64 * wm + 64 * atoms_m * mm + 16 * q + lane // 4 + 8 * ((v // 2) % 2)
            n = self.n_atom * wn + 8 * (v // 4) + 2 * (lane % 4) + v % 2
            if const_expr(self.layout.swap_ab):
                s_dq[n, m] = frag[r]
            else:
                s_dq[m, n] = frag[r]

    @cute.jit
    def _convert_rows(self, acc_ptr, tile_elem, scale, s_dq, rows_conv, tidx):
        """tcgen05 order: thread t = TMEM lane t; columns 4c..4c+3 of its row at 512 c + 4 t (2-CTA: the
        pair's halves, see layout.py), converted ``step_cols`` columns at a time."""
        padded_head_dim, cols, step = self.padded_head_dim, self.row_cols, self.step_cols
        units = 2 if const_expr(self.layout.two_cta) else 1
        for unit in cutlass.range_constexpr(units):
            if const_expr(self.layout.two_cta):
                row = 64 * unit + tidx % 64
                col0 = (tidx // 64) * cols
                base = Int64(unit * 64 * padded_head_dim) + Int64(4 * tidx)
            else:
                row, col0, base = tidx, 0, Int64(4 * tidx)
            for st in cutlass.range_constexpr(cols // step):
                src = cute.make_tensor(_aligned(acc_ptr + tile_elem + base + Int64(512 * (st * step // 4)),
                                                cute.AddressSpace.gmem),
                                       cute.make_layout((4, step // 4), stride=(1, 512)))
                vals = cute.make_rmem_tensor(cute.make_layout((4, step // 4)), Float32)
                vals.fill(0.0)
                if row < rows_conv:
                    cute.autovec_copy(src, vals)
                out = cute.make_rmem_tensor_like(vals, self.dtype)
                out.store((vals.load() * scale).to(self.dtype))
                for q in cutlass.range_constexpr(step):
                    s_dq[row, col0 + st * step + q] = out[q % 4, q // 4]

    @cute.jit
    def _convert_rowmajor(self, acc_ptr, tile_elem, scale, s_dq, rows_conv, tidx):
        """Row-major order: 16-byte loads of 4 consecutive floats, consecutive threads adjacent."""
        quads_per_row = self.padded_head_dim // 4
        for k in cutlass.range_constexpr(self.tile_m * quads_per_row // self.num_threads):
            v = tidx + k * self.num_threads
            row, q = v // quads_per_row, v % quads_per_row
            src = cute.make_tensor(_aligned(acc_ptr + tile_elem + Int64(4 * v), cute.AddressSpace.gmem),
                                   cute.make_layout(4))
            vals = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            vals.fill(0.0)
            if row < rows_conv:
                cute.autovec_copy(src, vals)
            out = cute.make_rmem_tensor_like(vals, self.dtype)
            out.store((vals.load() * scale).to(self.dtype))
            for e in cutlass.range_constexpr(4):
                s_dq[row, 4 * q + e] = out[e]

    @cute.jit
    def _store_tile(self, dq_ptr, dq_offset, row_stride, head_dim, s_dq, rows_total, rows_conv, tidx):
        """Step 4: 16-byte row vectors to global memory; rows >= rows_conv are zeros."""
        tile_m, padded_head_dim = self.tile_m, self.padded_head_dim
        dst_ptr = _aligned(dq_ptr + dq_offset, cute.AddressSpace.gmem)
        vec = _VEC_BYTES * 8 // self.dtype.width
        g_dq = cute.make_tensor(
            dst_ptr,
            cute.make_layout((tile_m, padded_head_dim), stride=(cute.assume(row_stride, divby=vec), 1)),
        )
        rows, per_row = self.store_threads
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        s2g = cute.make_tiled_copy_tv(
            store_atom,
            cute.make_layout((rows, per_row), stride=(per_row, 1)),
            cute.make_layout((1, vec)),
        )
        thr_s2g = s2g.get_slice(tidx)
        t_src = thr_s2g.partition_S(s_dq)
        t_dst = thr_s2g.partition_D(g_dq)
        t_crd = thr_s2g.partition_S(cute.make_identity_tensor((tile_m, padded_head_dim)))
        t_reg = cute.make_rmem_tensor_like(t_src, self.dtype)
        cute.autovec_copy(t_src, t_reg)
        zeros = cute.make_rmem_tensor_like(t_reg[None, 0, 0], self.dtype)
        zeros.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(t_reg, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(t_reg, mode=[2])):
                row, col = t_crd[0, i, j]
                if row < rows_total and col < head_dim:
                    if row < rows_conv:
                        cute.copy(store_atom, t_reg[None, i, j], t_dst[None, i, j])
                    else:
                        cute.copy(store_atom, zeros, t_dst[None, i, j])
