"""Which tile a CTA of the kernel converts: a scheduler per tiling, as FlashAttention's ``SingleTileScheduler`` and
``SingleTileVarlenScheduler`` are (``flash_attn/cute/tile_scheduler.py``).

Imports cutlass at module import: load this module lazily (``cache.py`` does).

A scheduler numbers a part's CTAs (:meth:`num_ctas`) and gives a CTA its tile's coordinates, every clamp applied
once, here: where the tile starts in the accumulator and in the result, how many rows it writes (``rows_total``)
and how many of them come from the accumulator (``conv_rows``; the rest are zeros: seqused shorter than the
sequence, rows no sequence covers). The converters (``tile.py``) only convert.

* :class:`DenseScheduler` (``DENSE``, ``DENSE_SEQUSED``): ``shares * H * grid_x`` CTAs per batch ``b``, ``grid_x =
  ceil(S / tile_m)``, heads fastest: CTA ``x`` takes tile ``(b, h, m) = (b, y % H, y // H)``, ``y = x // shares``
  (its share ``x % shares``, when ``shares`` > 1), so the CTAs in flight write whole rows of the result,
  every head of them, as a copy would. With seqused, rows past ``seqused[b]`` are zeros.
* :class:`VarlenScheduler` (``VARLEN``): the work list's long-tile slots (``varlen.py``), heads fastest: slot ``m``
  looks its span up (:func:`read_span`) and takes tile ``m - tile_start[span]`` of it: two dependent lookups before
  its first accumulator load, three in the orders with short tiles (the kernel first reads ``tile_start[K]``).
* :class:`ShortTileScheduler` (``VARLEN`` of the swapped Hopper orders, ``varlen.short_rows``): before the long
  tiles, one CTA per span and group of ``short_heads`` heads (``Tuning.short_heads``) takes the span's short tile
  (its last tile, if it has ``1 .. short_rows`` rows), if it has one. They come first in the grid so that a long
  span's short last tile never forms the kernel's tail. Long-tile slots past ``tile_start[K]`` (the bound of traced
  offsets is larger) stop after that one load.

:func:`read_span` is the one reader of a span: the long tiles, the short tiles and the sink reduction use it.

The coordinates come from the launch grid, the extents passed in and the work list, whose values are clamped into
the accumulator and the result, so corrupt device data never makes an access out of bounds.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from .. import layout
from . import varlen
from .abi import Tiling


class TensorArgs(NamedTuple):
    """One part's arguments of the kernel entry: its device pointers and its extents (``abi.EXTENTS``)."""

    acc: cute.Pointer  # fp32 accumulator: (B, H, Sr * Da), varlen (H, Tp * Da)
    out: cute.Pointer  # the result: (B, S, H, D), varlen (T, H, D)
    scale: cute.Pointer  # its fp32 scale, in device memory
    aux: cute.Pointer  # int32: seqused (DENSE_SEQUSED) or the work list (VARLEN); else unused
    batch_or_spans: Int32  # B; varlen: the number of spans K = B + 2
    heads: Int32
    rows: Int32  # S, varlen: T
    head_dim: Int32
    grid_x: Int32  # tiles per head: ceil(S / tile_m), varlen: the work list's num_tiles


class Tile(NamedTuple):
    """A tile converted through shared memory, for one head."""

    acc_elem: Int64  # the tile's first float in the accumulator
    row_start: Int64  # its first row of the result (the row index over batch and sequence, or packed)
    rows_total: Int32  # rows to write: 0 .. tile_m
    conv_rows: Int32  # of which the first ones come from the accumulator


class ShortTile(NamedTuple):
    """A span's short tile, for every head: head ``h``'s accumulator rows start at ``h * padded_total +
    acc_row``."""

    row_start: Int32  # its first row of the result
    rows_total: Int32  # 0 (no short tile) .. short_rows
    conv_rows: Int32
    acc_row: Int32
    padded_total: Int32  # accumulator rows per head


@cute.jit
def read_span(aux_ptr: cute.Pointer, num_spans: Int32, span: Int32):
    """``(row_start, span_rows, conv_rows, acc_row)`` of span ``span`` of the work list at ``aux_ptr``
    (``varlen.py``), as stored: the callers clamp them for their use."""
    spans_at, _ = varlen.sections(num_spans)
    fields = cute.make_tensor(aux_ptr + spans_at + len(varlen.SPAN_FIELDS) * span,
                              cute.make_layout(len(varlen.SPAN_FIELDS)))
    return (fields[varlen.ROW_START], fields[varlen.SPAN_ROWS], fields[varlen.CONV_ROWS], fields[varlen.ACC_ROW])


