"""Compiling ahead of time: every kernel a call of given orders may choose, compiled into the on-disk cache where it
is missing (``python -m jax_dqpost.precompile`` picks the orders, FlashAttention's presets, and reports)."""

from __future__ import annotations

from . import cache
from .abi import Tiling
from .spec import KernelSpec, TensorKernel, Tuning
from .tuning import call_shares
from .varlen import SHORT_HEADS, short_rows


def single_part_kernels(configs, tilings, dtypes) -> list[KernelSpec]:
    """Every single-part kernel (one part, no sink) a call may choose (``Plan.kernel``) for each ``(layout, Dr)`` of
    ``configs``, each tiling and each dtype name: its tiles whole or split (a small call's), its varlen short tiles
    by CTAs of ``SHORT_HEADS`` heads or 1."""
    parts = [(TensorKernel(layout, dr, t), Tuning(shares, heads)) for layout, dr in configs for t in tilings
             for shares in call_shares(layout, dr)
             for heads in sorted({SHORT_HEADS, 1 if t == Tiling.VARLEN and short_rows(layout) else SHORT_HEADS})]
    return [KernelSpec(dtype, (tensor,), tuning=tuning) for tensor, tuning in parts for dtype in dtypes]


def fused_kernels(pairs, tilings, dtypes, sinks) -> list[KernelSpec]:
    """The kernels of dQ, dK and dV in one launch for each ``((dQ layout, Dr), (dK/dV layout, Dr))`` of ``pairs``,
    the same tiling on both sides, each dtype name and each of ``sinks`` (None, or the sink's and dsink's dtype
    names)."""
    parts = [((q, q_dr, t), (kv, kv_dr, t), (kv, kv_dr, t)) for (q, q_dr), (kv, kv_dr) in pairs for t in tilings]
    return [KernelSpec(dtype, tuple(TensorKernel(*p) for p in three), sink)
            for three in parts for dtype in dtypes for sink in sinks]


def compile_missing(keys, arch: str) -> int:
    """Compile each kernel of ``keys`` that the disk cache does not hold for ``arch`` and keep it there; how many were
    compiled. Raises what a compile raises (``ModuleNotFoundError`` without the CuTe DSL,
    ``cute_runtime.NoRuntime`` without a build of it for this driver)."""
    compiled = 0
    for key in keys:
        if cache.on_disk(key, arch=arch):
            continue
        cache.get_kernel(key, arch=arch, persist=True)
        compiled += 1
    return compiled
