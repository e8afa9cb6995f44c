"""Where a producer's MMA fragment puts each value: the PTX fragment maps, as plain integer arithmetic.

Each function takes Python ints, numpy integer arrays or the kernel's CuTe DSL integers alike (``//``, ``%``,
``*``, ``+`` only), so ``AccumLayout.tile_index_map`` (numpy, for the reference and the tests) and the kernel
(``tile.py``) evaluate the same formulas. The orders (``docs/design.md`` derives each one and names its source):

* Hopper wgmma (``arch=90``, ``flash_bwd_sm90.py``): warpgroup ``w`` owns the contiguous chunk ``w`` of the tile;
  inside it, thread ``t`` stores registers ``4k .. 4k+3`` as one 16-byte vector at ``512 k + 4 t``. Register ``r``
  is element ``r`` of the thread's wgmma D fragment (64 x ``n_atom`` atoms, warpgroups tiled ``(atoms_m, atoms_n)``
  over the MMA, whose ``(m, n)`` is the tile's ``(column, row)`` when ``swap_ab``): :func:`wgmma_coord`.
* Ampere ``mma.sync`` m16n8k16 (``arch=80``, ``flash_bwd.py``, FlashAttention's sm80 and sm120 paths): one float per
  thread per store, ``f = tid + num_threads * r``; warps tiled ``(atoms_m, atoms_n)`` with 16 x 16 permutation
  tiles per warp, the 8-column blocks round-robin over the warps along N: :func:`mma_sync_offset`.
* Blackwell tcgen05 (``arch=100``, ``flash_bwd_sm100.py``, 128-row tiles, 128 threads): thread ``t`` holds TMEM lane
  ``t`` = row ``t`` and stores columns ``4c .. 4c+3`` at ``512 c + 4 t``; with the 2-CTA MMA each CTA of the pair
  holds 64 rows, lane ``u`` the left half of the columns and lane ``u + 64`` the right half, and the pair's chunks
  follow each other: :func:`tcgen05_offset`.
* row-major (``arch=None``): ``i * Dr + j``.
"""

from __future__ import annotations

import enum

WARPGROUP = 128
"""Threads of a warpgroup, the unit of a wgmma."""
WGMMA_M = 64
"""Rows of a wgmma atom."""
MMA_SYNC_TILE = 16
"""m16n8k16 atoms: a warp's permutation tile is 16 x 16."""


class OrderFamily(enum.Enum):
    """The families of the accumulator orders, by where a producer's thread keeps its values in a tile: each family
    is read its own way (``tile.TileConverter``). :meth:`of` gives an order's (``AccumLayout.arch``)."""

    MMA = "mma"  # arch 90 (wgmma) and 80 (mma.sync): a thread's registers of the producer's MMA fragment
    TMEM_ROWS = "tmem rows"  # arch 100 (tcgen05): a thread per TMEM lane, a row of the tile
    ROW_MAJOR = "row-major"  # arch None: the tile's rows one after the other

    @classmethod
    def of(cls, arch: int | None) -> "OrderFamily":
        return {90: cls.MMA, 80: cls.MMA, 100: cls.TMEM_ROWS, None: cls.ROW_MAJOR}[arch]


