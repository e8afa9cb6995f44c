"""Variable-length (packed) batches: from ``cu_seqlens_q`` / ``seqused_q`` to the work list ("spans").

The output ``dq`` of shape ``(T, H, D)`` is cut into ``K = B + 2`` consecutive spans of rows: the rows before
the first sequence, the ``B`` sequences, the rows after the last. Span ``k`` starts at output row
``row_start[k]``, has ``span_rows[k]`` rows, of which the first ``conv_rows[k]`` are converted from the
accumulator (starting at accumulator row ``acc_row[k]``) and the rest are zero. Sequence ``b`` (span ``b+1``):

    c          = clip(cummax(cu_seqlens_q), 0, T)          # offsets made monotone and in range
    row_start  = c[b],   span_rows = c[b+1] - c[b]
    conv_rows  = span_rows, or clip(seqused_q[b], 0, span_rows) when seqused_q is given
    acc_row    = (c[b] + b * tile_m) // tile_m * tile_m   # FlashAttention's padded offset, rounded down

For valid offsets (``0 <= cu[0] <= ... <= cu[B] <= T``) this is exactly FlashAttention's contract. For any
other values it is still a partition of the rows, so every output row is written once, and every accumulator
tile read lies inside the ``(H, Tp * Dr)`` accumulator: corrupt device data can never cause an access out of
bounds, and the result is still a deterministic function of the inputs.

The work list is a flat int32 array ("meta"): ``tile_start[0..K]`` (exclusive prefix sum of
``ceil(span_rows / tile_m)``; ``tile_start[K]`` tiles in all), then ``(row_start, span_rows, conv_rows,
acc_row)`` for each span, then ``tile_span[0..num_tiles)``: the span of each tile of the launch grid (tiles at
or past ``tile_start[K]`` do nothing). The grid has ``num_tiles`` CTAs per head: exactly the tiles needed for
static offsets, the bound ``ceil(T / tile_m) + K`` for traced ones. The same function builds the list from
static Python ints (numpy, at trace time) or from traced int32 arrays (jax.numpy, inside the computation).
"""

from __future__ import annotations

import numpy as np

SPAN_FIELDS = 4  # row_start, span_rows, conv_rows, acc_row
INT32_MAX = 2**31 - 1  # row offsets, extents and the kernel's launch grid are int32


def padded_total(total_q: int, batch: int, tile_m: int) -> int:
    """``Tp``: accumulator rows FlashAttention allocates, ``round_up(T + B * tile_m, tile_m)``."""
    return (total_q + (batch + 1) * tile_m - 1) // tile_m * tile_m


def num_spans(batch: int) -> int:
    return batch + 2


def max_tiles(total_q: int, batch: int, tile_m: int) -> int:
    """An upper bound on the tiles of any work list: ``sum(ceil(rows_k / tile_m)) <= ceil(T / tile_m) + K``."""
    return -(-total_q // tile_m) + num_spans(batch)


def meta_size(batch: int, num_tiles: int) -> int:
    return (SPAN_FIELDS + 1) * num_spans(batch) + 1 + num_tiles


def batch_from_meta(size: int, num_tiles: int) -> int:
    """Inverse of meta_size (None if ``size`` is not a work list's size for ``num_tiles``)."""
    k, rem = divmod(size - 1 - num_tiles, SPAN_FIELDS + 1)
    return k - 2 if rem == 0 and k >= 2 else None


def work_list(xp, cu_seqlens_q, seqused_q, *, total_q: int, tile_m: int, num_tiles: int | None = None):
    """The int32 work list; ``xp`` is ``numpy`` (static values) or ``jax.numpy`` (traced values).

    ``num_tiles``: CTAs per head of the launch (None: exactly the tiles needed; needs static values).
    Returns ``(meta, num_tiles)``.
    """
    cu = xp.asarray(cu_seqlens_q).astype(np.int32)
    batch = cu.shape[0] - 1
    if xp is np:
        running_max = np.maximum.accumulate(cu)
    else:
        import jax

        running_max = jax.lax.cummax(cu, axis=0)
    c = xp.clip(running_max, 0, total_q).astype(np.int32)
    starts = xp.concatenate([xp.zeros(1, np.int32), c])  # span k starts at starts[k]
    ends = xp.concatenate([c, xp.full(1, total_q, np.int32)])
    span_rows = ends - starts
    seq_rows = span_rows[1:-1]
    if seqused_q is None:
        seq_conv = seq_rows
    else:
        seq_conv = xp.clip(xp.asarray(seqused_q).astype(np.int32), 0, seq_rows)
    zero = xp.zeros(1, np.int32)
    conv_rows = xp.concatenate([zero, seq_conv, zero])
    b = xp.arange(batch, dtype=np.int32)
    seq_acc = (c[:-1] + b * tile_m) // tile_m * tile_m
    acc_row = xp.concatenate([zero, seq_acc, zero])
    tiles = (span_rows + tile_m - 1) // tile_m
    tile_start = xp.concatenate([zero, xp.cumsum(tiles).astype(np.int32)])
    spans = xp.stack([starts, span_rows, conv_rows, acc_row], axis=1).reshape(-1)
    if num_tiles is None:
        num_tiles = int(tile_start[-1])
    tile_span = xp.searchsorted(tile_start, xp.arange(num_tiles, dtype=np.int32), side="right") - 1
    tile_span = xp.clip(tile_span, 0, batch + 1).astype(np.int32)
    return xp.concatenate([tile_start, spans, tile_span]).astype(np.int32), num_tiles


def check_static(cu_seqlens_q, seqused_q, total_q: int) -> None:
    """Validate static offsets at trace time: ValueError naming the argument and the bad value."""
    cu = list(cu_seqlens_q)
    if len(cu) < 2:
        raise ValueError(f"cu_seqlens_q must have at least 2 entries (batch + 1), got {cu}")
    if cu[0] < 0:
        raise ValueError(f"cu_seqlens_q[0] must be >= 0, got {cu[0]}")
    for b in range(len(cu) - 1):
        if cu[b + 1] < cu[b]:
            raise ValueError(f"cu_seqlens_q must be non-decreasing, got cu_seqlens_q[{b}]={cu[b]} > "
                             f"cu_seqlens_q[{b + 1}]={cu[b + 1]}")
    if cu[-1] > total_q:
        raise ValueError(f"cu_seqlens_q[-1]={cu[-1]} exceeds total_q={total_q}")
    if seqused_q is not None:
        used = list(seqused_q)
        if len(used) != len(cu) - 1:
            raise ValueError(f"seqused_q must have batch={len(cu) - 1} entries, got {len(used)}")
        for b, u in enumerate(used):
            if not 0 <= u <= cu[b + 1] - cu[b]:
                raise ValueError(f"seqused_q[{b}]={u} must be in [0, {cu[b + 1] - cu[b]}] "
                                 f"(the length of sequence {b} in cu_seqlens_q)")
