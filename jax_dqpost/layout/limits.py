"""What the kernel's conversion takes of an order, beyond the order's own definition: its shared-memory tile (rows,
size), how it places an MMA fragment there, and its 16-byte stores. ``AccumLayout.check_head_dim`` asks
:func:`check_limits`, so that a layout says which head dims the op converts in its order; the kernel
(``_kernel/spec.py``, ``_kernel/tile.py``) reads the same numbers. Each limit was found by compiling: outside it the
CuTe DSL refuses the kernel, or aborts the process."""

from __future__ import annotations

import functools

VEC_BYTES = 16
"""The kernel's global loads and stores are 16-byte vectors."""
OUT_BYTES = 2
"""bf16 and fp16."""
SMEM_ROWS = 16
"""The kernel's swizzled dQ tile takes whole 16-row blocks (odd multiples of 8 do not compile)."""
SMEM_LIMIT = 99 * 1024
"""Shared memory a CTA may use on every supported GPU (the opt-in maximum of sm_86, sm_89 and sm_120; sm_80 has 163
KiB, sm_90 and sm_100 227 KiB). The kernel stages one ``tile_m x Dr`` dQ tile there."""


def check_limits(layout, head_dim: int, what: str) -> None:
    """``ValueError`` (``what`` first) unless the kernel can convert ``layout``'s tiles at ``head_dim``, an order
    already defined for it: how it places fragments into shared memory, the shared tile's rows and size, and its
    16-byte stores (``AccumLayout.check_head_dim`` lists them)."""
    dr = layout.padded_head_dim(head_dim)
    _check_fragment_stores(layout, head_dim, what)
    if layout.tile_m % SMEM_ROWS:
        raise ValueError(f"{what}: the kernel's swizzled shared-memory dQ tile needs tile_m to be a multiple of "
                         f"{SMEM_ROWS}, got {layout.tile_m}")
    if smem_bytes(layout, head_dim) > SMEM_LIMIT:
        raise ValueError(f"{what}: the kernel's dQ tile needs {smem_bytes(layout, head_dim)} bytes of shared memory "
                         f"(tile_m * Dr * 2), more than the {SMEM_LIMIT} a CTA may use on every supported GPU")
    if store_tiling(layout, dr) is None:
        raise ValueError(f"{what}: num_threads={layout.num_threads} cannot store the ({layout.tile_m}, {dr}) dQ tile "
                         f"as 16-byte vectors exactly (threads per row must divide the {dr // 8} vectors of a "
                         f"row and the rows per pass must divide tile_m)")


def store_tiling(layout, padded_head_dim: int) -> tuple[int, int] | None:
    """Threads ``(rows, per_row)`` of the kernel's 16-byte dQ stores over a ``(tile_m, Dr)`` tile, or None.

    ``per_row`` divides the row's vector count and the storing threads, and the rows covered per pass divide
    ``tile_m``, so the tile is covered exactly; among those, the widest rows win (coalescing). All
    ``num_threads`` threads store where such a tiling exists, else the first half, quarter... that has one (the
    others wait). The swizzled shared-memory tile is partitioned in 16-row blocks: a pass covers at least two
    rows and whole blocks or a divisor of one (the DSL refuses, or aborts on, other row counts).
    """
    return region_store_tiling(layout.tile_m, padded_head_dim, layout.num_threads)


def region_store_tiling(rows_m: int, cols: int, threads: int) -> tuple[int, int] | None:
    """:func:`store_tiling` of a ``(rows_m, cols)`` region of the tile by ``threads`` threads."""
    vecs_per_row = cols * OUT_BYTES // VEC_BYTES
    while threads >= 32:
        best = None
        for per_row in range(1, vecs_per_row + 1):
            if vecs_per_row % per_row or threads % per_row:
                continue
            rows = threads // per_row
            if rows >= 2 and rows_m % rows == 0 and (rows % SMEM_ROWS == 0 or SMEM_ROWS % rows == 0):
                best = (rows, per_row)
        if best is not None or threads % 2:
            return best
        threads //= 2
    return None


@functools.lru_cache(maxsize=256)


def smem_bytes(layout, head_dim: int) -> int:
    """Shared memory of the kernel's dQ tile: ``tile_m * Dr`` bf16/fp16 values; a CTA of a split tile reserves as
    much, its share's region using the first part (docs/design.md, "Work units")."""
    return layout.tile_m * layout.padded_head_dim(head_dim) * OUT_BYTES


def _check_fragment_stores(layout, head_dim: int, what: str) -> None:
    """How the kernel places an MMA fragment into shared memory limits the orders it takes (each limit found
    by compiling: outside it the DSL refuses the copy, or aborts the process)."""
    if layout.arch == 90 and layout.swap_ab:
        n_atom = layout.mma_geometry(head_dim)["n_atom"]
        if n_atom % 16:
            raise ValueError(f"{what}: each warpgroup's WGMMA tile is {n_atom} wide along N; the kernel's "
                             "transposed (swap_ab) stmatrix stores need a multiple of 16")
    elif layout.arch == 80:
        warps = layout.num_threads // 32
        if warps & (warps - 1):
            raise ValueError(f"{what}: the kernel places mma.sync fragments for a power-of-two number of warps, "
                             f"got {warps}")
        if layout.swap_ab and layout.atom_layout < 2:
            raise ValueError(f"{what}: a transposed (swap_ab) mma.sync fragment needs atom_layout >= 2 (at least "
                             "two warps along dQ's rows) for the 16-bit stores used on GPUs without stmatrix")
