"""The CuTe DSL kernel: a call's parts (dQ, or dQ, dK and dV) and the learnable-sink gradient in one launch.

Imports cutlass at module import: load this module lazily (``cache.py`` does).

The entry point takes its arguments in the order of ``abi.py`` (:func:`entry_args`). A call of one part without a
sink launches that part's own grid: ``(shares * H * grid_x, 1, B)`` dense (``KernelSpec.batch_on_grid_z``),
``(varlen.grid_ctas(...), 1, 1)`` varlen, every CTA the part's, with a shared-memory allocator of its own; with
``shares`` > 1 (``Tuning.shares``) a tile's ``shares`` consecutive CTAs each convert a share of it. Any other
call launches a one-dimensional grid: with a sink, first ``H`` CTAs (one per query head) reducing ``dsink``, first
because each reads every row of its head; then the CTAs of dQ, of dK and of dV, each part's numbered by its
scheduler (``schedule.py``), a dense part's CTA ``x`` being its CTA ``x % (H * grid_x)`` of batch ``x // (H *
grid_x)``. A CTA of a part takes the tile its scheduler gives and converts it (``tile.py``). The CTA has as many
threads as the widest part (FlashAttention-4's hd96 presets: dQ 128 threads, dK/dV 256); a narrower part runs on its
first ``num_threads`` threads and synchronises them with a named barrier. The parts share one shared-memory buffer
(the largest part's tile), so the launch runs as many CTAs per SM as its largest part alone.

The sink reduction follows flash-attn 4.0.0b36's (``flash_attn/cute/flash_bwd_postprocess.py``,
``dsink_row_term`` and ``block_sum``), so the GPU result has its bits: with ``n`` = dQ's ``num_threads``,
thread ``t < n`` adds ``-p * dpsum`` over rows ``t, t + n, ...`` of sequence 0 (its first ``seqused[b]`` rows when
given), then of sequence 1, ... (``p = exp2((sink - lse) * log2(e))`` with the fast ``ex2.approx``, 1 where ``lse =
-inf``), in fp32; each warp sums its lanes by a butterfly (``shfl.bfly``, offsets 1, 2, 4, 8, 16, ``val +
other``); lane 0 stores the warp's sum, and after a barrier warp 0 sums the ``n / 32`` partials the same way (its
other lanes add 0); thread 0 converts the sum to the sink's dtype and writes ``dsink[h]``. No atomics: the same
bits on every run.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .. import layout
from . import abi, varlen
from .abi import Tiling
from .spec import KernelSpec
from .schedule import TensorArgs, VarlenScheduler, read_span, scheduler
from .tile import TileConverter

_WARP = 32
_LOG2_E = math.log2(math.e)


def cute_type(name: str):
    """The CuTe numeric type of a dtype name (``abi.DTYPE_NAMES``)."""
    return {"f32": cutlass.Float32, "bf16": cutlass.BFloat16, "f16": cutlass.Float16}[name]


def entry_args(dtype: str, num_parts: int, sink, addresses, extents) -> tuple:
    """The entry's arguments but the stream (``abi.arguments``), as CuTe values: a device address per buffer
    (``abi.buffers``, typed and aligned by its row of ``abi.BUFFERS``), then the int32 extents (``Plan.launch``).
    ``dtype``: the parts' dtype name; ``sink``: the names of ``learnable_sink``'s and ``dsink``'s dtypes, or None."""
    from cutlass.cute.runtime import make_ptr

    buffers = abi.buffers(num_parts, sink is not None)
    if len(addresses) != len(buffers) or len(extents) != len(abi.extents(num_parts)):
        raise ValueError(f"the kernel takes {len(buffers)} addresses and {len(abi.extents(num_parts))} extents, got "
                         f"{len(addresses)} and {len(extents)}")
    names = {"f32": "f32", "out": dtype} | ({"sink": sink[0], "dsink": sink[1]} if sink is not None else {})
    ptrs = []
    for buffer, address in zip(buffers, addresses):
        t = Int32 if buffer.dtype == "s32" else cute_type(names[buffer.dtype])
        ptrs.append(make_ptr(t, address, cute.AddressSpace.gmem,
                             assumed_align=abi.VECTOR_ALIGN if buffer.vector else t.width // 8))
    return tuple(ptrs) + tuple(Int32(e) for e in extents)


class _SharedTile:
    """Hands each part its shared-memory tile on one common buffer (duck-types ``SmemAllocator.allocate_tensor``,
    which ``TileConverter.tile`` calls)."""

    def __init__(self, base: cute.Pointer):
        self.base = base

    def allocate_tensor(self, dtype, layout, byte_alignment=1):
        return cute.make_tensor(cute.recast_ptr(self.base, dtype=dtype), layout)


class Postprocess:
    """The kernel of a call (module docstring).

    ``spec``: the :class:`~jax_dqpost._kernel.spec.KernelSpec` (``Plan.kernel``), its tuning among it; the binary
    depends on it and the target GPU only.

    On sm_90 and newer the kernel is launched with programmatic dependent launch: it may start while the kernel
    before it on the stream is still running, and waits for that one's completion (``griddepcontrol.wait``) before
    its first access to global memory. A CTA that converts a tile (or reduces a sink) lets the kernel after it start
    early (``griddepcontrol.launch_dependents``; that kernel launches once every CTA has done so or exited) once it
    knows it has one, before its first accumulator load; a CTA with nothing to convert (a traced grid's slot past the
    work, a span without a short tile) just exits.
    """

    def __init__(self, spec: KernelSpec, *, target_sm: int = 90):
        parts, tuning = spec.tensors, spec.tuning
        sink = None if spec.sink is None else (cute_type(spec.sink[0]), cute_type(spec.sink[1]))
        self.pdl = target_sm >= 90
        self.names = spec.names
        self.dtype = dtype = cute_type(spec.dtype)
        self.converters = tuple(TileConverter(dtype, p.layout, p.padded_head_dim, tiling=p.tiling, target_sm=target_sm,
                                              shares=tuning.shares) for p in parts)
        self.schedulers = tuple(scheduler(p.layout, p.padded_head_dim, p.tiling, tuning.short_heads, tuning.shares)
                                for p in parts)
        self.num_threads = max(p.work_threads for p in self.converters)
        for part in self.converters:
            part.cta_threads = self.num_threads
        self.sink = sink
        self.sink_threads = self.converters[0].num_threads  # FlashAttention-4 reduces with the dQ postprocess's CTA
        self.smem_bytes = max(max(p.smem_bytes for p in self.converters), 4 * _WARP)
        self.min_ctas_per_sm = min(p.min_ctas_per_sm for p in self.converters)
        self.single_part, self.batch_on_grid_z = spec.single_part, spec.batch_on_grid_z  # the grid (module docstring)
        self.pointer_at = {name: k for k, name in enumerate(abi.pointers(len(parts), sink is not None))}

    @cute.jit
    def __call__(self, *args):
        """``abi.arguments(...)`` (pointers, then int32 extents), then the CUDA stream."""
        num = len(self.pointer_at)
        pointers, extents, stream = args[:num], args[num:-1], args[-1]
        per = len(abi.EXTENTS)
        grid_x = extents[1] if const_expr(self.sink is not None) else 0
        if const_expr(self.single_part):
            grid_x = self.schedulers[0].num_ctas(*extents[0:2], extents[4])  # per batch when dense: z is the batch
        else:
            for i in cutlass.range_constexpr(len(self.converters)):
                grid_x = grid_x + self._part_ctas(i, extents[per * i:per * (i + 1)])
        grid_z = extents[0] if const_expr(self.batch_on_grid_z) else 1
        self.kernel(tuple(pointers), tuple(extents)).launch(
            grid=[grid_x, 1, grid_z],
            block=[self.num_threads, 1, 1],
            smem=self.smem_bytes,
            stream=stream,
            # Tell ptxas how many CTAs must fit per SM. Without it, it aims at full occupancy
            # (32 registers/thread) and splits the fragment loads into dependent rounds.
            min_blocks_per_mp=self.min_ctas_per_sm,
            preferred_smem_carveout=100,  # streamed once: no use for L1, all of it to shared memory
            use_pdl=self.pdl,
        )

    def _part_args(self, i: int, pointers, extents) -> TensorArgs:
        """Part ``i``'s record, its pointers found by name in the entry's list (``abi.pointers``)."""
        name, at, per = self.names[i], self.pointer_at, len(abi.EXTENTS)
        return TensorArgs(pointers[at[f"{name}_accum"]], pointers[at[name]], pointers[at["scales"]] + i,
                        pointers[at[f"{abi.SIDE[name]}_aux"]], *extents[per * i:per * (i + 1)])

    @cute.kernel
    def kernel(self, pointers: tuple, extents: tuple):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, bz = cute.arch.block_idx()
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        if const_expr(self.single_part):
            # The whole grid is the part's: no CTA count to compare, the tile allocated by the part (a count and a
            # shared buffer cost 20-100 ns a launch)
            self._cta(0, self._part_args(0, pointers, extents), bid, bz, tidx, cutlass.memory.SmemAllocator())
        else:
            self._parts_and_sink(pointers, extents, bid, tidx)

    @cute.jit
    def _parts_and_sink(self, pointers, extents, bid, tidx):
        """A CTA of the one-dimensional grid (module docstring)."""
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate_array(cutlass.Uint8, self.smem_bytes, byte_alignment=1024)
        start = Int32(0)
        if const_expr(self.sink is not None):
            at = self.pointer_at
            q = self._part_args(0, pointers, extents)
            start = q.heads
            if bid < q.heads:
                self._trigger()
                if tidx < self.sink_threads:
                    self._reduce_sink(bid, tidx, pointers[at["learnable_sink"]], pointers[at["lse"]],
                                      pointers[at["dpsum"]], pointers[at["dsink"]], q, base)
        for i in cutlass.range_constexpr(len(self.converters)):
            part = self._part_args(i, pointers, extents)
            count = self._part_ctas(i, part[4:])
            self._part_tile(i, bid - start, count, tidx, part, base)
            start = start + count

    def _part_ctas(self, i: int, extents):
        """CTAs of part ``i`` in the one-dimensional grid with these extents (dense: every batch's)."""
        batch_or_spans, heads, _, _, grid_x = extents
        count = self.schedulers[i].num_ctas(batch_or_spans, heads, grid_x)
        return count if const_expr(self.converters[i].tiling == Tiling.VARLEN) else count * batch_or_spans

    @cute.jit
    def _part_tile(self, i: cutlass.Constexpr, local, count, tidx, part: TensorArgs, base):
        """CTA ``local`` of part ``i``'s ``count`` CTAs, if it is one (numbered as ``schedule.py`` describes)."""
        if local >= 0 and local < count and tidx < self.converters[i].work_threads:
            if const_expr(self.converters[i].tiling == Tiling.VARLEN):
                self._cta(i, part, local, Int32(0), tidx, _SharedTile(base))
            else:
                per_batch = part.heads * part.grid_x
                self._cta(i, part, local % per_batch, local // per_batch, tidx, _SharedTile(base))

    @cute.jit
    def _cta(self, i: cutlass.Constexpr, part: TensorArgs, x, bz, tidx, smem):
        """CTA ``x`` of part ``i``'s scheduler (and batch ``bz``, dense tilings): the tile it gives, converted. Only
        the CTA's first ``work_threads`` threads of the part call it; ``smem`` allocates the shared-memory tile."""
        # (self.converters[i] and self.schedulers[i] are not bound to locals out here: the DSL would carry them through
        # the ifs)
        if const_expr(isinstance(self.schedulers[i], VarlenScheduler) and self.schedulers[i].short is not None):
            short_ctas = self.schedulers[i].short.num_ctas(part)
            if x < short_ctas:
                span, group = x % part.batch_or_spans, x // part.batch_or_spans
                short = self.schedulers[i].short
                short_tile = short.tile(part, span)
                if short_tile.rows_total > 0:
                    self._trigger()
                self.converters[i].short_tile(part, group, short_tile, tidx, short.short_heads)
            else:
                shares = self.converters[i].shares  # CTAs of a tile and head, consecutive
                slot = (x - short_ctas) // shares // part.heads
                if slot < self.schedulers[i].long_tiles(part):  # the slots past them (traced offsets' bound) stop
                    self._trigger()
                    head = (x - short_ctas) // shares % part.heads
                    tile = self.schedulers[i].tile(part, slot, head)
                    self.converters[i].tile(part, head, tile, tidx, smem, may_be_empty=True,
                                            share=(x - short_ctas) % shares)
        else:
            shares = self.converters[i].shares
            bx, head = x // shares // part.heads, x // shares % part.heads
            tile = self.schedulers[i].tile(part, bx, head, bz)
            if tile.rows_total > 0:
                self._trigger()
            self.converters[i].tile(part, head, tile, tidx, smem, share=x % shares)

    def _trigger(self):
        """``griddepcontrol.launch_dependents`` in a CTA with work (class docstring)."""
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()

    # ---- the sink gradient ------------------------------------------------------------------------
    def _sink_sync(self):
        if const_expr(self.sink_threads == self.num_threads):
            cute.arch.barrier()
        else:
            cute.arch.barrier(barrier_id=1, number_of_threads=self.sink_threads)

    @cute.jit
    def _reduce_sink(self, head, tidx, sink_ptr, lse_ptr, dpsum_ptr, dsink_ptr, q: TensorArgs, base):
        """``dsink[head]`` in FlashAttention-4's order (module docstring); threads ``< sink_threads`` only."""
        n = self.sink_threads
        q_converter = self.converters[0]
        aux_ptr, batch_or_spans, heads, rows = q.aux, q.batch_or_spans, q.heads, q.rows
        sink_val = Float32(cute.make_tensor(sink_ptr, cute.make_layout(heads))[head])
        total = Float32(0.0)
        if const_expr(q_converter.tiling == Tiling.VARLEN):
            num_spans = batch_or_spans
            padded_total = layout.padded_total(rows, num_spans - 2, q_converter.layout.pad_rows)
            lse_t = cute.make_tensor(lse_ptr, cute.make_layout(Int64(heads) * Int64(rows)))
            dpsum_t = cute.make_tensor(dpsum_ptr, cute.make_layout(Int64(heads) * Int64(padded_total)))
            b = Int32(0)
            while b < num_spans - 2:
                offset, _, length, padded_offset = read_span(aux_ptr, num_spans, b + 1)  # span b + 1: sequence b
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
            batch = batch_or_spans
            pad = q_converter.layout.pad_rows
            padded_rows = (rows + pad - 1) // pad * pad
            lse_t = cute.make_tensor(lse_ptr, cute.make_layout(Int64(batch) * Int64(heads) * Int64(rows)))
            dpsum_t = cute.make_tensor(dpsum_ptr, cute.make_layout(Int64(batch) * Int64(heads) * Int64(padded_rows)))
            b = Int32(0)
            while b < batch:
                length = rows
                if const_expr(q_converter.tiling == Tiling.DENSE_SEQUSED):
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
