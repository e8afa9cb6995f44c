"""The accumulator orders. Who wrote the accumulator: :class:`AccumLayout`, the record of a producer's accumulator
order, its validation and the geometry it implies (padded shapes, the producer's MMA tiling, the per-tile index map
``F[i, j]`` = position of logical element ``(row i, column j)`` inside one tile of ``tile_m * Dr`` floats). Plain
data: no GPU, no JAX, no CuTe.

The FlashAttention backward kernels reduce-add dQ into an fp32 scratch buffer ("dQaccum") in the order their MMA
accumulator fragments sit in registers, thread by thread: ``fragments.py`` holds those maps, which the kernel
evaluates too, ``docs/design.md`` derives each order and names its upstream source. FlashAttention-4's presets
(:meth:`AccumLayout.flash_attention`) are ``_presets.py``'s; what the kernel takes of an order
(:meth:`AccumLayout.check_head_dim`) ``limits.py``'s. Nothing of the kernel (``_kernel/``) is imported here: it
imports these.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import _checks
from .._checks import MAX_HEAD_DIM
from . import _presets, fragments, limits
from .fragments import MMA_SYNC_TILE, WARPGROUP, WGMMA_M

__all__ = ["AccumLayout"]


def padded_total(total, batch, pad_rows: int):
    """``Tp``: accumulator rows FlashAttention allocates, ``round_up(T + B * P, P)``, ``P`` = ``pad_rows`` (a tile,
    or a cluster of tiles). Plain arithmetic: also evaluated on the kernel's run-time integers."""
    return (total + (batch + 1) * pad_rows - 1) // pad_rows * pad_rows


ORDERS = (80, 90, 100, None)
"""The accumulator orders (:attr:`AccumLayout.arch`): 90 Hopper wgmma, 80 ``mma.sync``, 100 Blackwell tcgen05, None
row-major."""
ORDER_OF_FAMILY = {8: 80, 9: 90, 10: 100, 11: 100, 12: 80}
"""The accumulator order FlashAttention's backward writes on each GPU family (sm80 and sm120: ``mma.sync``, sm90:
wgmma, sm100 and sm110: tcgen05); fa4-jax's tile plans name the family too."""
_MAX_CLUSTER = 8
HDIM_MULTIPLES = (8, 16, 32, 64, 128, 256)
"""The values of :attr:`AccumLayout.hdim_multiple_of`: powers of two, as FlashAttention's ``tile_hdim`` is."""


def _check_int(name: str, value, *, minimum: int = 1) -> int:
    return _checks.static_int(f"AccumLayout.{name}", value, minimum=minimum)


def _check_bool(name: str, value) -> bool:
    return _checks.static_bool(f"AccumLayout.{name}", value)


CONSTRUCTORS = ("AccumLayout.flash_attention(gpu, head_dim, causal=..., tensor='dq' or 'dkv', version=...) gives "
                "the order FlashAttention-4's backward writes, AccumLayout.row_major() the order of an accumulator "
                "made in JAX (dq_accum_from_dq)")
"""How to get a layout: the errors for a missing one say this."""
NO_DEFAULT = "no default: an accumulator read in another order gives wrong values, not an error"
"""Why no argument that picks an order has a default."""