class DenseScheduler:
    """Tiles of a dense part (module docstring); ``seqused``: rows past ``seqused[b]`` are zeros."""

    def __init__(self, layout, padded_head_dim: int, seqused: bool, shares: int = 1):
        self.layout, self.padded_head_dim, self.seqused, self.shares = layout, padded_head_dim, seqused, shares
        self.untiled_cols = layout.alloc_head_dim(padded_head_dim) - padded_head_dim  # Da - Dr: a row's, past its tiles

    def num_ctas(self, batch_or_spans, heads, grid_x):
        """The part's CTAs per batch (``shares`` per tile and head)."""
        return self.shares * heads * grid_x

    @cute.jit
    def tile(self, part: TensorArgs, m_block, head, batch) -> Tile:
        """Tile ``m_block`` of head ``head`` of sequence ``batch``."""
        tile_m, padded_head_dim = self.layout.tile_m, self.padded_head_dim
        rows, heads, grid_x = part.rows, part.heads, part.grid_x
        rows_total = cutlass.min(rows - m_block * tile_m, tile_m)
        conv_rows = rows_total
        if const_expr(self.seqused):
            seqused = cute.make_tensor(part.aux, cute.make_layout(part.batch_or_spans))
            used = cutlass.max(cutlass.min(seqused[batch], rows), 0)
            conv_rows = cutlass.max(cutlass.min(used - m_block * tile_m, tile_m), 0)
        tiles_per_head = grid_x  # the accumulator's tiles per (batch, head): Sr / tile_m
        if const_expr(self.layout.cluster_size > 1):
            pad = self.layout.pad_rows
            tiles_per_head = (rows + pad - 1) // pad * self.layout.cluster_size
        tile_index = (Int64(batch) * Int64(heads) + Int64(head)) * Int64(tiles_per_head) + Int64(m_block)
        acc_elem = tile_index * Int64(tile_m * padded_head_dim)
        if const_expr(self.untiled_cols):  # each (batch, head) row is Sr * Da floats: its tiles, then Sr * (Da - Dr)
            acc_elem += ((Int64(batch) * Int64(heads) + Int64(head)) * Int64(tiles_per_head) *
                         Int64(tile_m * self.untiled_cols))
        row_start = Int64(batch) * Int64(rows) + Int64(m_block * tile_m)
        return Tile(acc_elem, row_start, rows_total, conv_rows)


