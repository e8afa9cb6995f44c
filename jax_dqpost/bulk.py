"""The bulk-load path of a dense Hopper-order part: an experiment (``kernel.Postprocess(..., bulk_stages=...)``,
benchmarks/ncu_kernels.py); the package compiles without it.

Imports cutlass at module import: load this module lazily (``kernel.py`` does).

A Hopper accumulator's tile ``(b, h, m)`` is one contiguous block of ``tile_m * Dr`` floats (the accumulator holds
whole tiles, so the block is inside it even for a sequence's partial last tile). Thread 0 of a CTA brings the
block into a shared-memory stage with one ``cp.async.bulk`` (global -> shared), which completes on the stage's
mbarrier (``mbarrier.arrive.expect_tx`` of the block's bytes); every thread waits on it, then reads its fragment
from the stage at the offsets it would read in global memory (16-byte vectors, thread ``t`` of warpgroup ``w`` at
``w * chunk + 4 t + 512 k`` floats: consecutive threads contiguous), and converts and stores the tile as
``tile.TileConverter`` does: the same multiply, rounding, placement (``stmatrix``) and row stores, so the same bits.

* ``stages = 1``: the default path's grid, ``(H * grid_x, 1, B)``, one tile per CTA.
* ``stages = n >= 2``: persistent CTAs, at most ``max_ctas`` of them (:attr:`BulkLoader.max_ctas`); CTA ``c``
  converts the tiles ``c, c + G, c + 2G, ...`` of the ``B * H * grid_x`` tiles (``G`` the grid; the default path's
  block order: heads fastest, then m_block, then batch), its ``i``-th tile in stage ``i % n``. The next ``n - 1``
  tiles' loads are in flight while a tile is converted: after the barrier that ends every thread's reads of stage
  ``s`` (and the ``stmatrix`` writes of the bf16 tile), thread 0 issues the load of the tile ``n`` steps on into
  ``s``; after the row stores, a second barrier ends the reads of the bf16 tile before the next tile's
  ``stmatrix``. The wait on a stage for its ``k``-th tile is on phase parity ``k % 2``. Every load issued is
  waited on before the CTA exits.

Shared memory per CTA: the bf16/fp16 tile, ``stages`` fp32 stages of ``tile_m * Dr`` floats and one 8-byte
mbarrier per stage.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from .schedule import DenseScheduler, PartArgs
from .tile import _THREADS_PER_SM, TileConverter, _aligned

MAX_BULK_STAGES = 4
SMS = 132
"""Streaming multiprocessors of the GPU the persistent grid is sized for: an H200's (``bulk_ctas`` overrides the
grid)."""
SMEM_PER_SM = 228 * 1024
"""Shared memory of an sm_90 SM; each resident CTA takes ``SMEM_PER_CTA_RESERVED`` bytes beyond what it asks."""
SMEM_PER_CTA_RESERVED = 1024
_STAGE_ALIGN = 128
_MBAR_BYTES = 8


class BulkLoader:
    """The bulk-load conversion of a dense Hopper-order part's tiles (module docstring).

    ``converter`` and ``scheduler``: the part's (``kernel.Postprocess``). ``stages``: 1 .. ``MAX_BULK_STAGES``.
    ``ctas``: the persistent grid's cap (None: ``SMS`` times the CTAs whose shared memory fits on an SM).
    """

    def __init__(self, converter: TileConverter, scheduler: DenseScheduler, stages: int, ctas: int | None):
        self.conv, self.sched, self.stages = converter, scheduler, stages
        self.tile_elems = converter.tile_m * converter.padded_head_dim
        self.stage_bytes = 4 * self.tile_elems
        self.smem_bytes = converter.smem_bytes + stages * self.stage_bytes + stages * _MBAR_BYTES
        self.ctas_per_sm = min(SMEM_PER_SM // (self.smem_bytes + SMEM_PER_CTA_RESERVED),
                               _THREADS_PER_SM // converter.num_threads)
        self.max_ctas = SMS * self.ctas_per_sm if ctas is None else ctas
        self.persistent = stages > 1

    def grid_ctas(self, dim0, heads, grid_x):
        """The persistent grid: one CTA per tile, at most :attr:`max_ctas`."""
        return cutlass.min(dim0 * heads * grid_x, self.max_ctas)

    @cute.jit
    def run(self, part: PartArgs, first, step, tidx):
        """Tiles ``first, first + step, ...`` (linear over ``(b, m, h)``, heads fastest) below ``B * H * grid_x``."""
        # (self.conv and other Python objects are not bound to locals out here: the DSL would carry them through
        # the while)
        smem = cutlass.memory.SmemAllocator()
        s_tile = smem.allocate_tensor(self.conv.dtype, self.conv._smem_layout(), byte_alignment=1024)
        staged = smem.allocate_tensor(Float32, cute.make_layout((self.tile_elems, self.stages)),
                                      byte_alignment=_STAGE_ALIGN)
        mbar = smem.allocate_array(Int64, self.stages, byte_alignment=_MBAR_BYTES)
        total = part.dim0 * part.heads * part.grid_x
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(mbar + s, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages):
                if first + s * step < total:
                    self._load(part, first + s * step, staged, mbar, s)
        scale = cute.make_tensor(part.scale, cute.make_layout(1))[0]
        tile = first
        i = Int32(0)
        while tile < total:
            self._tile(part, tile, i, step, total, scale, s_tile, staged, mbar, tidx)
            tile = tile + step
            i = i + 1
            if tile < total:
                self.conv.sync()  # the tile's reads are done before the next tile's stmatrix

    @cute.jit
    def _tile(self, part: PartArgs, tile, i, step, total, scale, s_tile, staged, mbar, tidx):
        """The CTA's ``i``-th tile, linear tile ``tile``, in stage ``i % stages``."""
        stage = i % self.stages
        cute.arch.mbarrier_wait(mbar + stage, (i // self.stages) % 2)
        head, m_block, batch = self._coords(part, tile)
        tl = self.sched.tile(part, m_block, head, batch)
        if tl.rows_conv > 0:
            self._convert(tl.rows_conv, scale, s_tile, staged, stage, tidx)
        self.conv.sync()  # every thread's reads of the stage and writes of the tile are done
        if const_expr(self.persistent):
            if tidx == 0 and tile + self.stages * step < total:
                self._load(part, tile + self.stages * step, staged, mbar, stage)
        out_offset = (tl.out_row0 * Int64(part.heads) + Int64(head)) * Int64(part.head_dim)
        self.conv._store_tile(part.out, out_offset, part.heads * part.head_dim, part.head_dim, s_tile, tl.rows_total,
                              tl.rows_conv, tidx)

    @cute.jit
    def _convert(self, rows_conv, scale, s_tile, staged, stage, tidx):
        """This thread's fragment from stage ``stage``, converted into ``s_tile`` (``TileConverter._convert_mma``)."""
        conv = self.conv
        # Thread (t, warpgroup w)'s fragment in the stage: 4 floats of a vector, vectors 512 floats apart
        views = cute.make_tensor(staged.iterator, cute.make_layout(
            (4, conv.regs // 4, (128, conv.num_threads // 128), self.stages),
            stride=(1, 512, (4, conv.chunk), self.tile_elems)))
        conv._convert_mma(None, None, scale, s_tile, conv._smem_layout(), rows_conv, tidx,
                          staged=views[None, None, (tidx % 128, tidx // 128), stage])

    def _coords(self, part: PartArgs, tile):
        """``(head, m_block, batch)`` of linear tile ``tile`` (the default grid's block order)."""
        per_batch = part.heads * part.grid_x
        x = tile % per_batch
        return x % part.heads, x // part.heads, tile // per_batch

    @cute.jit
    def _load(self, part: PartArgs, tile, staged, mbar, stage):
        """Thread 0: tile ``tile``'s fp32 block into stage ``stage``, completing on its mbarrier."""
        head, m_block, batch = self._coords(part, tile)
        acc_elem = self.sched.tile(part, m_block, head, batch).acc_elem
        src = cute.make_tensor(_aligned(part.acc + acc_elem, cute.AddressSpace.gmem), cute.make_layout(self.tile_elems))
        cute.arch.mbarrier_arrive_and_expect_tx(mbar + stage, self.stage_bytes)
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32)
        cute.copy(atom, src, staged[None, stage], mbar_ptr=mbar + stage)
