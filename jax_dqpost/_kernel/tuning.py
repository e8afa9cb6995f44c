"""Which :class:`~jax_dqpost._kernel.spec.Tuning` a call's kernel takes: :func:`choose`, from the call's shapes.

A kernel of dQ, dK and dV, or with a sink, runs with the defaults (whole tiles, short-tile CTAs of
``varlen.SHORT_HEADS`` heads). A kernel of one tensor without a sink (its own grid) splits each tile between the
finest of its order's shares when the call is small (:data:`FINE_SHARES_BYTES`: more CTAs fill the GPU's SMs), and
converts varlen short tiles one head a CTA when a pack of few sequences would leave few short-tile CTAs
(:data:`SHORT_CTAS`); docs/performance.md measures the split ("Small calls' work units"). The tuning is in the
kernel's cache key: a value chosen here, or one a benchmark passes, compiles its own kernel. No cutlass here.
"""

from __future__ import annotations

from . import varlen
from .abi import Tiling
from ..layout.limits import OUT_BYTES
from .spec import KernelSpec, TensorKernel, Tuning, tile_shares

FINE_SHARES_BYTES = 20 << 20
"""A kernel of one tensor whose unsplit CTAs times a tile's bytes (``tile_m * Dr`` floats read, as many values
written) come to fewer than this splits each tile between CTAs (:func:`shares_for`)."""
SHORT_CTAS = 128
"""Short-tile CTAs (at ``varlen.SHORT_HEADS`` heads each) below which a kernel of one tensor takes one head a CTA
(:func:`short_heads`)."""


def choose(layout, padded_head_dim: int, *, single_part: bool, unsplit_ctas: int, num_spans: int = 0,
           heads: int = 0) -> Tuning:
    """The tuning of a kernel: the defaults unless ``single_part`` (one tensor, no sink); then the shares of
    :func:`shares_for` for a launch of ``unsplit_ctas`` CTAs unsplit (every batch's; a varlen short-tile CTA counted
    at ``varlen.SHORT_HEADS`` heads, whatever the kernel's), and for a varlen order with short tiles (``num_spans``
    spans, ``heads`` heads) the short-tile heads of :func:`short_heads`."""
    if not single_part:
        return Tuning()
    heads_a_cta = short_heads(num_spans, heads) if num_spans and varlen.short_rows(layout) else varlen.SHORT_HEADS
    return Tuning(shares_for(layout, padded_head_dim, unsplit_ctas), heads_a_cta)


def shares_for(layout, padded_head_dim: int, unsplit_ctas: int) -> int:
    """``Tuning.shares`` of a kernel of one tensor without a sink that launches ``unsplit_ctas`` CTAs unsplit: the
    finest of ``spec.tile_shares`` below :data:`FINE_SHARES_BYTES`, else 1."""
    fine = tile_shares(layout, padded_head_dim)
    small = unsplit_ctas * layout.tile_m * padded_head_dim * (4 + OUT_BYTES) < FINE_SHARES_BYTES
    return fine[-1] if fine and small else 1


def call_shares(layout, padded_head_dim: int) -> tuple[int, ...]:
    """Every ``Tuning.shares`` a call of this order may take (:func:`shares_for`), increasing."""
    return (1,) + tile_shares(layout, padded_head_dim)[-1:]


def short_heads(num_spans: int, heads: int) -> int:
    """``Tuning.short_heads`` of a varlen kernel of one tensor: ``varlen.SHORT_HEADS``, or 1 where that would make
    fewer than :data:`SHORT_CTAS` CTAs (a pack of a few sequences, whose few short-tile CTAs, converting their heads
    in rounds, would be the call's tail). One head: ``varlen.SHORT_HEADS`` (the same grid)."""
    return varlen.SHORT_HEADS if heads <= 1 or num_spans * -(-heads // varlen.SHORT_HEADS) >= SHORT_CTAS else 1


# ---- every kernel a call may choose (python -m jax_dqpost.precompile compiles them ahead of time)

def single_part_kernels(configs, tilings, dtypes) -> list[KernelSpec]:
    """Every single-part kernel (one part, no sink) a call may choose (``Plan.kernel``) for each ``(layout, Dr)`` of
    ``configs``, each tiling and each dtype name: its tiles whole or split (a small call's), its varlen short tiles
    by CTAs of ``SHORT_HEADS`` heads or 1."""
    parts = [(TensorKernel(layout, dr, t), Tuning(shares, heads)) for layout, dr in configs for t in tilings
             for shares in call_shares(layout, dr)
             for heads in sorted({varlen.SHORT_HEADS,
                                  1 if t == Tiling.VARLEN and varlen.short_rows(layout) else varlen.SHORT_HEADS})]
    return [KernelSpec(dtype, (tensor,), tuning=tuning) for tensor, tuning in parts for dtype in dtypes]


def fused_kernels(pairs, tilings, dtypes, sinks) -> list[KernelSpec]:
    """The kernels of dQ, dK and dV in one launch for each ``((dQ layout, Dr), (dK/dV layout, Dr))`` of ``pairs``,
    the same tiling on both sides, each dtype name and each of ``sinks`` (None, or the sink's and dsink's dtype
    names)."""
    parts = [((q, q_dr, t), (kv, kv_dr, t), (kv, kv_dr, t)) for (q, q_dr), (kv, kv_dr) in pairs for t in tilings]
    return [KernelSpec(dtype, tuple(TensorKernel(*p) for p in three), sink)
            for three in parts for dtype in dtypes for sink in sinks]