class VarlenScheduler:
    """Long tiles of a packed part, the work list's slots, and its short tiles' scheduler (``short``) for the swapped
    Hopper orders (module docstring)."""

    def __init__(self, layout, padded_head_dim: int, short_heads: int = varlen.SHORT_HEADS, shares: int = 1):
        self.layout, self.padded_head_dim, self.shares = layout, padded_head_dim, shares
        self.untiled_cols = layout.alloc_head_dim(padded_head_dim) - padded_head_dim  # Da - Dr: a row's, past its tiles
        self.short = ShortTileScheduler(layout, short_heads) if varlen.short_rows(layout) > 0 else None

    def num_ctas(self, batch_or_spans, heads, grid_x):
        """The part's CTAs (``varlen.grid_ctas``): the short tiles' first, then the long tiles'."""
        short_rows, short_heads = (0, varlen.SHORT_HEADS) if self.short is None else (self.short.short_rows,
                                                                                      self.short.short_heads)
        return varlen.grid_ctas(heads, grid_x, batch_or_spans, short_rows, short_heads, self.shares)

    @cute.jit
    def tile(self, part: TensorArgs, slot, head, _batch=None) -> Tile:
        """Long-tile slot ``slot`` of head ``head``; no rows (``rows_total = 0``) for a slot past the long tiles."""
        tile_m, padded_head_dim = self.layout.tile_m, self.padded_head_dim
        aux_ptr, num_spans, rows, grid_x = part.aux, part.batch_or_spans, part.rows, part.grid_x
        # the work list (varlen.py): tile_start[K + 1] | spans[K][SPAN_FIELDS] | tile_span[grid_x]
        _, tile_span_at = varlen.sections(num_spans)
        meta = cute.make_tensor(aux_ptr, cute.make_layout(tile_span_at + grid_x))
        span = meta[tile_span_at + slot]
        tile_in_span = slot - meta[span]
        span_row_start, span_rows, span_conv_rows, span_acc_row = read_span(aux_ptr, num_spans, span)
        row_start = span_row_start + tile_in_span * tile_m
        rows_total = cutlass.min(span_rows - tile_in_span * tile_m, tile_m)
        conv_rows = cutlass.max(cutlass.min(span_conv_rows - tile_in_span * tile_m, tile_m), 0)
        acc_row = span_acc_row + tile_in_span * tile_m
        padded_total = layout.padded_total(rows, num_spans - 2, self.layout.pad_rows)
        # Defence in depth; the work list already guarantees all of these.
        if slot >= meta[num_spans] or row_start < 0 or rows_total > rows - row_start:
            rows_total = 0
        if acc_row < 0 or acc_row + tile_m > padded_total:
            conv_rows = 0
        conv_rows = cutlass.min(conv_rows, rows_total)
        acc_elem = (Int64(head) * Int64(padded_total) + Int64(acc_row)) * Int64(padded_head_dim)
        if const_expr(self.untiled_cols):  # each head's row is Tp * Da floats: its tiles, then Tp * (Da - Dr)
            acc_elem += Int64(head) * Int64(padded_total) * Int64(self.untiled_cols)
        return Tile(acc_elem, Int64(row_start), rows_total, conv_rows)

    @cute.jit
    def long_tiles(self, part: TensorArgs):
        """``tile_start[K]``: the slots holding a long tile (traced offsets' bound on them is larger)."""
        return cute.make_tensor(part.aux, cute.make_layout(part.batch_or_spans + 1))[part.batch_or_spans]


class ShortTileScheduler:
    """Short tiles of a packed part of a swapped Hopper order (module docstring)."""

    def __init__(self, layout, short_heads: int):
        self.layout, self.short_rows, self.short_heads = layout, varlen.short_rows(layout), short_heads

    def num_ctas(self, part: TensorArgs):
        """One per span and group of ``short_heads`` heads."""
        return part.batch_or_spans * ((part.heads + self.short_heads - 1) // self.short_heads)

    @cute.jit
    def tile(self, part: TensorArgs, span) -> ShortTile:
        """Span ``span``'s short tile; ``rows_total = 0`` if it has none (its last tile is long, or it is empty)."""
        tile_m = self.layout.tile_m
        aux_ptr, num_spans, rows = part.aux, part.batch_or_spans, part.rows
        span_row_start, span_rows, span_conv_rows, span_acc_row = read_span(aux_ptr, num_spans, span)
        tile_in_span = span_rows // tile_m
        rows_total = span_rows - tile_in_span * tile_m
        row_start = span_row_start + tile_in_span * tile_m
        conv_rows = cutlass.max(cutlass.min(span_conv_rows - tile_in_span * tile_m, rows_total), 0)
        acc_row = span_acc_row + tile_in_span * tile_m
        padded_total = layout.padded_total(rows, num_spans - 2, self.layout.pad_rows)
        # Defence in depth; the work list already guarantees all of these.
        if rows_total > self.short_rows or span_rows < 0 or row_start < 0 or rows_total > rows - row_start:
            rows_total = 0  # no short tile (a long one, or none)
        if acc_row < 0 or acc_row + tile_m > padded_total:
            conv_rows = 0
        conv_rows = cutlass.min(conv_rows, rows_total)
        return ShortTile(row_start, rows_total, conv_rows, acc_row, padded_total)


def scheduler(layout, padded_head_dim: int, tiling: Tiling, short_heads: int = varlen.SHORT_HEADS,
              shares: int = 1):
    """The scheduler of a part of this tiling; ``shares``: CTAs per tile and head (their shares:
    ``spec.share_regions``); ``short_heads``: heads per varlen short-tile CTA."""
    if tiling == Tiling.VARLEN:
        return VarlenScheduler(layout, padded_head_dim, short_heads, shares)
    return DenseScheduler(layout, padded_head_dim, tiling == Tiling.DENSE_SEQUSED, shares)
