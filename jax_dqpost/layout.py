"""Who wrote the accumulator: :class:`AccumLayout` and the shapes it implies.

The FlashAttention backward kernels reduce-add dQ into an fp32 scratch buffer ("dQaccum") in the order
their MMA accumulator fragments sit in registers, thread by thread. This module describes that order as
plain data (no GPU, no JAX, no CuTe): the padded shapes, validation, and the per-tile index map
``F[i, j]`` = position of logical element ``(row i, column j)`` inside one tile of ``tile_m * Dr`` floats.

Only the Hopper order (``arch=90``, WGMMA accumulators) is implemented. Its contract (FlashAttention's
``flash_bwd_sm90.py`` writes it, ``flash_bwd_postprocess.py`` reads it):

* Warpgroup ``w`` (threads ``128w .. 128w+127``) owns the contiguous chunk ``w`` of the tile; inside a
  chunk, thread ``t`` of the warpgroup stores its registers ``4k .. 4k+3`` as one 16-byte vector at
  float offset ``512 k + 4 t``.
* Register ``r`` of a thread is element ``r`` of its compact column-major WGMMA C fragment: a
  ``64 x N_atom`` atom per warpgroup, warpgroups tiled ``(A_M', A_N')`` over the ``(M', N')`` problem,
  where ``(M', N') = (tile_m, Dr)`` and ``(A_M', A_N') = (atom_layout, nwg / atom_layout)``, both
  swapped when ``swap_ab`` (FlashAttention's ``dQ_swapAB`` computes dQ^T).
"""

from __future__ import annotations

import dataclasses
import numpy as np

__all__ = ["AccumLayout"]

_SUPPORTED_ARCHS = (90,)
_WARPGROUP = 128
_WGMMA_M = 64