@dataclasses.dataclass(frozen=True)
class AccumLayout:
    """The order in which a producer (FlashAttention's backward) wrote an fp32 accumulator (dQ, or dK/dV).

    Most users need not spell the fields: :meth:`flash_attention` gives the order FlashAttention-4's backward writes,
    :meth:`row_major` the one for an accumulator made in JAX, ``jax_dqpost.fa4jax.accum_layout`` fa4-jax's. No field
    that picks an order has a default (an accumulator read in another order gives wrong values, not an error);
    ``dataclasses.replace`` keeps ``two_cta`` and ``cluster_size``, so pass them when it changes ``arch`` to 100.

    Attributes:
      arch: the producer's accumulator order: ``90`` Hopper WGMMA, ``80`` Ampere ``mma.sync`` (also
        FlashAttention's sm120 path), ``100`` Blackwell tcgen05, ``None`` row-major. Data order only,
        independent of the GPU the postprocess runs on.
      tile_m: rows per accumulator tile (FlashAttention's ``m_block_size`` / kBlockM; for dK/dV its
        ``n_block_size``).
      num_threads: threads of the producer's MMA (128 per warpgroup on Hopper, 32 per warp on Ampere,
        128 on Blackwell); for ``arch=None``, the CTA size of the postprocess.
      atom_layout: FlashAttention's ``AtomLayoutMdQ``: warpgroups (90) or warps (80) along the row mode.
      swap_ab: FlashAttention's ``dQ_swapAB``: the MMA computed dQ transposed (80 and 90).
      hdim_multiple_of: the producer's tiles pad the head dimension to ``Dr``, a multiple of this: a tile holds
        ``tile_m * Dr`` floats (FlashAttention's ``tile_hdim``; 32 in its CuTe DSL, 64 for its Hopper configurations
        with head dim > 128, 16 in flash-attn 4.0.0b36's Hopper backward up to head dim 128). A power of two, 8 to
        256.
      alloc_hdim_multiple_of: keyword-only; the accumulator was allocated with the head dimension padded to ``Da``, a
        multiple of this (default: ``hdim_multiple_of``, ``Da = Dr``), and a multiple of ``hdim_multiple_of``. Each
        (batch, head) row of ``Sr * Da`` floats holds its tiles in its first ``Sr * Dr`` floats and nothing the op
        reads after them (varlen: ``Tp * Da`` per head, tiles in the first ``Tp * Dr``). flash-attn 4.0.0b36's
        Hopper backward writes such rows: tiles of ``Dr = ceil(D / 16) * 16`` in rows allocated for
        ``Da = ceil(D / 32) * 32`` (:meth:`flash_attention`).
      varlen_unreadable: keyword-only; None, or why the producer's packed (varlen) accumulators in this order hold no
        values a reading can recover (flash-attn 4.0.0b36's Hopper dQ where its tiles and its allocation disagree:
        its preprocess zeroes the allocation's tiles, its backward adds into others). A varlen call raises
        ``ValueError`` with it at trace time; dense calls read the accumulator.
      two_cta: keyword-only; required for ``arch=100``, where it picks the 2-CTA (``cta_group::2``) MMA's order over
        the 1-CTA one (the two have the same shape); False (the only value) for the other orders when left out.
      cluster_size: keyword-only; CTAs of the producer's cluster along the rows (FlashAttention-4's
        ``cluster_size``: 2 for Blackwell's 2-CTA dK/dV). Required for ``arch=100``; 1 for the other orders when
        left out. Rows are padded in units of ``tile_m * cluster_size`` (:attr:`pad_rows`): the dense ``Sr`` and the
        varlen padded offsets and ``Tp``; tiles stay ``tile_m`` rows.

    Instances are frozen and hashable; invalid fields raise ``TypeError``/``ValueError`` on construction, a
    missing one ``TypeError`` naming it. Whether a head dimension fits the layout is checked by
    :meth:`check_head_dim`.
    """

    arch: int | None
    tile_m: int
    num_threads: int
    atom_layout: int
    swap_ab: bool
    hdim_multiple_of: int
    two_cta: bool | None = dataclasses.field(default=None, kw_only=True)
    cluster_size: int | None = dataclasses.field(default=None, kw_only=True)
    alloc_hdim_multiple_of: int | None = dataclasses.field(default=None, kw_only=True)
    varlen_unreadable: str | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        arch = None if self.arch is None else _check_int("arch", self.arch)
        if arch not in ORDERS:
            hint = ""
            if arch in _presets.FLASH_ATTENTION_ARCHS:
                hint = (f"; FlashAttention's sm{arch} backward writes the arch={ORDER_OF_FAMILY[arch // 10]} order "
                        f"(AccumLayout.flash_attention({arch}, head_dim, causal=..., tensor=..., version=...) gives "
                        "its layouts)")
            raise ValueError(f"AccumLayout.arch={arch} is not an accumulator order; the orders are "
                             f"{ORDERS} (90 Hopper wgmma, 80 mma.sync, 100 Blackwell tcgen05, None "
                             f"row-major){hint}")
        missing = [f"{name}=" for name in ("two_cta", "cluster_size") if getattr(self, name) is None]
        if arch == 100 and missing:
            raise TypeError(f"AccumLayout(arch=100) needs {' and '.join(missing)}: the tcgen05 orders of the 1-CTA "
                            "and the 2-CTA MMA have the same shape (FlashAttention-4 writes dQ with two_cta=True and "
                            "dK/dV with cluster_size=2 at head dims 128..192; AccumLayout.flash_attention(100, "
                            "head_dim, causal=..., tensor=..., version=...) gives them)")
        tile_m = _check_int("tile_m", self.tile_m)
        if tile_m % 8:
            raise ValueError(f"AccumLayout.tile_m must be a multiple of 8, got {tile_m}")
        num_threads = _check_int("num_threads", self.num_threads)
        atom_layout = _check_int("atom_layout", self.atom_layout)
        swap_ab = _check_bool("swap_ab", self.swap_ab)
        two_cta = _check_bool("two_cta", False if self.two_cta is None else self.two_cta)
        cluster_size = _check_int("cluster_size", 1 if self.cluster_size is None else self.cluster_size)
        if cluster_size > _MAX_CLUSTER:
            raise ValueError(f"AccumLayout.cluster_size must be at most {_MAX_CLUSTER} (CUDA's portable cluster "
                             f"size), got {cluster_size}")
        mult = _check_int("hdim_multiple_of", self.hdim_multiple_of)
        if mult not in HDIM_MULTIPLES:
            raise ValueError(f"AccumLayout.hdim_multiple_of must be a power of two from 8 to {MAX_HEAD_DIM} "
                             f"({', '.join(map(str, HDIM_MULTIPLES))}: a producer's tiles pad the head dim to a "
                             f"multiple of one), got {mult}")
        alloc = mult if self.alloc_hdim_multiple_of is None else _check_int("alloc_hdim_multiple_of",
                                                                            self.alloc_hdim_multiple_of)
        if alloc % mult or alloc > MAX_HEAD_DIM:
            raise ValueError(f"AccumLayout.alloc_hdim_multiple_of must be a multiple of hdim_multiple_of={mult} (the "
                             f"allocated row holds the tiles) and at most {MAX_HEAD_DIM}, got {alloc}")
        if self.varlen_unreadable is not None and not isinstance(self.varlen_unreadable, str):
            raise TypeError(f"AccumLayout.varlen_unreadable must be None or a str (the reason), got "
                            f"{_checks.describe(self.varlen_unreadable)}")
        # Normalise numpy scalars so equal layouts hash equal.
        for name, value in (("arch", arch), ("tile_m", tile_m), ("num_threads", num_threads),
                            ("atom_layout", atom_layout), ("hdim_multiple_of", mult), ("swap_ab", swap_ab),
                            ("two_cta", two_cta), ("cluster_size", cluster_size),
                            ("alloc_hdim_multiple_of", alloc)):
            object.__setattr__(self, name, value)
        if two_cta and arch != 100:
            raise ValueError(f"AccumLayout.two_cta=True is a Blackwell (arch=100) order, got arch={arch}")
        if arch == 90:
            if num_threads % WARPGROUP or num_threads > 4 * WARPGROUP:
                raise ValueError("AccumLayout.num_threads must be 128, 256, 384 or 512 (whole warpgroups) for "
                                 f"arch=90, got {num_threads}")
            self._check_atoms(num_threads // WARPGROUP, "warpgroups num_threads/128", WGMMA_M)
        elif arch == 80:
            if num_threads % 32 or num_threads > 1024:
                raise ValueError(f"AccumLayout.num_threads must be a multiple of 32 (whole warps), at most 1024, "
                                 f"for arch=80, got {num_threads}")
            self._check_atoms(num_threads // 32, "warps num_threads/32", MMA_SYNC_TILE)
        else:
            fixed = dict(atom_layout=1, swap_ab=False)
            if arch == 100:
                fixed.update(tile_m=128, num_threads=128)
            elif num_threads % 32 or num_threads > 1024:
                raise ValueError(f"AccumLayout.num_threads must be a multiple of 32, at most 1024, got {num_threads}")
            for name, want in fixed.items():
                if getattr(self, name) != want:
                    raise ValueError(f"AccumLayout.{name} must be {want} for arch={arch}, got {getattr(self, name)}")

    def _check_atoms(self, units: int, what: str, rows_per_unit: int):
        if units % self.atom_layout:
            raise ValueError(f"AccumLayout.atom_layout={self.atom_layout} must divide the number of {what}={units}")
        if not self.swap_ab and self.tile_m % (rows_per_unit * self.atom_layout):
            raise ValueError(
                f"AccumLayout.tile_m={self.tile_m} must be a multiple of {rows_per_unit * self.atom_layout}: each "
                f"of the atom_layout={self.atom_layout} units along tile_m holds whole {rows_per_unit}-row MMA tiles")

    # ----------------------------------------------------------------------------------------------
    @classmethod
    @_checks.required_arguments(**_presets.HINTS)
    def flash_attention(cls, gpu: int, head_dim: int, *, causal: bool, tensor: str, version: str,
                        head_dim_v: int | None = None) -> "AccumLayout":
        return _presets.flash_attention(cls, gpu, head_dim, causal=causal, tensor=tensor, version=version,
                                       head_dim_v=head_dim_v)

    flash_attention.__func__.__doc__ = _presets.flash_attention.__doc__  # the presets' table, with their sources

    @classmethod
    def row_major(cls, *, tile_m: int = 64, num_threads: int = 256, hdim_multiple_of: int = 32,
                  cluster_size: int = 1) -> "AccumLayout":
        """The row-major order (``arch=None``): ``(Sr, Dr)`` per (batch, head), for an accumulator made by ordinary
        JAX code (``dq_accum_from_dq``, or a backward written in jax.numpy). The element order is fixed; the
        arguments set the padding (rows in units of ``tile_m * cluster_size``, the head dim to a multiple of
        ``hdim_multiple_of``: build the accumulator and postprocess it with the same layout) and the postprocess's
        tile and CTA size (``num_threads``)."""
        return cls(None, tile_m, num_threads, 1, False, hdim_multiple_of, two_cta=False, cluster_size=cluster_size)

    # ----------------------------------------------------------------------------------------------
    # Derived geometry
    @property
    def num_warpgroups(self) -> int:
        return self.num_threads // WARPGROUP

    def padded_head_dim(self, head_dim: int) -> int:
        """``Dr``: the head dimension as padded in the producer's tiles."""
        return -(-head_dim // self.hdim_multiple_of) * self.hdim_multiple_of

    def alloc_head_dim(self, head_dim: int) -> int:
        """``Da``: the head dimension as padded in the accumulator's allocation (``Dr`` but for
        :attr:`alloc_hdim_multiple_of`). A function of ``Dr`` alone: ``ceil(Dr / alloc_hdim_multiple_of)``
        multiples."""
        return -(-head_dim // self.alloc_hdim_multiple_of) * self.alloc_hdim_multiple_of

    @property
    def pad_rows(self) -> int:
        """The unit of the producer's row padding: ``tile_m * cluster_size``."""
        return self.tile_m * self.cluster_size

    def padded_seqlen(self, seqlen: int) -> int:
        """``Sr``: the sequence length rounded up to whole tiles (whole clusters of tiles: :attr:`pad_rows`).
        ``seqlen``: a Python int >= 0 (``TypeError``/``ValueError`` naming it otherwise)."""
        seqlen = _checks.static_int("seqlen", seqlen, minimum=0)
        return -(-seqlen // self.pad_rows) * self.pad_rows

    def num_tiles(self, seqlen: int) -> int:
        """Tiles of ``tile_m`` rows that hold a dense sequence's rows: ``ceil(seqlen / tile_m)``."""
        return -(-seqlen // self.tile_m)

    def accum_shape(self, batch: int, heads: int, seqlen: int, head_dim: int) -> tuple[int, int, int]:
        """Shape of a dense accumulator: ``(batch, heads, Sr * Da)`` (``Da = Dr`` but for
        :attr:`alloc_hdim_multiple_of`). The sizes are Python ints >= 0 and ``head_dim`` one the op takes with this
        layout (:meth:`check_head_dim`): ``TypeError``/``ValueError`` naming the argument otherwise."""
        batch, heads, seqlen, head_dim = self._sizes(batch=batch, heads=heads, seqlen=seqlen, head_dim=head_dim)
        return (batch, heads, self.padded_seqlen(seqlen) * self.alloc_head_dim(head_dim))

    def varlen_accum_shape(self, batch: int, heads: int, total_q: int, head_dim: int) -> tuple[int, int]:
        """Shape of a varlen accumulator for ``batch`` packed sequences of ``total_q`` rows:
        ``(heads, Tp * Da)`` with FlashAttention's ``Tp = round_up(total_q + batch * P, P)``, ``P`` =
        :attr:`pad_rows`. The arguments are checked as :meth:`accum_shape`'s."""
        batch, heads, total_q, head_dim = self._sizes(batch=batch, heads=heads, total_q=total_q, head_dim=head_dim)
        return (heads, padded_total(total_q, batch, self.pad_rows) * self.alloc_head_dim(head_dim))

    def _sizes(self, **sizes) -> list[int]:
        """The shape helpers' arguments, checked: sizes Python ints >= 0, the head dim as the op checks it."""
        head_dim = sizes.pop("head_dim")
        self.check_head_dim(head_dim)
        return [_checks.static_int(name, value, minimum=0) for name, value in sizes.items()] + [int(head_dim)]

    def mma_geometry(self, head_dim: int) -> dict:
        """The producer's dQ MMA (arch 80 and 90) as the kernel rebuilds it (all ints; None if it does not
        divide).

        ``m``/``n``: the MMA problem (swapped when ``swap_ab``); ``atoms_m``/``atoms_n``: warpgroups (90) or
        warps (80) along each mode; ``n_atom``: N of one warpgroup's WGMMA atom (90); ``m_repeats``: 64-row
        atoms per warpgroup along M (90); ``regs``: fp32 registers per thread.
        """
        dr = self.padded_head_dim(head_dim)
        units = self.num_threads // (WARPGROUP if self.arch == 90 else 32)
        m, n = (dr, self.tile_m) if self.swap_ab else (self.tile_m, dr)
        atoms_m, atoms_n = (units // self.atom_layout, self.atom_layout) if self.swap_ab else (
            self.atom_layout, units // self.atom_layout)
        return dict(
            m=m, n=n, atoms_m=atoms_m, atoms_n=atoms_n,
            n_atom=n // atoms_n if n % atoms_n == 0 else None,
            m_repeats=m // (WGMMA_M * atoms_m) if m % (WGMMA_M * atoms_m) == 0 else None,
            regs=self.tile_m * dr // self.num_threads,
        )

    def check_head_dim(self, head_dim: int, name: str = "head_dim") -> None:
        """Raise ``ValueError`` unless ``head_dim`` can be stored in this accumulator order and postprocessed on
        every supported GPU: the MMA tiling divides, the padded head dim is at most 256, the kernel can place the
        fragment (wgmma: 16-column multiples per warpgroup; mma.sync: a power-of-two number of warps, and at least
        two along dQ's rows with ``swap_ab``), ``tile_m`` is a multiple of 16, the kernel's threads tile the dQ
        tile's 16-byte stores exactly, and the tile fits in the 99 KiB of shared memory a CTA may use on every
        supported GPU. What passes compiles for sm_80, sm_90a and sm_100a alike (``tests/test_accepted_layouts.py``).
        ``name``: the argument the messages name. The message of a head dim the order cannot hold lists those it
        can, and the presets it is FlashAttention-4's for: a layout made for another head dim is the usual cause."""
        head_dim = _checks.head_dim(head_dim, name)
        try:
            self._check_kernel(head_dim, name)
        except ValueError as e:
            raise ValueError(f"{e}. {self._made_for(head_dim, name)}") from None

    def _made_for(self, head_dim: int, name: str) -> str:
        """Which head dims this order holds, and whose preset it is: the hint of ``check_head_dim``'s errors."""
        fits = [d for d in range(8, MAX_HEAD_DIM + 1, 8) if self._holds(d)]
        if self.arch is None:  # the row-major order is made for no head dim: its fields must suit this one
            held = f"head dims {_presets.head_dim_ranges(fits)}" if fits else "no head dim"
            return (f"This row-major layout holds {held}; AccumLayout.row_major() with its default tile_m, "
                    f"num_threads and hdim_multiple_of holds every head dim")
        if not fits:
            return "This layout holds no head dim"
        return (f"This layout holds head dims {_presets.head_dim_ranges(fits)}, so it was probably made for another "
                f"head dim{_presets.preset_hint(self)}: build the layout for {name}={head_dim}")

    def _holds(self, head_dim: int) -> bool:
        try:
            self._check_kernel(head_dim, "head_dim")
        except ValueError:
            return False
        return True

    def _check_kernel(self, head_dim: int, name: str) -> None:
        head_dim, dr, what = self._check_order(head_dim, name)
        limits.check_limits(self, head_dim, what)

    def _check_order(self, head_dim: int, name: str = "head_dim"):
        """The order itself is defined for ``head_dim`` (the producer's MMA tiling divides, Dr <= 256):
        ``(head_dim, Dr, description)``, else ``ValueError``. What the index map needs; the kernel needs more."""
        head_dim = _checks.head_dim(head_dim, name)
        dr = self.padded_head_dim(head_dim)
        what = f"{name}={head_dim} (padded to {dr}) with {self}"
        if dr > MAX_HEAD_DIM:
            raise ValueError(f"{what}: the padded head dim must be at most {MAX_HEAD_DIM}")
        self._check_mma_tiling(head_dim, what)
        return head_dim, dr, what

    def _check_mma_tiling(self, head_dim: int, what: str) -> None:
        if self.arch not in (80, 90):
            if (self.tile_m * self.padded_head_dim(head_dim)) % (4 * self.num_threads):
                raise ValueError(f"{what}: a tile is not a whole number of 16-byte vectors per thread")
            return
        g = self.mma_geometry(int(head_dim))
        if self.arch == 80:
            if g["m"] % (MMA_SYNC_TILE * g["atoms_m"]) or g["n"] % (MMA_SYNC_TILE * g["atoms_n"]):
                raise ValueError(f"{what}: the MMA problem ({g['m']}, {g['n']}) is not a whole number of 16 x 16 "
                                 f"tiles per warp over ({g['atoms_m']}, {g['atoms_n']}) warps")
            return
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

        A permutation of ``range(tile_m * Dr)``, computed from the order's closed form. Defined for every head dim
        the order can hold, also where the kernel's own limits (:meth:`check_head_dim`) refuse it.
        """
        self._check_order(head_dim)
        dr = self.padded_head_dim(head_dim)
        g = self.mma_geometry(head_dim)
        i, j = np.arange(self.tile_m, dtype=np.int64)[:, None], np.arange(dr, dtype=np.int64)[None, :]
        if self.arch is None:
            return i * dr + j
        if self.arch == 100:
            return fragments.tcgen05_offset(i, j, padded_head_dim=dr, two_cta=self.two_cta)
        if self.arch == 80:
            return fragments.mma_sync_offset(i, j, m_extent=g["m"], atoms_m=g["atoms_m"], atoms_n=g["atoms_n"],
                                             num_threads=self.num_threads, swap_ab=self.swap_ab)
        # wgmma: forward from (thread, register) to the tile's coordinate and the float offset
        tid, r = np.arange(self.num_threads, dtype=np.int64)[:, None], np.arange(g["regs"], dtype=np.int64)[None, :]
        out = np.full((self.tile_m, dr), -1, dtype=np.int64)
        out[fragments.wgmma_coord(tid, r, n_atom=g["n_atom"], atoms_m=g["atoms_m"], swap_ab=self.swap_ab)] = (
            fragments.wgmma_offset(tid, r, chunk=self.tile_m * dr // self.num_warpgroups))
        if (out < 0).any():  # pragma: no cover - guarded by check_head_dim
            raise AssertionError("internal error: index map is not a bijection")
        return out

    # ----------------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"AccumLayout(arch={self.arch}, tile_m={self.tile_m}, num_threads={self.num_threads}, "
                f"atom_layout={self.atom_layout}, swap_ab={self.swap_ab}, "
                f"hdim_multiple_of={self.hdim_multiple_of}"
                + (f", two_cta={self.two_cta}" if self.two_cta or self.arch == 100 else "")
                + (f", cluster_size={self.cluster_size}" if self.cluster_size != 1 or self.arch == 100 else "")
                + (f", alloc_hdim_multiple_of={self.alloc_hdim_multiple_of}"
                   if self.alloc_hdim_multiple_of != self.hdim_multiple_of else "")
                + (f", varlen_unreadable={self.varlen_unreadable!r}" if self.varlen_unreadable else "") + ")")


AccumLayout.__init__ = _checks.required_arguments(
    **{f.name: f"the fields of the producer's order ({NO_DEFAULT}); {CONSTRUCTORS}"
       for f in dataclasses.fields(AccumLayout) if not f.kw_only})(AccumLayout.__init__)

