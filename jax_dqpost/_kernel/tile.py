"""How a CTA of the kernel (``kernel.py``) converts one accumulator tile of dQ, dK or dV, once its scheduler
(``schedule.py``) has given it the tile's coordinates: ``rows_total`` rows to write, of which the first
``conv_rows`` come from the accumulator and the rest are zeros.

Imports cutlass at module import: load this module lazily (``cache.py`` does).

Per tile with rows to convert (or one CTA's share of it: ``shares``), every thread
  1. loads its fp32 accumulator fragment straight from global memory, coalesced, in the order the
     producer's threads stored it (no shared-memory staging of the fp32 tile); outside the dense tiling it
     skips the loads whose rows are all past ``conv_rows`` (those rows are written as zeros),
  2. multiplies by ``scale`` (one fp32 multiply, round-to-nearest) and rounds to bf16/fp16 (RNE),
  3. writes the values into a swizzled shared-memory tile at their (row, column) (see
     :class:`TileConverter` for how each order family does it),
  4. after one barrier, copies rows of the tile to global memory as 16-byte vectors, predicated on
     the tile's rows and ``column < head_dim``, zeros for rows past the converted ones.

A short tile (1 .. ``short_rows`` rows: many short sequences; swapped Hopper orders) takes no shared memory and no
barrier: its CTA converts it for a group of heads, each thread a row pair and 16 columns of one head at a time,
with eight 16-byte loads (each vector of the wgmma fragment holds two adjacent rows at two columns 8 apart) and
four 16-byte stores (:meth:`TileConverter.short_tile`).

Every address is derived from the extents passed in and the scheduler's clamped coordinates, so corrupt device data
never makes an access out of bounds.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int64, const_expr
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..layout import fragments, limits
from . import spec
from .abi import Tiling
from ..layout.fragments import OrderFamily
from .schedule import TensorArgs, ShortTile, Tile

_VEC_BYTES = 16
_REGS_PER_SM = 65536
_THREADS_PER_SM = 2048
_CTAS_PER_SM = 32  # sm_80, sm_90, sm_100 (sm_86 and sm_89 hold fewer: the hint then only asks for more)


def _aligned(ptr: cute.Pointer, space) -> cute.Pointer:
    """``ptr`` re-declared 16-byte aligned: offsets here are whole 16-byte vectors (head dims and
    tile sizes are multiples of 8 elements), which the DSL cannot infer through runtime offsets."""
    return cute.make_ptr(ptr.dtype, ptr.toint(), space, assumed_align=_VEC_BYTES)


class TileConverter:
    """The conversion of one part's tiles, for an accumulator in any :class:`AccumLayout` order.

    Its code depends on the output dtype, the layout, the padded head dim, the tiling and the target GPU only
    (``spec.TensorKernel``); batch, heads, sequence lengths and head_dim are run-time arguments.

    How the fragment is read, by order family (``fragments.OrderFamily``):

    * ``MMA`` (arch 90 and 80): each thread loads the registers the producer's thread stored (90: 16-byte
      vectors; 80: one float per register, consecutive threads adjacent), and the producer's own tiled MMA
      places them into shared memory (``stmatrix``, ``.trans`` for swap_ab, on sm_90+; 32/16-bit stores
      below). A Hopper-order fragment compiled for a GPU without WGMMA is placed element by element from
      the wgmma fragment coordinates.
    * ``TMEM_ROWS`` (arch 100): thread t reads TMEM lane t's row (2-CTA: two half rows) as 16-byte vectors,
      32 columns at a time, and writes the converted values element by element into its row.
    * ``ROW_MAJOR`` (arch None): 16-byte loads of 4 consecutive floats, written element by element.

    The element-by-element shared-memory writes are correct but not tuned (2-byte stores).
    """

    def __init__(self, dtype: type[cutlass.Numeric], layout, padded_head_dim: int, *,
                 tiling: Tiling = Tiling.DENSE, target_sm: int = 90, shares: int = 1):
        """``padded_head_dim``: ``Dr``, the head dim as padded in the accumulator. ``tiling``: the part's
        (``schedule.py``; outside ``DENSE`` the loads of rows past ``conv_rows`` are skipped). ``target_sm``: the GPU
        generation compiled for (e.g. 80, 90, 100). ``shares`` (``Tuning.shares``): 1, or
        one of ``spec.tile_shares``: a CTA of ``num_threads / shares`` threads converts those producer threads' share
        of a tile (``spec.share_regions``; :meth:`tile`'s ``share``). The layout and ``Dr`` are a
        :class:`~jax_dqpost._kernel.spec.KernelSpec`'s, which checked that the kernel exists."""
        self.tiling = Tiling(tiling)
        self.family = OrderFamily.of(layout.arch)
        self.use_stmatrix = target_sm >= 90
        # WGMMA atoms exist only on sm_90: elsewhere a Hopper-order fragment is placed by its coordinates, and so it
        # is where a warpgroup's atom is not a whole number of stmatrix 16-column blocks wide (not swapped: the layout
        # refuses that when swapped).
        n_atom = layout.mma_geometry(padded_head_dim)["n_atom"]
        self.wgmma_atoms = layout.arch != 90 or (target_sm == 90 and n_atom % 16 == 0)
        self.dtype = dtype
        self.layout = layout
        self.tile_m = layout.tile_m
        self.padded_head_dim = padded_head_dim
        self.num_threads = layout.num_threads  # the producer's threads, whose fragments make a tile
        self.shares = shares
        self.work_threads = self.num_threads // shares  # the threads converting a tile, or a share of it
        if shares != 1:
            regions = spec.share_regions(layout, padded_head_dim, shares)
            if regions is None:
                raise ValueError(f"shares={shares}: {layout} at Dr={padded_head_dim} has no shares of "
                                 f"{self.work_threads} threads to split a tile into")
            self.region_shape, self.region_corners = regions
            self.region_store = limits.region_store_tiling(*self.region_shape, self.work_threads)
        self.cta_threads = self.work_threads  # threads of the CTA (more when another part is wider, kernel.py)
        geom = layout.mma_geometry(padded_head_dim)
        self.mma_mn = (geom["m"], geom["n"])
        self.atoms_mn = (geom["atoms_m"], geom["atoms_n"])
        self.n_atom = geom["n_atom"]
        self.regs = geom["regs"]  # fp32 values per thread and tile
        if self.family == OrderFamily.TMEM_ROWS:
            # Units of (row, first column, columns) per thread, and the columns converted per step.
            self.row_cols = padded_head_dim // 2 if layout.two_cta else padded_head_dim
            self.step_cols = math.gcd(self.row_cols, 32)
            live = self.step_cols
        else:
            live = self.regs if self.family == OrderFamily.MMA else 16
        self.chunk = self.tile_m * padded_head_dim // max(1, layout.num_threads // 128)  # arch 90: per warpgroup
        self.store_threads = limits.store_tiling(layout, padded_head_dim)
        self.smem_bytes = limits.smem_bytes(layout, padded_head_dim)  # a whole tile, split or not
        # The launch-bounds hint given to ptxas: room for the whole fp32 fragment (all its loads in flight at once)
        # plus ~24 registers of addresses and converted values, and as many CTAs per SM as that allows.
        min_ctas_per_sm = _REGS_PER_SM // (self.work_threads * (live + 24))
        self.min_ctas_per_sm = max(0, min(min_ctas_per_sm, _THREADS_PER_SM // self.work_threads, _CTAS_PER_SM))

    # ----------------------------------------------------------------------------------------------
    def _tiled_mma(self):
        """The producer's tiled MMA. 90: 64 x n_atom WGMMA atoms, warpgroups tiled atoms_mn. 80:
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
        """The CTA's shared-memory tile: row-major, swizzled, 16-byte row chunks contiguous; the whole
        ``(tile_m, padded_head_dim)`` tile, or (``shares`` > 1) its share's ``region_shape``.

        The swizzle atom must not straddle two warpgroups' column slabs, so its width is chosen from
        one warpgroup's extent along the head dim (n_atom, or the 64-row atom when swapped), and from the staged
        tile's (or region's) width.
        """
        if self.family != OrderFamily.MMA or self.layout.arch == 80:
            slab = 64
        else:
            slab = 64 if self.layout.swap_ab else self.n_atom
        rows, cols = self.region_shape if self.shares > 1 else (self.tile_m, self.padded_head_dim)
        kind = sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, math.gcd(slab, cols))
        atom = warpgroup.make_smem_layout_atom(kind, self.dtype)
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))

    def _tile_layout(self, s_layout):
        """``s_layout`` at the whole tile's ``(tile_m, padded_head_dim)`` coordinates: with ``shares`` > 1, the share's
        region repeated over the tile with stride 0 (a CTA writes only its own region's coordinates)."""
        if const_expr(self.shares == 1):
            return s_layout
        rows, cols = self.region_shape
        return cute.composition(s_layout, cute.make_layout(((rows, self.tile_m // rows),
                                                            (cols, self.padded_head_dim // cols)),
                                                           stride=((1, 0), (rows, 0))))

    @cute.jit
    def tile(self, part: TensorArgs, head, t: Tile, tidx, smem, may_be_empty: cutlass.Constexpr = False, share=0):
        """Converts tile ``t`` of head ``head`` through the shared-memory tile, which ``smem`` allocates
        (``allocate_tensor``); with ``shares`` > 1, share ``share`` of it. Only the CTA's first
        ``work_threads`` threads call it. ``may_be_empty``: a tile of no rows does nothing (a varlen slot past the
        long tiles)."""
        s_layout = self._smem_layout()
        s_tile = smem.allocate_tensor(self.dtype, s_layout, byte_alignment=1024)  # the tile, or the share's region
        if const_expr(may_be_empty):
            if t.rows_total > 0:
                self._tile_via_smem(part, head, t, s_tile, s_layout, tidx, share)
        else:
            self._tile_via_smem(part, head, t, s_tile, s_layout, tidx, share)

    @cute.jit
    def _tile_via_smem(self, part: TensorArgs, head, t: Tile, s_tile, s_layout, tidx, share):
        """Steps 1-4 (module docstring): the fragment (or share ``share``: its threads act as the
        producer's threads ``work_threads * share ..``) into the shared-memory tile, then its rows out."""
        heads, head_dim = part.heads, part.head_dim
        if t.conv_rows > 0:
            full = self._tile_layout(s_layout)
            self._convert_tile(part.acc, t.acc_elem, part.scale, cute.make_tensor(s_tile.iterator, full), full,
                               t.conv_rows, tidx + share * self.work_threads if const_expr(self.shares > 1) else tidx)
        self.sync()
        out_offset = (t.row_start * Int64(heads) + Int64(head)) * Int64(head_dim)
        self._store_tile(part.out, out_offset, heads * head_dim, head_dim, s_tile, t.rows_total, t.conv_rows, tidx,
                         share)

    @cute.jit
    def short_tile(self, part: TensorArgs, group, t: ShortTile, tidx, short_heads: cutlass.Constexpr):
        """Converts short tile ``t`` (``schedule.ShortTileScheduler``) for heads ``group * short_heads ..`` (at most
        ``short_heads`` of them), without shared memory or a barrier.

        In a swapped wgmma fragment the result's rows are the MMA's N and its columns the M; the 16-byte vector of
        registers ``4k .. 4k+3`` holds rows ``(2p, 2p + 1)`` at columns ``(c, c + 8)`` (``v % 2`` and ``(v / 2) % 2``
        of :meth:`_place_wgmma_fragment`), and the threads ``t = 32 (j % 4) + 4 c + q`` (``c = 0..7``) hold columns
        ``16 j .. 16 j + 15`` of the same row pair. So one work item, a row pair ``p``, 16 columns ``16 j ..`` and a
        head, is eight 16-byte loads and four 16-byte stores (rows ``2p, 2p + 1``, columns ``16 j, 16 j + 8``),
        every float loaded used (``tests/test_accepted_layouts.py`` checks this map against ``tile_index_map``)."""
        dr = self.padded_head_dim
        acc_ptr, out_ptr, scale_ptr, heads, head_dim = part.acc, part.out, part.scale, part.heads, part.head_dim
        row_start, rows_total, conv_rows, acc_row, padded_total = t

        # Thread (slot, g0): row pair p and columns 16 j .. of heads head0 + g0, g0 + step, ... (slot = p + pairs * j)
        pairs, blocks = (rows_total + 1) // 2, dr // 16
        if rows_total > 0:
            slots = pairs * blocks
            step = self.work_threads // slots  # heads per round (slots <= varlen.short_tile_threads <= work_threads)
            slot, g0 = tidx % slots, tidx // slots
            p, j = slot % pairs, slot // pairs  # row pair fastest: 4 lanes read 64 contiguous bytes
            src_at = Int64(acc_row) * Int64(dr) + Int64(self.short_vector(p, j))
            head_elems = Int64(padded_total) * Int64(self.layout.alloc_head_dim(dr))  # a head's row: Tp * Da
            row_stride = Int64(heads) * Int64(head_dim)
            dst_at = (Int64(row_start) + Int64(2 * p)) * row_stride + Int64(16 * j)
            scale = cute.make_tensor(scale_ptr, cute.make_layout(1))[0]
            vec_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
            head0 = group * short_heads
            group_heads = cutlass.min(heads - head0, short_heads)
            if g0 < step:
                for g in cutlass.range(g0, group_heads, step):
                    head = head0 + g
                    vals = cute.make_rmem_tensor(cute.make_layout((4, 8)), Float32)  # (element, c): the 8 vectors
                    if 2 * p < conv_rows:
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
                                    out.fill(0.0)  # rows past conv_rows: zeros (not 0 * scale, -0 if scale < 0)
                                    if 2 * p + o < conv_rows:
                                        out.store((vals[2 * e + o, None].load() * scale).to(self.dtype))
                                    dst_elem = dst_at + Int64(o) * row_stride + Int64(head * head_dim + 8 * e)
                                    dst = cute.make_tensor(_aligned(out_ptr + dst_elem, cute.AddressSpace.gmem),
                                                           cute.make_layout(8))
                                    cute.copy(store_atom, out, dst)

    def short_vector(self, p, j):
        """Float offset, in a tile of a swapped Hopper order, of the first of the eight 16-byte vectors holding rows
        ``2p, 2p + 1`` and columns ``16 j .. 16 j + 15`` (:meth:`short_tile`; ``fragments.wgmma_pair_vector``). Also
        evaluated on the kernel's run-time integers."""
        return fragments.wgmma_pair_vector(p, j, n_atom=self.n_atom, atoms_m=self.atoms_mn[0], chunk=self.chunk)

    def sync(self):
        """The barrier between the shared-memory writes and reads: the whole CTA, or (a part with fewer threads
        than its CTA) a named barrier of this part's threads."""
        if const_expr(self.cta_threads == self.work_threads):
            cute.arch.barrier()
        else:
            cute.arch.barrier(barrier_id=1, number_of_threads=self.work_threads)

    @cute.jit
    def _convert_tile(self, acc_ptr, tile_elem, scale_ptr, s_tile, s_layout, conv_rows, tidx):
        """Steps 1-3: fragment from global memory, scale and round, into the shared-memory tile ``s_tile``.
        Outside the dense tiling, loads whose rows are all >= ``conv_rows`` are skipped (partial tiles of
        varlen sequences and of seqused): those rows are written as zeros, their values never read."""
        scale = cute.make_tensor(scale_ptr, cute.make_layout(1))[0]
        if const_expr(self.family == OrderFamily.MMA):
            self._convert_mma(acc_ptr, tile_elem, scale, s_tile, s_layout, conv_rows, tidx)
        elif const_expr(self.family == OrderFamily.TMEM_ROWS):
            self._convert_rows(acc_ptr, tile_elem, scale, s_tile, conv_rows, tidx)
        else:
            self._convert_rowmajor(acc_ptr, tile_elem, scale, s_tile, conv_rows, tidx)

    def _wgmma_vector_row(self, k: int, tidx):
        """The lower row of 16-byte vector ``k`` of a Hopper-order fragment (``fragments.wgmma_vector_row``)."""
        return fragments.wgmma_vector_row(k, tidx, n_atom=self.n_atom, atoms_m=self.atoms_mn[0],
                                          swap_ab=self.layout.swap_ab)

    @cute.jit
    def _convert_mma(self, acc_ptr, tile_elem, scale, s_tile, s_layout, conv_rows, tidx):
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
                    if self._wgmma_vector_row(k, tidx) < conv_rows:
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
            self._place_wgmma_fragment(frag, s_tile, tidx)
            return
        swap = self.layout.swap_ab
        if const_expr(swap):
            # The MMA's (m, n) is the tile's (column, row): view it transposed.
            s_mma = cute.make_tensor(
                s_tile.iterator,
                cute.composition(s_layout, cute.make_layout((padded_head_dim, tile_m), stride=(tile_m, 1))),
            )
        else:
            s_mma = s_tile
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
    def _place_wgmma_fragment(self, frag, s_tile, tidx):
        """Hopper-order fragment into the tile by its wgmma D-fragment coordinates (``fragments.wgmma_coord``), for
        targets without WGMMA."""
        for r in cutlass.range_constexpr(self.regs):
            i, j = fragments.wgmma_coord(tidx, r, n_atom=self.n_atom, atoms_m=self.atoms_mn[0],
                                         swap_ab=self.layout.swap_ab)
            s_tile[i, j] = frag[r]

    @cute.jit
    def _convert_rows(self, acc_ptr, tile_elem, scale, s_tile, conv_rows, tidx):
        """tcgen05 order: thread t = TMEM lane t; columns 4c..4c+3 of its row at 512 c + 4 t (2-CTA: the
        pair's halves, ``fragments.tcgen05_offset``), converted ``step_cols`` columns at a time."""
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
                if row < conv_rows:
                    cute.autovec_copy(src, vals)
                out = cute.make_rmem_tensor_like(vals, self.dtype)
                out.store((vals.load() * scale).to(self.dtype))
                for q in cutlass.range_constexpr(step):
                    s_tile[row, col0 + st * step + q] = out[q % 4, q // 4]

    @cute.jit
    def _convert_rowmajor(self, acc_ptr, tile_elem, scale, s_tile, conv_rows, tidx):
        """Row-major order: 16-byte loads of 4 consecutive floats, consecutive threads adjacent."""
        quads_per_row = self.padded_head_dim // 4
        for k in cutlass.range_constexpr(self.tile_m * quads_per_row // self.num_threads):
            v = tidx + k * self.num_threads
            row, q = v // quads_per_row, v % quads_per_row
            src = cute.make_tensor(_aligned(acc_ptr + tile_elem + Int64(4 * v), cute.AddressSpace.gmem),
                                   cute.make_layout(4))
            vals = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            vals.fill(0.0)
            if row < conv_rows:
                cute.autovec_copy(src, vals)
            out = cute.make_rmem_tensor_like(vals, self.dtype)
            out.store((vals.load() * scale).to(self.dtype))
            for e in cutlass.range_constexpr(4):
                s_tile[row, 4 * q + e] = out[e]

    @cute.jit
    def _store_tile(self, out_ptr, out_offset, row_stride, head_dim, s_tile, rows_total, conv_rows, tidx, share):
        """Step 4: 16-byte row vectors to global memory; rows >= conv_rows are zeros. With ``shares`` > 1, only
        share ``share``'s region of the tile (``s_tile`` holds that region alone)."""
        tile_m, padded_head_dim = self.tile_m, self.padded_head_dim
        dst_ptr = _aligned(out_ptr + out_offset, cute.AddressSpace.gmem)
        vec = _VEC_BYTES * 8 // self.dtype.width
        g_out = cute.make_tensor(
            dst_ptr,
            cute.make_layout((tile_m, padded_head_dim), stride=(cute.assume(row_stride, divby=vec), 1)),
        )
        crd = cute.make_identity_tensor((tile_m, padded_head_dim))
        if const_expr(self.shares == 1):
            self._store_region(g_out, s_tile, crd, self.store_threads, vec, rows_total, conv_rows, head_dim, tidx)
        else:
            shape = self.region_shape
            for s in cutlass.range_constexpr(self.shares):
                if share == s:
                    at = (self.region_corners[s][0] // shape[0], self.region_corners[s][1] // shape[1])
                    self._store_region(cute.local_tile(g_out, shape, at), s_tile,
                                       cute.local_tile(crd, shape, at), self.region_store, vec, rows_total, conv_rows,
                                       head_dim, tidx)

    @cute.jit
    def _store_region(self, g_out, s_tile, crd, tiling: cutlass.Constexpr, vec: cutlass.Constexpr, rows_total,
                      conv_rows, head_dim, tidx):
        """The stores of a region of the tile (``crd``: its tile coordinates) by the ``rows x per_row`` threads of
        ``tiling`` (the first ones of the ``work_threads``: ``limits.store_tiling``)."""
        rows, per_row = tiling
        if const_expr(rows * per_row < self.work_threads):
            if tidx < rows * per_row:
                self._store_rows(g_out, s_tile, crd, rows, per_row, vec, rows_total, conv_rows, head_dim, tidx)
        else:
            self._store_rows(g_out, s_tile, crd, rows, per_row, vec, rows_total, conv_rows, head_dim, tidx)

    @cute.jit
    def _store_rows(self, g_out, s_tile, crd, rows: cutlass.Constexpr, per_row: cutlass.Constexpr,
                    vec: cutlass.Constexpr, rows_total, conv_rows, head_dim, tidx):
        """The stores of thread ``tidx`` of the ``rows x per_row`` storing threads."""
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        s2g = cute.make_tiled_copy_tv(
            store_atom,
            cute.make_layout((rows, per_row), stride=(per_row, 1)),
            cute.make_layout((1, vec)),
        )
        thr_s2g = s2g.get_slice(tidx)
        t_src = thr_s2g.partition_S(s_tile)
        t_dst = thr_s2g.partition_D(g_out)
        t_crd = thr_s2g.partition_S(crd)
        t_reg = cute.make_rmem_tensor_like(t_src, self.dtype)
        cute.autovec_copy(t_src, t_reg)
        zeros = cute.make_rmem_tensor_like(t_reg[None, 0, 0], self.dtype)
        zeros.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(t_reg, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(t_reg, mode=[2])):
                row, col = t_crd[0, i, j]
                if row < rows_total and col < head_dim:
                    if row < conv_rows:
                        cute.copy(store_atom, t_reg[None, i, j], t_dst[None, i, j])
                    else:
                        cute.copy(store_atom, zeros, t_dst[None, i, j])
