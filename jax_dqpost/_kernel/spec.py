"""The kernel a call compiles: :class:`KernelSpec`, everything that changes the binary but the target GPU (its tuning,
:class:`Tuning`, among it), and the rules of which kernels exist (beyond the order's own, ``layout/limits.py``'s, which
``AccumLayout.check_head_dim`` asks; a layout here is an ``AccumLayout``). No cutlass here: the plan builds the record (``Plan.kernel``), the cache keys on it with the GPU
(``cache.py``), and the kernel is made from it alone (``kernel.Postprocess``). Batch, heads, sequence lengths, head dims
and scales are run-time arguments of the compiled module: never part of it."""

from __future__ import annotations

import dataclasses
import functools

from ..layout.limits import region_store_tiling
from . import abi, varlen
from .abi import Tiling

@dataclasses.dataclass(frozen=True)
class TensorKernel:
    """What of one tensor (dQ, dK or dV) changes the binary: its accumulator's order, its padded head dim ``Dr``
    (``AccumLayout.padded_head_dim``) and how a CTA finds its tile."""

    layout: object  # an AccumLayout
    padded_head_dim: int
    tiling: Tiling

    def __post_init__(self):
        object.__setattr__(self, "padded_head_dim", int(self.padded_head_dim))
        object.__setattr__(self, "tiling", Tiling(self.tiling))


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the kernel runs a call, never what it computes: the choices ``tuning.choose`` makes for a call, part of
    the kernel's cache key (:class:`KernelSpec`). ``shares``: the CTAs a tile is converted by, 1 or one of
    :func:`tile_shares`, each CTA converting the share of ``num_threads / shares`` of the producer's threads
    (:func:`share_regions`); ``short_heads``: the heads a varlen short-tile CTA converts, ``varlen.SHORT_HEADS`` or 1.
    Other values than the defaults only in a kernel of one tensor without a sink."""

    shares: int = 1
    short_heads: int = varlen.SHORT_HEADS

    def __post_init__(self):
        object.__setattr__(self, "shares", int(self.shares))
        object.__setattr__(self, "short_heads", int(self.short_heads))

    @property
    def label(self) -> str:
        """``""`` for the defaults, else ``"4"`` (shares), ``"h1"`` (short-tile heads), ``"4h1"``."""
        return ((str(self.shares) if self.shares != 1 else "")
                + (f"h{self.short_heads}" if self.short_heads != varlen.SHORT_HEADS else ""))


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """A kernel: the output dtype's name (``"bf16"`` or ``"f16"``; a dtype or its numpy name is taken for it), one
    :class:`TensorKernel` per tensor (dQ's, or dQ's, dK's and dV's: ``abi.PARTS``), the names of the learnable
    sink's and ``dsink``'s dtypes (None without a sink) and its :class:`Tuning`. ``ValueError`` on construction for
    a kernel that does not exist, naming what."""

    dtype: str
    tensors: tuple[TensorKernel, ...]
    sink: tuple[str, str] | None = None
    tuning: Tuning = Tuning()

    def __post_init__(self):
        names = abi.OUT_DTYPE_NAMES
        object.__setattr__(self, "dtype", abi.DTYPE_NAMES.get(abi.dtype_of(self.dtype), self.dtype))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        if self.sink is not None:
            object.__setattr__(self, "sink", tuple(self.sink))
        if self.dtype not in names:
            raise ValueError(f"jax_dqpost: a kernel's dtype is one of {names}, got {self.dtype!r}")
        abi.part_names(len(self.tensors))
        sink_names = abi.SINK_DTYPE_NAMES
        if self.sink is not None and (len(self.sink) != 2 or self.sink[0] not in sink_names
                                      or self.sink[1] not in (self.sink[0], "f32")):
            raise ValueError(f"jax_dqpost: a kernel's sink dtypes are the sink's, one of {sink_names}, and dsink's, "
                             f"the same or f32; got {self.sink!r}")
        for t in self.tensors:
            why = None
            if t.padded_head_dim % t.layout.hdim_multiple_of:
                why = f"not a multiple of hdim_multiple_of={t.layout.hdim_multiple_of}"
            else:
                try:
                    t.layout.check_head_dim(t.padded_head_dim)
                except ValueError as e:
                    why = str(e)
            if why:
                raise ValueError(f"jax_dqpost: no kernel for {t.layout}, padded head dim {t.padded_head_dim}: {why}")
        if not isinstance(self.tuning, Tuning):
            raise TypeError(f"jax_dqpost: a kernel's tuning is a Tuning, got {type(self.tuning).__name__}")
        t, shares, heads = self.tensors[0], self.tuning.shares, self.tuning.short_heads
        what = (f"{t.layout}, padded head dim {t.padded_head_dim}, {t.tiling.name}, {len(self.tensors)} tensor(s)"
                f"{' with a sink' if self.sink else ''}")
        if shares != 1 and (shares not in tile_shares(t.layout, t.padded_head_dim) or not self.single_part):
            raise ValueError(f"jax_dqpost: a kernel's tiles are split only into shares of whole warps that an order "
                             f"has ({tile_shares(t.layout, t.padded_head_dim)} here), in a kernel of one tensor "
                             f"without a sink; got shares={shares} for {what}")
        if heads != varlen.SHORT_HEADS and (heads != 1 or not self.single_part or t.tiling != Tiling.VARLEN
                                            or not varlen.short_rows(t.layout)):
            raise ValueError(f"jax_dqpost: a kernel's short-tile CTAs take {varlen.SHORT_HEADS} heads, or 1 in a "
                             f"varlen kernel of one tensor without a sink whose order has short tiles; got "
                             f"short_heads={heads} for {what}")

    @property
    def names(self) -> tuple[str, ...]:
        return abi.part_names(len(self.tensors))

    @property
    def single_part(self) -> bool:
        return single_part(len(self.tensors), self.sink is not None)

    @property
    def batch_on_grid_z(self) -> bool:
        return batch_on_grid_z(len(self.tensors), self.sink is not None, self.tensors[0].tiling)

    @property
    def label(self) -> str:
        """A short name: the dtype, each tensor's tiling (the first's with its tuning's label), ``sink``
        (``"bf16-dense-sink"``, ``"bf16-varlen8"``, ``"bf16-varlen4h1"``)."""
        tilings = [t.tiling.name.lower() for t in self.tensors]
        tilings[0] += self.tuning.label
        return "-".join([self.dtype] + tilings + (["sink"] if self.sink else []))


def single_part(num_tensors: int, sink: bool) -> bool:
    """One tensor and no sink: the launch is that tensor's own grid (``kernel.py``'s docstring)."""
    return num_tensors == 1 and not sink


def batch_on_grid_z(num_tensors: int, sink: bool, tiling: Tiling) -> bool:
    """An own grid of a dense tensor: the batch is the grid's z (the plan's launch and the kernel ask it)."""
    return single_part(num_tensors, sink) and tiling != Tiling.VARLEN


def tile_shares(layout, padded_head_dim: int) -> tuple[int, ...]:
    """Every ``shares`` > 1 a tile of this order takes (:func:`share_regions`), increasing. A call takes the last
    (``tuning.call_shares``); the others are for experiments."""
    # a varlen short-tile CTA of a split kernel has the share's threads
    least = max(32, varlen.short_tile_threads(layout, padded_head_dim))
    candidates = [s for s in range(2, layout.num_threads // least + 1) if layout.num_threads % (32 * s) == 0]
    return tuple(s for s in candidates if share_regions(layout, padded_head_dim, s) is not None)


def share_regions(layout, padded_head_dim: int, shares: int):
    """``((R, C), ((r0, c0), ...))``: the ``R x C`` rectangle of the dQ tile that each of ``shares`` CTAs converts in a
    Hopper (wgmma) order, CTA ``s`` standing for the producer's threads ``s * n .. (s + 1) * n - 1`` (``n =
    num_threads / shares``, whole warps); None for other orders or shares, or where those threads' elements do not
    form such a rectangle, or where a rectangle cannot be stored as whole 16-byte vectors by ``n`` threads
    (:func:`region_store_tiling`). Thread ``t`` of warpgroup ``w`` holds the tile's floats ``w * chunk + 512 k + 4 t
    + e`` (``chunk = tile_m * Dr / warpgroups``)."""
    import numpy as np

    groups, threads = layout.num_threads // 128, layout.num_threads // max(shares, 1)
    if layout.arch != 90 or shares < 2 or layout.num_threads % (32 * shares):
        return None
    where = layout.tile_index_map(padded_head_dim)
    chunk = layout.tile_m * padded_head_dim // groups
    owner = (where // chunk * 128 + where % chunk % 512 // 4) // threads
    corners, shape = [], None
    for w in range(shares):
        mine = owner == w
        rows, cols = np.flatnonzero(mine.any(axis=1)), np.flatnonzero(mine.any(axis=0))
        (r0, c0), size = (int(rows[0]), int(cols[0])), (len(rows), len(cols))
        if mine.sum() != size[0] * size[1] or not mine[r0:r0 + size[0], c0:c0 + size[1]].all() or \
                (shape or size) != size or r0 % size[0] or c0 % size[1]:
            return None
        corners.append((r0, c0))
        shape = size
    if region_store_tiling(*shape, threads) is None:
        return None
    return shape, tuple(corners)
