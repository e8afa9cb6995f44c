"""Variable-length (packed) batches: from ``cu_seqlens`` / ``seqused`` to the work list, and back (either side:
the q side's ``cu_seqlens_q``, the k side's ``cu_seqlens_k``).

The output ``dq`` of shape ``(T, H, D)`` is cut into ``K = B + 2`` consecutive spans of rows: the rows before
the first sequence, the ``B`` sequences, the rows after the last. Span ``k`` starts at output row
``row_start[k]``, has ``span_rows[k]`` rows, of which the first ``conv_rows[k]`` are converted from the
accumulator (starting at accumulator row ``acc_row[k]``) and the rest are zero. Sequence ``b`` (span ``b+1``):

    c          = clip(cummax(cu_seqlens), 0, T)             # offsets made monotone and in range
    row_start  = c[b],   span_rows = c[b+1] - c[b]
    conv_rows  = span_rows, or clip(seqused[b], 0, span_rows) when seqused is given
    acc_row    = (c[b] + b * P) // P * P                  # FlashAttention's padded offset, rounded down

with ``P = tile_m * cluster_size`` (``AccumLayout.pad_rows``): FlashAttention pads in whole clusters of tiles.

For valid offsets (``0 <= cu[0] <= ... <= cu[B] <= T``) this is exactly FlashAttention's contract. For any
other values it is still a partition of the rows, so every output row is written once, and every accumulator
tile read lies inside the ``(H, Tp * Dr)`` accumulator: corrupt device data can never cause an access out of
bounds, and the result is still a deterministic function of the inputs.

The work list is one flat int32 array, in three sections (:func:`sections` gives their offsets):

    tile_start[0..K]            exclusive prefix sum of the spans' long tiles; tile_start[K] long tiles in all
    spans[K][SPAN_FIELDS]       (row_start, span_rows, conv_rows, acc_row) of each span
    tile_span[0..num_tiles)     the span of each long-tile slot of the launch grid (slots >= tile_start[K] do
                                nothing), then, for orders with short tiles, one short-tile slot per span (k)

A span of ``r`` rows has ``ceil(r / tile_m)`` tiles. For most orders every tile is a *long* tile: one CTA per tile
and head (the shared-memory path; ``shares`` CTAs, each converting a share, in a small call's kernel). For the
orders with short tiles (:func:`short_rows`: the swapped Hopper orders) a span's last tile is *short* when it has
``1 .. short_rows`` rows; it is not among the long tiles, and the span's short-tile slot converts it, for
:data:`SHORT_HEADS` heads per CTA, or one (``Tuning.short_heads``; :func:`grid_ctas`).

``num_tiles`` is the number of slots: the long tiles (exactly, for static offsets; the bound :meth:`WorkList.max_tiles`
for traced ones), plus ``K`` short-tile slots for orders with short tiles. :meth:`WorkList.build` makes the list from
static Python ints (numpy, at trace time) or from traced int32 arrays (jax.numpy, inside the computation);
:meth:`WorkList.decode` is the one reader on the JAX side, and the kernel reads the same offsets through
:func:`sections`. The C++ handler holds no work-list arithmetic: it checks the work list's byte count, as every
buffer's, against the call's ``bytes`` attribute, which the lowering takes from the buffers' shapes
(``_primitive/cuda_lowering.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from ..layout import padded_total

SPAN_FIELDS = ("row_start", "span_rows", "conv_rows", "acc_row")
"""A span's record: its first row of the result, its rows, of which the first ``conv_rows`` come from the
accumulator, from accumulator row ``acc_row`` on (module docstring)."""
ROW_START, SPAN_ROWS, CONV_ROWS, ACC_ROW = range(len(SPAN_FIELDS))
INT32_MAX = 2**31 - 1  # row offsets, extents and the kernel's launch grid are int32
SHORT_ROWS = 16
"""A varlen tile of at most this many rows is a short tile, for the orders that have them (:func:`short_rows`)."""
SHORT_HEADS = 8
"""Heads per short-tile CTA, or 1 (``Tuning.short_heads``, ``tuning.short_heads`` chooses)."""


def short_rows(layout) -> int:
    """Rows up to which a varlen tile of ``layout``'s order is a short tile (0: the order has none).

    The swapped Hopper orders (``arch=90, swap_ab``: FlashAttention-4's hd128 dQ, its hd192 and hd256 dK/dV) have
    them: their fragments hold whole row pairs in each 16-byte vector, so the kernel gathers a short tile's rows
    with vector loads, without the shared-memory tile (``kernel.py``). Less than ``tile_m``: full tiles are long."""
    if layout.arch == 90 and layout.swap_ab:
        return min(SHORT_ROWS, layout.tile_m - 1)
    return 0


def short_tile_threads(layout, padded_head_dim: int) -> int:
    """Threads a short-tile CTA needs to convert a short tile of one head in one round: one per row pair and 16
    columns (``tile.TileConverter.short_tile``); 0 for orders without short tiles. A CTA of fewer threads would drop
    work items (``spec.tile_shares`` keeps at least this many)."""
    return (short_rows(layout) + 1) // 2 * (padded_head_dim // 16)


def grid_ctas(heads, num_tiles, num_spans, short_rows: int, short_heads: int = SHORT_HEADS, shares: int = 1):
    """CTAs of a varlen launch: ``shares`` per long-tile slot and head (a tile's shares,
    ``spec.share_regions``, when ``shares`` > 1), and (orders with short tiles) one per span and group of
    ``short_heads`` heads. ``short_rows``, ``short_heads``, ``shares``: Python ints; the rest plain arithmetic, also
    evaluated on the kernel's run-time integers."""
    if short_rows:
        return num_spans * ((heads + short_heads - 1) // short_heads) + shares * heads * (num_tiles - num_spans)
    return shares * heads * num_tiles


def sections(num_spans):
    """Offsets of the sections ``(spans, tile_span)`` in a work list of ``num_spans`` spans (``tile_start`` is at
    0). Plain arithmetic: also evaluated on the kernel's run-time integers."""
    return num_spans + 1, (len(SPAN_FIELDS) + 1) * num_spans + 1


class Spans(NamedTuple):
    """A decoded work list (arrays of the builder's kind)."""

    tile_start: object  # (K + 1,)
    row_start: object  # (K,)
    span_rows: object
    conv_rows: object
    acc_row: object
    tile_span: object  # (num_tiles,)


@dataclasses.dataclass(frozen=True)
class WorkList:
    """The static shape of a work list: ``batch`` sequences packed into ``total`` rows, ``tile_m``-row tiles,
    ``num_tiles`` slots (module docstring), accumulator rows padded in units of ``pad_rows`` (``tile_m *
    cluster_size``), tiles of at most ``short_rows`` rows short (0: none)."""

    total: int
    batch: int
    tile_m: int
    num_tiles: int
    pad_rows: int
    short_rows: int = 0

    @property
    def num_spans(self) -> int:
        return self.batch + 2

    @property
    def size(self) -> int:
        return sections(self.num_spans)[1] + self.num_tiles

    @property
    def padded_total(self) -> int:
        return padded_total(self.total, self.batch, self.pad_rows)

    @property
    def short_slots(self) -> int:
        """The slots of short tiles: one per span, or none."""
        return self.num_spans if self.short_rows else 0

    def ctas(self, heads: int, shares: int = 1, short_heads: int = SHORT_HEADS) -> int:
        """CTAs of the launch for ``heads`` heads, long tiles converted by ``shares`` CTAs each, short ones by CTAs of
        ``short_heads`` heads (:func:`grid_ctas`)."""
        return grid_ctas(heads, self.num_tiles, self.num_spans, self.short_rows, short_heads, shares)

    @staticmethod
    def max_tiles(total: int, batch: int, layout) -> int:
        """The slots of a work list for any offsets of ``batch`` sequences in ``total`` rows (traced offsets).

        Long tiles: a span of ``r`` rows has ``ceil(r / tile_m)`` tiles, so all spans have at most ``ceil(T / tile_m)
        + K``. With short tiles (``s = short_rows``) a span's long tiles number at most ``(r + tile_m - s - 1) //
        tile_m`` and each has more than ``s`` rows, so at most ``min((T + (tile_m - s - 1) K) // tile_m, T // (s +
        1))`` in all; plus the ``K`` short-tile slots."""
        tile_m, s, spans = layout.tile_m, short_rows(layout), batch + 2
        if not s:
            return -(-total // tile_m) + spans
        return min((total + (tile_m - s - 1) * spans) // tile_m, total // (s + 1)) + spans

    @classmethod
    def build(cls, xp, cu_seqlens, seqused, *, total: int, layout, num_tiles: int | None = None):
        """``(WorkList, int32 array)``; ``xp`` is ``numpy`` (static values) or ``jax.numpy`` (traced values).

        ``layout``: the accumulator's ``AccumLayout`` (its tile, row padding and short tiles). ``num_tiles``: the
        slots of the launch (None: exactly the tiles needed, which needs static values; traced values take
        :meth:`max_tiles`).
        """
        tile_m, pad_rows, short = layout.tile_m, layout.pad_rows, short_rows(layout)
        cu = xp.asarray(cu_seqlens).astype(np.int32)
        batch = cu.shape[0] - 1
        if xp is np:
            running_max, prefix_sum, unrolled = np.maximum.accumulate, np.cumsum, {}
        else:
            # Traced values add no loop to the program (XLA runs a loop an iteration a launch and splits its command
            # buffers around it): prefix scans as associative scans (jax.numpy's cumsum lowers to a loop for CUDA in
            # some versions), the slot lookup as an unrolled binary search (searchsorted's default is a loop).
            import jax

            running_max = functools.partial(jax.lax.associative_scan, xp.maximum)
            prefix_sum = functools.partial(jax.lax.associative_scan, xp.add)
            unrolled = {"method": "scan_unrolled"}
        c = xp.clip(running_max(cu), 0, total).astype(np.int32)
        starts = xp.concatenate([xp.zeros(1, np.int32), c])  # span k starts at starts[k]
        ends = xp.concatenate([c, xp.full(1, total, np.int32)])
        span_rows = ends - starts
        seq_rows = span_rows[1:-1]
        if seqused is None:
            seq_conv = seq_rows
        else:
            seq_conv = xp.clip(xp.asarray(seqused).astype(np.int32), 0, seq_rows)
        zero = xp.zeros(1, np.int32)
        conv_rows = xp.concatenate([zero, seq_conv, zero])
        b = xp.arange(batch, dtype=np.int32)
        seq_acc = (c[:-1] + b * pad_rows) // pad_rows * pad_rows
        acc_row = xp.concatenate([zero, seq_acc, zero])
        if short:  # full tiles, and a last partial tile of more than `short` rows
            tiles = span_rows // tile_m + (span_rows % tile_m > short).astype(np.int32)
        else:
            tiles = (span_rows + tile_m - 1) // tile_m
        tile_start = xp.concatenate([zero, prefix_sum(tiles).astype(np.int32)])
        spans = xp.stack([starts, span_rows, conv_rows, acc_row], axis=1).reshape(-1)
        short_slots = batch + 2 if short else 0
        if num_tiles is None:
            num_tiles = int(tile_start[-1]) + short_slots
        tile_span = xp.searchsorted(tile_start, xp.arange(num_tiles - short_slots, dtype=np.int32), side="right",
                                    **unrolled) - 1
        tile_span = xp.clip(tile_span, 0, batch + 1).astype(np.int32)
        work = cls(total=total, batch=batch, tile_m=tile_m, num_tiles=num_tiles, pad_rows=pad_rows,
                   short_rows=short)
        parts = [tile_start, spans, tile_span, xp.arange(short_slots, dtype=np.int32)]
        return work, xp.concatenate(parts).astype(np.int32)

    def decode(self, work_list) -> Spans:
        """The sections of the work list ``work_list`` (numpy or jax array of :attr:`size` entries)."""
        spans_at, tile_span_at = sections(self.num_spans)
        spans = work_list[spans_at:tile_span_at].reshape(self.num_spans, len(SPAN_FIELDS))
        return Spans(work_list[:spans_at], *(spans[:, f] for f in range(len(SPAN_FIELDS))), work_list[tile_span_at:])