def wgmma_coord(tid, r, *, n_atom: int, atoms_m: int, swap_ab: bool):
    """The tile's ``(row, column)`` of register ``r`` of thread ``tid`` in a Hopper-order fragment: the wgmma
    ``.m64nNk16`` D fragment, f32 accumulator (PTX ISA): register ``r`` of atom ``r // (n_atom / 2)``,
    ``v = r % (n_atom / 2)``, of thread (warpgroup ``w``, warp ``q``, ``lane``) is row
    ``16 q + lane / 4 + 8 ((v / 2) % 2)`` and column ``8 (v / 4) + 2 (lane % 4) + v % 2`` of the atom."""
    per_atom = n_atom // 2  # registers of one 64 x n_atom atom
    v, mm = r % per_atom, r // per_atom
    w, t = tid // WARPGROUP, tid % WARPGROUP
    q, lane = t // 32, t % 32
    wm, wn = w % atoms_m, w // atoms_m
    m = WGMMA_M * wm + WGMMA_M * atoms_m * mm + 16 * q + lane // 4 + 8 * ((v // 2) % 2)
    n = n_atom * wn + 8 * (v // 4) + 2 * (lane % 4) + v % 2
    return (n, m) if swap_ab else (m, n)


def wgmma_offset(tid, r, *, chunk: int):
    """The float offset in its tile of register ``r`` of thread ``tid`` in a Hopper order: warpgroup ``w``'s chunk
    of ``chunk`` floats, then one 16-byte vector per thread per 4 registers."""
    w, t = tid // WARPGROUP, tid % WARPGROUP
    return w * chunk + 512 * (r // 4) + 4 * t + r % 4


def wgmma_vector_row(k: int, tid, *, n_atom: int, atoms_m: int, swap_ab: bool):
    """The lower row of 16-byte vector ``k`` (registers ``4k .. 4k+3``) of a Hopper-order fragment: its registers
    are rows ``(row, row + 8)`` at two adjacent columns, or (``swap_ab``) rows ``(row, row + 1)``
    (:func:`wgmma_coord` of register ``4k``)."""
    per_atom = n_atom // 2
    v, mm = (4 * k) % per_atom, (4 * k) // per_atom
    w, t = tid // WARPGROUP, tid % WARPGROUP
    if swap_ab:
        return n_atom * (w // atoms_m) + 8 * (v // 4) + 2 * (t % 4)
    return WGMMA_M * (w % atoms_m) + WGMMA_M * atoms_m * mm + 16 * (t // 32) + (t % 32) // 4


def wgmma_pair_vector(p, j, *, n_atom: int, atoms_m: int, chunk: int):
    """In a swapped Hopper order, the float offset of the first of the eight 16-byte vectors that hold rows
    ``2p, 2p + 1`` and columns ``16 j .. 16 j + 15``; vector ``c`` is ``16 c`` floats further, its element ``2 e + o``
    is ``(2p + o, 16 j + 8 e + c)``: :func:`wgmma_coord` with the tile's row as N and its column as M, inverted."""
    per_atom = n_atom // 2
    cn, wn = (2 * p) % n_atom, (2 * p) // n_atom  # N: rows 2p, 2p + 1 are registers v, v + 1 of one thread
    w = (j // 4) % atoms_m + atoms_m * wn  # M: the 64-column atom of columns 16 j .., and its warpgroup
    k = (j // (4 * atoms_m)) * (per_atom // 4) + cn // 8  # the thread's vector: registers 4k .. 4k + 3
    t = 32 * (j % 4) + (cn % 8) // 2  # the thread holding column 16 j (c = 0); column 16 j + c: t + 4c
    return w * chunk + 512 * k + 4 * t


def mma_sync_offset(i, j, *, m_extent: int, atoms_m: int, atoms_n: int, num_threads: int, swap_ab: bool):
    """The float offset in its tile of element ``(i, j)`` of an Ampere-order fragment: the m16n8k16 fragment
    inverted, element -> (thread, register) -> ``tid + num_threads * r``. ``m_extent``: the MMA's M."""
    m, n = (j, i) if swap_ab else (i, j)
    pm, pn = MMA_SYNC_TILE * atoms_m, MMA_SYNC_TILE * atoms_n  # permutation tile of the tiled MMA
    mm, wm, u = m // pm, (m % pm) // 16, m % 16
    nt, a, c = n // pn, (n % pn) // 8, n % 8
    wn, warp_block = a % atoms_n, a // atoms_n  # 8-column blocks go round-robin over the warps along N
    tid = 32 * (wm + atoms_m * wn) + 4 * (u % 8) + c // 2
    r = c % 2 + 2 * (u // 8) + 4 * (mm + (m_extent // pm) * (warp_block + 2 * nt))
    return tid + num_threads * r


def tcgen05_offset(i, j, *, padded_head_dim: int, two_cta: bool):
    """The float offset in its tile of element ``(i, j)`` of a Blackwell-order fragment (1-CTA or 2-CTA MMA)."""
    if not two_cta:
        return 512 * (j // 4) + 4 * i + j % 4  # thread = TMEM lane = row, 16-byte vectors of 4 columns
    half = padded_head_dim // 2  # lane u holds the left half of its row, lane u + 64 the right half
    t = i % 64 + 64 * (j // half)
    col = j % half
    return (i // 64) * 64 * padded_head_dim + 512 * (col // 4) + 4 * t + col % 4
