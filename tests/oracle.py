"""An independent oracle for the dQ postprocess, written from the PTX ISA and docs/design.md.

It shares no code with jax_dqpost: it emulates the *producer* (FlashAttention's Hopper backward) thread
by thread with plain loops -- each thread's WGMMA accumulator registers, their (row, column) in the
dQ tile by the PTX ISA's "wgmma .m64nNk16 D fragment" figure, and the order in which the thread stores
them (16-byte vectors, warpgroup chunks) -- and builds accumulators from logical dQ values. The
expected result is then computed from the logical values directly: ``round(float32(scale) * x)``.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from support import assert_within_roundings, bits, cu_seqlens, round_up


@functools.lru_cache(maxsize=None)
def hopper_tile_positions(tile_m, hdim_padded, num_threads, atom_layout, swap_ab):
    """int64 ``(tile_m, hdim_padded)``: where the producer stored dQ(i, j) inside one tile.

    Returns None when the configuration is not a valid WGMMA tiling.
    """
    nwg = num_threads // 128
    # The dQ MMA (computes dQ^T when swap_ab): problem (M, N), warpgroups (wg_m, wg_n).
    if not swap_ab:
        M, N, wg_m, wg_n = tile_m, hdim_padded, atom_layout, nwg // atom_layout
    else:
        M, N, wg_m, wg_n = hdim_padded, tile_m, nwg // atom_layout, atom_layout
    if M % (64 * wg_m) or N % wg_n or (N // wg_n) % 8 or N // wg_n > 256:
        return None
    n_wgmma = N // wg_n  # N of each warpgroup's wgmma instruction
    m_tiles = M // (64 * wg_m)  # 64-row wgmma instructions per warpgroup along M
    regs_per_wgmma = n_wgmma // 2  # f32 D fragment: N/2 registers per thread
    regs = regs_per_wgmma * m_tiles
    chunk = tile_m * hdim_padded // nwg  # each warpgroup stores its own contiguous chunk
    pos = np.full((tile_m, hdim_padded), -1, dtype=np.int64)
    for tid in range(num_threads):
        wg, t = divmod(tid, 128)
        warp, lane = divmod(t, 32)
        wg_row, wg_col = wg % wg_m, wg // wg_m  # warpgroups laid out column-major over (wg_m, wg_n)
        for r in range(regs):
            mt, d = divmod(r, regs_per_wgmma)  # register d of the mt-th wgmma along M
            # PTX ISA, wgmma D fragment (f32): d[i] sits at row 16*warp + lane/4 + 8*((i/2)%2),
            # column 8*(i/4) + 2*(lane%4) + i%2 of the 64 x N result.
            row = 16 * warp + lane // 4 + 8 * ((d // 2) % 2)
            col = 8 * (d // 4) + 2 * (lane % 4) + d % 2
            m = 64 * wg_row + 64 * wg_m * mt + row
            n = n_wgmma * wg_col + col
            i, j = (m, n) if not swap_ab else (n, m)
            # The store: registers 4k..4k+3 as one 16-byte vector; vectors of the 128 threads of a
            # warpgroup are consecutive, so vector k of thread t is at 512*k + 4*t in the chunk.
            k, e = divmod(r, 4)
            assert pos[i, j] == -1, "two registers map to one element"
            pos[i, j] = wg * chunk + 512 * k + 4 * t + e
    assert (pos >= 0).all(), "the fragment does not cover the tile"
    return pos


@functools.lru_cache(maxsize=None)
def mma_sync_tile_positions(tile_m, hdim_padded, num_threads, atom_layout, swap_ab):
    """Ampere ``mma.sync.m16n8k16`` producer (FlashAttention's sm80/sm120 path). None if not a valid tiling.

    Warps ``(wm, wn)`` tiled column-major over ``(atom_layout, warps/atom_layout)`` (swapped for swap_ab);
    each warp covers 16 x 16 of every 16*wm_count x 16*wn_count permutation tile as two 16 x 8 atoms whose
    8-column blocks alternate between the warps along N. Registers: c0..c3 of an atom (PTX ISA: c0, c1 at
    row lane/4, columns 2*(lane%4) + {0, 1}; c2, c3 eight rows lower), then the atoms along M, then along N.
    Thread ``tid`` atomically adds register ``r`` at ``tid + num_threads * r``.
    """
    warps = num_threads // 32
    if not swap_ab:
        M, N, wm_count, wn_count = tile_m, hdim_padded, atom_layout, warps // atom_layout
    else:
        M, N, wm_count, wn_count = hdim_padded, tile_m, warps // atom_layout, atom_layout
    if M % (16 * wm_count) or N % (16 * wn_count):
        return None
    m_atoms, n_atoms = M // (16 * wm_count), 2 * (N // (16 * wn_count))
    pos = np.full((tile_m, hdim_padded), -1, dtype=np.int64)
    for tid in range(num_threads):
        warp, lane = divmod(tid, 32)
        wm, wn = warp % wm_count, warp // wm_count
        for an in range(n_atoms):
            tile_n, sub = divmod(an, 2)
            for am in range(m_atoms):
                for c in range(4):
                    row = am * 16 * wm_count + 16 * wm + lane // 4 + 8 * (c // 2)
                    col = tile_n * 16 * wn_count + 8 * (wn + wn_count * sub) + 2 * (lane % 4) + c % 2
                    r = c + 4 * (am + m_atoms * an)
                    i, j = (row, col) if not swap_ab else (col, row)
                    assert pos[i, j] == -1
                    pos[i, j] = tid + num_threads * r
    assert (pos >= 0).all()
    return pos


@functools.lru_cache(maxsize=None)
def tcgen05_tile_positions(hdim_padded, two_cta, reduce_ncol=32):
    """Blackwell producer (128 x Dr tile, 128 threads): ``tcgen05.ld.32x32b`` gives thread t the columns of
    TMEM lane t; each group of ``reduce_ncol`` columns goes to shared memory as 16-byte vectors of a 1-D
    (128 threads x 4) copy and is bulk-reduce-added as one contiguous chunk. With the 2-CTA MMA, CTA r of
    the pair holds rows 64r..64r+63 (lane u: left half of row 64r+u, lane u+64: right half) and its
    chunks come after the other CTA's."""
    H = hdim_padded
    pos = np.full((128, H), -1, dtype=np.int64)
    ctas = 2 if two_cta else 1
    cols = H // ctas  # TMEM columns each lane holds
    ncol = reduce_ncol if cols % reduce_ncol == 0 else 8
    stages = cols // ncol
    for cta in range(ctas):
        for t in range(128):
            row = 64 * cta + t % 64 if two_cta else t
            col0 = (t // 64) * cols if two_cta else 0
            for stage in range(stages):
                for jj in range(ncol):
                    chunk = stage + stages * cta
                    p = chunk * 128 * ncol + 512 * (jj // 4) + 4 * t + jj % 4
                    assert pos[row, col0 + stage * ncol + jj] == -1
                    pos[row, col0 + stage * ncol + jj] = p
    assert (pos >= 0).all()
    return pos


def tile_positions(arch, tile_m, hdim_padded, num_threads, atom_layout, swap_ab, two_cta=False):
    """Where the producer of order ``arch`` stored dQ(i, j) inside one tile; None if invalid."""
    if arch == 90:
        return hopper_tile_positions(tile_m, hdim_padded, num_threads, atom_layout, swap_ab)
    if arch == 80:
        return mma_sync_tile_positions(tile_m, hdim_padded, num_threads, atom_layout, swap_ab)
    if arch == 100:
        return tcgen05_tile_positions(hdim_padded, two_cta)
    return np.arange(tile_m * hdim_padded, dtype=np.int64).reshape(tile_m, hdim_padded)  # row-major


def _unread_tail(rng, shape, padding):
    """What a producer leaves in the allocation past its tiles (nothing reads it): zeros with ``padding="zeros"``
    (as ``dq_accum_from_dq`` writes), else garbage -- large random values, and NaNs with ``padding="random"``."""
    if padding == "zeros":
        return np.zeros(shape, np.float32)
    tail = (rng.standard_normal(shape) * 1e3).astype(np.float32)
    if padding == "random":
        tail[rng.random(shape) < 0.05] = np.nan
    return tail


def build_accumulator(dq_logical, layout_args, *, hdim_multiple_of, rng, padding="random", arch=90, two_cta=False,
                      cluster=1, alloc_hdim_multiple_of=None):
    """Accumulator ``(B, H, Sr*Da)`` holding ``dq_logical`` ``(B, S, H, D)`` float32 in producer order
    (``Sr``: S rounded up to ``cluster`` tiles; ``Dr``: D rounded up to ``hdim_multiple_of``, the tiles' head dim;
    ``Da``: D rounded up to ``alloc_hdim_multiple_of``, default ``hdim_multiple_of``, the allocation's).

    Each (batch, head) row holds its ``Sr // tile_m`` tiles of ``tile_m * Dr`` floats in its first ``Sr * Dr``
    floats. Padding entries (rows >= S, columns >= D, and the row's unread tail past ``Sr * Dr``) are filled with
    random values, NaNs and infinities: they must never reach the output.
    """
    B, S, H, D = dq_logical.shape
    tile_m = layout_args[0]
    Dr = round_up(D, hdim_multiple_of)
    Da = round_up(D, alloc_hdim_multiple_of or hdim_multiple_of)
    assert Da >= Dr, (Da, Dr)
    Sr = round_up(S, tile_m * cluster)
    pos = tile_positions(arch, tile_m, Dr, *layout_args[1:], two_cta=two_cta)
    padded = rng.standard_normal((B, H, Sr, Dr)).astype(np.float32) * 1e3
    if padding == "zeros":
        padded[:] = 0
    elif padding == "random":
        junk = rng.random((B, H, Sr, Dr)) < 0.05
        padded[junk] = np.nan
    padded[:, :, :S, :D] = np.transpose(dq_logical, (0, 2, 1, 3))
    acc = np.empty((B, H, Sr // tile_m, tile_m * Dr), np.float32)
    tiles = padded.reshape(B, H, Sr // tile_m, tile_m, Dr)
    acc[..., pos.ravel()] = tiles.reshape(B, H, Sr // tile_m, tile_m * Dr)
    acc = acc.reshape(B, H, Sr * Dr)
    if Da == Dr:
        return acc
    return np.concatenate([acc, _unread_tail(rng, (B, H, Sr * (Da - Dr)), padding)], axis=-1)


def round_bf16_bits(x32: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) by integer arithmetic; returns uint16 bits."""
    bits = x32.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x32)
    rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # keep NaN a NaN (quiet bit)
    return rounded


def expected_dq(dq_logical, scale, dtype):
    """``round(float32(scale) * x)`` as ``dtype`` (numpy fp32 multiply, no flush to zero). Overflow to infinity
    is part of the contract (the inputs include values near float32's maximum)."""
    with np.errstate(over="ignore"):
        return _expected_dq(dq_logical, scale, dtype)


def _expected_dq(dq_logical, scale, dtype):
    x = dq_logical.astype(np.float32) * np.float32(scale)
    if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):
        out = round_bf16_bits(x).view(ml_dtypes.bfloat16)
        assert np.array_equal(out.view(np.uint16)[~np.isnan(x)],
                              x.astype(ml_dtypes.bfloat16).view(np.uint16)[~np.isnan(x)])
        return out
    return x.astype(np.float16)


def random_logical(rng, shape, *, specials=True):
    """Float32 test values: normals over many binades, plus (optionally) values that probe rounding:
    bf16/fp16 ties, subnormals, overflow to infinity, signed zeros."""
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
    if specials:
        flat = x.reshape(-1)
        n = flat.size
        idx = rng.choice(n, size=min(n, max(8, n // 10)), replace=False)
        kinds = rng.integers(0, 6, idx.size)
        bits = rng.integers(0, 2**32, idx.size, dtype=np.uint64).astype(np.uint32)
        tie = ((bits & 0xFFFF0000) | 0x8000).astype(np.uint32).view(np.float32)  # exact bf16 tie
        sub = (bits & 0x807FFFFF).astype(np.uint32).view(np.float32)  # fp32 subnormals
        big = np.float32(3.3e38) * np.sign(rng.standard_normal(idx.size)).astype(np.float32)
        tiny = (rng.standard_normal(idx.size) * 1e-6).astype(np.float32)  # fp16 subnormal range
        choice = np.select([kinds == 0, kinds == 1, kinds == 2, kinds == 3, kinds == 4],
                           [tie, sub, big, tiny, np.float32(-0.0)], default=flat[idx])
        flat[idx] = np.where(np.isfinite(choice), choice, flat[idx]).astype(np.float32)
    return x


def clamped_offsets(cu, total_q):
    """The documented treatment of any cu_seqlens_q: running maximum, clipped to [0, total_q]."""
    out, running = [], None
    for v in cu:
        running = v if running is None else max(running, v)
        out.append(min(max(running, 0), total_q))
    return out


def build_varlen(rng, cu, seqused, total_q, heads, head_dim, layout_args, *, hdim_multiple_of, scale, dtype,
                 logical=None, arch=90, two_cta=False, cluster=1, alloc_hdim_multiple_of=None):
    """Accumulator ``(H, Tp*Da)`` in producer order for packed sequences, and the expected dq ``(T, H, D)``.

    Sequence b (offsets made valid as documented) covers dq rows c[b] .. c[b] + used_b; its accumulator
    rows start at FlashAttention's padded offset (c[b] + b*P) // P * P, P = tile_m * cluster, in tiles of
    ``tile_m * Dr`` floats in the first ``Tp * Dr`` floats of each head's row (``Da``, the allocation's head dim:
    :func:`build_accumulator`). Every other row of dq is zero; every other accumulator entry, the row's tail past
    ``Tp * Dr`` too, is junk (random, NaN).
    """
    tile_m = layout_args[0]
    batch = len(cu) - 1
    Dr = round_up(head_dim, hdim_multiple_of)
    Da = round_up(head_dim, alloc_hdim_multiple_of or hdim_multiple_of)
    assert Da >= Dr, (Da, Dr)
    pad = tile_m * cluster
    Tp = round_up(total_q + batch * pad, pad)
    pos = tile_positions(arch, tile_m, Dr, *layout_args[1:], two_cta=two_cta)
    acc = rng.standard_normal((heads, Tp * Dr), dtype=np.float32) * np.float32(1e3)
    acc[rng.random(acc.shape, dtype=np.float32) < 0.05] = np.nan
    if logical is None:
        logical = random_logical(rng, (total_q, heads, head_dim))
    expected = np.zeros((total_q, heads, head_dim), dtype)
    c = clamped_offsets(cu, total_q)
    for b in range(batch):
        length = c[b + 1] - c[b]
        used = length if seqused is None else min(max(seqused[b], 0), length)
        start = (c[b] + b * pad) // pad * pad
        i = np.arange(used)  # row c[b] + i is row i of the sequence: tile i // tile_m, row i % tile_m of it
        at = ((start + (i // tile_m) * tile_m) * Dr)[:, None] + pos[i % tile_m, :head_dim]  # (used, D)
        acc[:, at] = np.transpose(logical[c[b]:c[b] + used], (1, 0, 2))  # (H, used, D) into producer order
        expected[c[b]:c[b] + used] = expected_dq(logical[c[b]:c[b] + used], scale, dtype)
    if Da != Dr:
        acc = np.concatenate([acc, _unread_tail(rng, (heads, Tp * (Da - Dr)), "random")], axis=-1)
    return acc, expected


def expected_dense_seqused(logical, seqused, scale, dtype):
    out = expected_dq(logical, scale, dtype)
    for b, u in enumerate(seqused):
        out[b, min(max(u, 0), logical.shape[1]):] = 0
    return out


# ---- comparisons and whole cases (numpy only; a layout is read through its attributes)

def assert_same_bits(got, want, what=""):
    """``got`` has ``want``'s shape, dtype and bits (NaNs in the same places, any NaN payload)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    gnan, wnan = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    assert np.array_equal(gnan, wnan), f"{what}: NaN positions differ"
    diff = (bits(got) != bits(want)) & ~wnan
    if diff.any():
        idx = np.argwhere(diff)[:5]
        raise AssertionError(f"{what}: {diff.sum()} of {diff.size} elements differ, first at {idx.tolist()}: "
                             f"got {[got[tuple(i)] for i in idx]} want {[want[tuple(i)] for i in idx]}")


def layout_args(layout):
    """The ``(tile_m, num_threads, atom_layout, swap_ab)`` a producer emulation takes, from an AccumLayout."""
    return layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab


def padding_args(layout):
    """The keyword arguments of the producer's padding, from an AccumLayout: the tiles' ``hdim_multiple_of``, the
    allocation's ``alloc_hdim_multiple_of``, the emulated order (``arch``, ``two_cta``) and the row ``cluster``."""
    return dict(hdim_multiple_of=layout.hdim_multiple_of, alloc_hdim_multiple_of=layout.alloc_hdim_multiple_of,
                arch=layout.arch, two_cta=layout.two_cta, cluster=layout.cluster_size)


def dense_case(rng, layout, shape, scale, dtype, *, seqused=None, specials=True, padding="random"):
    """A dense accumulator ``(B, H, Sr*Da)`` in ``layout``'s order holding random values of logical shape ``shape``
    ``(B, S, H, D)``, and the expected output (rows past ``seqused`` zero)."""
    logical = random_logical(rng, shape, specials=specials)
    acc = build_accumulator(logical, layout_args(layout), rng=rng, padding=padding, **padding_args(layout))
    if seqused is None:
        return acc, expected_dq(logical, scale, dtype)
    return acc, expected_dense_seqused(logical, seqused, scale, dtype)


def varlen_case(rng, layout, cu, seqused, total, heads, head_dim, scale, dtype, *, logical=None):
    """A packed accumulator ``(H, Tp*Da)`` in ``layout``'s order and the expected ``(T, H, D)`` output
    (:func:`build_varlen`)."""
    return build_varlen(rng, cu, seqused, total, heads, head_dim, layout_args(layout), scale=scale, dtype=dtype,
                        logical=logical, **padding_args(layout))


def random_offsets(rng, batch, most):
    """``cu_seqlens`` of ``batch`` sequences of random lengths in ``[0, most)``."""
    return cu_seqlens(rng.integers(0, most, size=batch)).tolist()


def random_seqused(rng, cu):
    """Random lengths used, each in ``[0, its sequence's length]``."""
    return [int(rng.integers(0, cu[b + 1] - cu[b] + 1)) for b in range(len(cu) - 1)]


def sequence_rows(cu, seqused, total, pad):
    """``(first output row, first accumulator row, rows)`` of each packed sequence, its offsets made valid as
    documented (:func:`clamped_offsets`; lengths clamped to their sequence), the accumulator padded by ``pad`` rows
    per sequence (FlashAttention's allocation)."""
    c = clamped_offsets(cu, total)
    rows = []
    for b in range(len(cu) - 1):
        length = c[b + 1] - c[b]
        used = length if seqused is None else min(max(seqused[b], 0), length)
        rows.append((c[b], (c[b] + b * pad) // pad * pad, used))
    return rows


# ---- the learnable sink's gradient: float64 reference

def sink_inputs(rng, heads, sink_dtype, lse_shape, dpsum_shape, heads_axis):
    """A sink ``(H,)`` of ``sink_dtype`` and float32 ``lse``, ``dpsum`` as attention leaves them: ``lse`` counts
    the sink's mass too (``p = exp(sink - lse)`` is in (0, 1]), 5% of its rows are -inf (attended to nothing)."""
    sink = (rng.standard_normal(heads) * 2).astype(sink_dtype)
    axes = tuple(i for i in range(len(lse_shape)) if i != heads_axis)
    lse = (np.expand_dims(sink.astype(np.float32), axes) + np.abs(rng.standard_normal(lse_shape)) * 3)
    lse = lse.astype(np.float32)
    lse[rng.random(lse_shape) < 0.05] = -np.inf
    return sink, lse, rng.standard_normal(dpsum_shape).astype(np.float32)


def expected_dsink(sink, lse, dpsum, *, seqused=None, cu=None, total=None, pad=None):
    """float64 ``dsink[h] = sum over the covered rows of -exp(sink[h] - lse) * dpsum`` (the exponential is 1 where
    lse = -inf), and the sum of the terms' magnitudes per head (the sum cancels: the scale of its error).

    Dense: ``lse`` (B, H, S), ``dpsum`` (B, H, Sr), rows below ``seqused``. Packed (``cu``, ``total``, ``pad``):
    ``lse`` (H, T) at the sequence's output rows, ``dpsum`` (H, Tp) at its accumulator rows (:func:`sequence_rows`).
    """
    s = sink.astype(np.float64)
    if cu is None:
        batch, heads, seqlen = lse.shape
        used = [seqlen] * batch if seqused is None else [min(max(u, 0), seqlen) for u in seqused]
        lse_rows = np.moveaxis(lse, 1, 0).reshape(heads, -1)
        dpsum_rows = np.moveaxis(dpsum[:, :, :seqlen], 1, 0).reshape(heads, -1)
        keep = np.concatenate([np.arange(seqlen) < u for u in used])
    else:
        heads = lse.shape[0]
        lse_cols, dpsum_cols = [], []
        for out_row, acc_row, rows in sequence_rows(cu, seqused, total, pad):
            lse_cols += range(out_row, out_row + rows)
            dpsum_cols += range(acc_row, acc_row + rows)
        lse_rows, dpsum_rows = lse[:, lse_cols], dpsum[:, dpsum_cols]
        keep = np.ones(len(lse_cols), bool)
    lse64 = lse_rows.astype(np.float64)
    with np.errstate(over="ignore"):
        p = np.where(np.isneginf(lse64), 1.0, np.exp(s[:, None] - lse64))
    terms = np.where(keep[None, :], -p * dpsum_rows.astype(np.float64), 0.0)
    return terms.sum(axis=1), np.abs(terms).sum(axis=1)


def assert_dsink_close(got, want, magnitude, sink_dtype, what=""):
    """Within 1e-5 of the terms' magnitude (a float32 sum), plus one rounding to a 16-bit ``sink_dtype``."""
    got = np.asarray(got)
    assert got.dtype == np.dtype(sink_dtype) and got.shape == want.shape, (what, got.dtype, got.shape)
    got = got.astype(np.float64)
    tol = 1e-5 * magnitude
    if np.dtype(sink_dtype) != np.float32:
        tol = tol + np.abs(want) * (2.0**-8 if np.dtype(sink_dtype) == ml_dtypes.bfloat16 else 2.0**-11)
    assert (np.abs(got - want) <= tol).all(), (what, got, want, tol)


def assert_dsink_reordered(got, want, sink, lse, dpsum, what="", **rows):
    """Two programs' dsink over the same rows (``expected_dsink``'s arguments ``rows``): XLA on a CPU may fuse and
    sum them in another order in each program, as its version decides, so each head within one
    float32 rounding plus the reordering of as many float32 terms as rows, at the terms' magnitude."""
    _, magnitude = expected_dsink(np.asarray(sink), np.asarray(lse), np.asarray(dpsum), **rows)
    assert_within_roundings(got, want, what, terms=np.size(lse) // np.size(sink), magnitude=magnitude)


def hopper_case(rng, name, dtype, seqlen, batch=2, heads=3):
    """A random dense problem in the Hopper order ``conftest.FA_HOPPER_CONFIGS[name]``: ``(layout, head_dim,
    logical dQ, accumulator, scale, expected dQ)``."""
    from conftest import FA_HOPPER_CONFIGS, FA_HOPPER_HEAD_DIM
    from jax_dqpost import AccumLayout

    tile_m, threads, atom, swap, mult = FA_HOPPER_CONFIGS[name]
    head_dim = FA_HOPPER_HEAD_DIM[name]
    layout = AccumLayout(90, tile_m, threads, atom, swap, mult)
    logical = random_logical(rng, (batch, seqlen, heads, head_dim))
    acc = build_accumulator(logical, (tile_m, threads, atom, swap), hdim_multiple_of=mult, rng=rng)
    scale = float(rng.uniform(0.05, 2.0))
    return layout, head_dim, logical, acc, scale, expected_dq(logical, scale, dtype)


POISON_BITS = {2: 0xFFFF, 4: 0xFFFFFFFF}
"""By element size: a NaN in bf16 and fp16, and in float32. Outputs are filled with it before a kernel runs, so an
element the kernel leaves unwritten shows."""