def _check_int(name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"AccumLayout.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"AccumLayout.{name} must be >= {minimum}, got {value}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class AccumLayout:
    """The order in which a producer (FlashAttention's backward) wrote the fp32 dQ accumulator.

    Attributes:
      arch: the producer's accumulator order. ``90``: Hopper WGMMA fragments (FlashAttention's sm90
        backward, CuTe DSL or C++). This is data order only, independent of the GPU the
        postprocess runs on.
      tile_m: rows of dQ per accumulator tile (FlashAttention's ``m_block_size`` / kBlockM).
      num_threads: threads of the producer's dQ MMA (128 per warpgroup on Hopper).
      atom_layout: FlashAttention's ``AtomLayoutMdQ``: warpgroups along the M (row) mode.
      swap_ab: FlashAttention's ``dQ_swapAB``: the MMA computed dQ transposed.
      hdim_multiple_of: the head dimension is padded to a multiple of this in the accumulator
        (32 in FlashAttention's CuTe DSL, 64 for some C++ Hopper configurations).

    Instances are frozen and hashable; invalid fields raise ``TypeError``/``ValueError`` on
    construction. Whether a head dimension fits the layout is checked by
    :meth:`check_head_dim`.
    """

    arch: int = 90
    tile_m: int = 64
    num_threads: int = 256
    atom_layout: int = 1
    swap_ab: bool = False
    hdim_multiple_of: int = 32

    def __post_init__(self):
        arch = _check_int("arch", self.arch)
        if arch not in _SUPPORTED_ARCHS:
            raise ValueError(
                f"AccumLayout.arch={arch} is not supported; supported accumulator orders: {_SUPPORTED_ARCHS}"
            )
        tile_m = _check_int("tile_m", self.tile_m)
        if tile_m % 8:
            raise ValueError(f"AccumLayout.tile_m must be a multiple of 8, got {tile_m}")
        num_threads = _check_int("num_threads", self.num_threads)
        if num_threads % _WARPGROUP or num_threads > 4 * _WARPGROUP:
            raise ValueError(
                "AccumLayout.num_threads must be 128, 256, 384 or 512 (whole warpgroups) for arch=90, "
                f"got {num_threads}"
            )
        atom_layout = _check_int("atom_layout", self.atom_layout)
        nwg = num_threads // _WARPGROUP
        if nwg % atom_layout:
            raise ValueError(
                f"AccumLayout.atom_layout={atom_layout} must divide the number of warpgroups "
                f"num_threads/128={nwg}"
            )
        if not isinstance(self.swap_ab, (bool, np.bool_)):
            raise TypeError(f"AccumLayout.swap_ab must be a bool, got {self.swap_ab!r}")
        mult = _check_int("hdim_multiple_of", self.hdim_multiple_of)
        if mult % 8:
            raise ValueError(f"AccumLayout.hdim_multiple_of must be a multiple of 8, got {mult}")
        # Normalise numpy scalars so equal layouts hash equal.
        for name, value in (("arch", arch), ("tile_m", tile_m), ("num_threads", num_threads),
                            ("atom_layout", atom_layout), ("hdim_multiple_of", mult)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "swap_ab", bool(self.swap_ab))
        if not self.swap_ab and tile_m % (_WGMMA_M * atom_layout):
            raise ValueError(
                f"AccumLayout.tile_m={tile_m} must be a multiple of {_WGMMA_M * atom_layout}: each of the "
                f"atom_layout={atom_layout} warpgroups along tile_m holds whole 64-row WGMMA atoms"
            )

    # ----------------------------------------------------------------------------------------------
    # Derived geometry
    @property
    def num_warpgroups(self) -> int:
        return self.num_threads // _WARPGROUP

    def padded_head_dim(self, head_dim: int) -> int:
        """``Dr``: the head dimension as padded in the accumulator."""
        return -(-head_dim // self.hdim_multiple_of) * self.hdim_multiple_of

    def padded_seqlen(self, seqlen: int) -> int:
        """``Sr``: the sequence length rounded up to whole tiles."""
        return -(-seqlen // self.tile_m) * self.tile_m

    def accum_shape(self, batch: int, heads: int, seqlen: int, head_dim: int) -> tuple[int, int, int]:
        """Shape of a dense accumulator: ``(batch, heads, Sr * Dr)``."""
        return (batch, heads, self.padded_seqlen(seqlen) * self.padded_head_dim(head_dim))

    def mma_geometry(self, head_dim: int) -> dict:
        """The producer's dQ MMA as the kernel rebuilds it (all ints).

        ``m``/``n``: the MMA problem (swapped when ``swap_ab``); ``atoms_m``/``atoms_n``: warpgroups
        along each mode; ``n_atom``: the N extent of one warpgroup's WGMMA atom; ``m_repeats``: 64-row
        atoms per warpgroup along M; ``regs``: fp32 registers per thread.
        """
        dr = self.padded_head_dim(head_dim)
        nwg = self.num_warpgroups
        m, n = (dr, self.tile_m) if self.swap_ab else (self.tile_m, dr)
        atoms_m, atoms_n = (nwg // self.atom_layout, self.atom_layout) if self.swap_ab else (
            self.atom_layout, nwg // self.atom_layout)
        return dict(
            m=m, n=n, atoms_m=atoms_m, atoms_n=atoms_n,
            n_atom=n // atoms_n if n % atoms_n == 0 else None,
            m_repeats=m // (_WGMMA_M * atoms_m) if m % (_WGMMA_M * atoms_m) == 0 else None,
            regs=self.tile_m * dr // self.num_threads,
        )

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ``ValueError`` unless ``head_dim`` can be stored in this accumulator order."""
        if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)):
            raise TypeError(f"head_dim must be an int, got {head_dim!r}")
        if head_dim <= 0 or head_dim % 8 or head_dim > 256:
            raise ValueError(f"head_dim must be a positive multiple of 8 and at most 256, got {head_dim}")
        g = self.mma_geometry(int(head_dim))
        what = f"head_dim={head_dim} (padded to {self.padded_head_dim(head_dim)}) with {self}"
        if g["m_repeats"] is None:
            raise ValueError(
                f"{what}: the MMA's M mode ({g['m']}) is not a whole number of 64-row WGMMA atoms "
                f"per warpgroup ({g['atoms_m']} warpgroups along M)"
            )
        if g["n_atom"] is None or g["n_atom"] % 8 or g["n_atom"] > 256:
            raise ValueError(
                f"{what}: the MMA's N mode ({g['n']}) split over {g['atoms_n']} warpgroups does not give "
                "a WGMMA N that is a multiple of 8 and at most 256"
            )

    # ----------------------------------------------------------------------------------------------
    # The index map
    def tile_index_map(self, head_dim: int) -> np.ndarray:
        """``F``: int64 array ``(tile_m, Dr)``; ``F[i, j]`` = float offset of dQ(i, j) in its tile.

        A permutation of ``range(tile_m * Dr)``. Built forward, from (thread, register) to both the
        accumulator position and the C-fragment coordinate, vectorised over all threads and registers.
        """
        self.check_head_dim(head_dim)
        g = self.mma_geometry(head_dim)
        dr = self.padded_head_dim(head_dim)
        regs, n_atom, atoms_m = g["regs"], g["n_atom"], g["atoms_m"]
        tid = np.arange(self.num_threads)[:, None]
        r = np.arange(regs)[None, :]
        w, t = tid // _WARPGROUP, tid % _WARPGROUP
        # Accumulator position: warpgroup chunk, then one 16-byte vector per thread per 4 registers.
        f = w * (self.tile_m * dr // self.num_warpgroups) + 512 * (r // 4) + 4 * t + r % 4
        # C-fragment coordinate (PTX ISA, wgmma .m64nNk16 D fragment, f32 accumulator).
        per_atom = n_atom // 2  # registers of one 64 x n_atom atom
        v, mm = r % per_atom, r // per_atom
        warp, lane = t // 32, t % 32
        row = 16 * warp + lane // 4 + 8 * ((v // 2) % 2)
        col = 8 * (v // 4) + 2 * (lane % 4) + v % 2
        wm, wn = w % atoms_m, w // atoms_m
        m_coord = _WGMMA_M * wm + _WGMMA_M * atoms_m * mm + row
        n_coord = n_atom * wn + col
        i, j = (n_coord, m_coord) if self.swap_ab else (m_coord, n_coord)
        out = np.full((self.tile_m, dr), -1, dtype=np.int64)
        out[i, j] = f
        if (out < 0).any():  # pragma: no cover - guarded by check_head_dim
            raise AssertionError("internal error: index map is not a bijection")
        return out

    # ----------------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"AccumLayout(arch={self.arch}, tile_m={self.tile_m}, num_threads={self.num_threads}, "
                f"atom_layout={self.atom_layout}, swap_ab={self.swap_ab}, "
                f"hdim_multiple_of={self.hdim_multiple_of})")

