"""One value describing a postprocess call: :class:`Plan`.

The API builds a plan from the arguments (``api.py``); it is the primitive's only parameter, and every rule
asks it: the operand and result shapes (abstract evaluation), the reference (``reference.py``), the kernel's
compile key, launch grid and extents and the FFI attributes (CUDA lowering), the sharding rule and the vmap
folding (``primitive.py``). Batch and heads are not part of it: they come from the operands' shapes, so vmap
and sharding change them without a new plan.

Three tilings, one per way a CTA finds its tile (compiled into the kernel; their values are the FFI's
``mode`` attribute)::

    tiling          dq_accum           aux (int32)            result
    DENSE           (B, H, Sr * Dr)    (0,)                   (B, S, H, D)
    DENSE_SEQUSED   (B, H, Sr * Dr)    seqused_q (B,)         (B, S, H, D)
    VARLEN          (H, Tp * Dr)       the work list          (T, H, D)

``Sr = ceil(S / tile_m) * tile_m``; ``Dr``, the padded head dim (``AccumLayout.padded_head_dim``);
``Tp = round_up(T + B * tile_m, tile_m)`` (``varlen.padded_total``).
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
import numpy as np

from .layout import AccumLayout
from .varlen import INT32_MAX, WorkList

OUT_DTYPES = {np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.float16): "f16"}
"""The output types, with the names the FFI attribute and the kernel cache use for them."""

MAX_GRID_Z = 65535  # CUDA's limit on gridDim.z: the batch of the dense tilings


class Tiling(enum.IntEnum):
    """How a CTA of the kernel finds its tile. The values are the FFI's ``mode`` attribute (ABI)."""

    DENSE = 0  # tile (b, h, m) of a dense accumulator
    DENSE_SEQUSED = 1  # the same; rows past seqused_q[b] are zeros
    VARLEN = 2  # tile m of head h looks its span up in the work list


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static description of one call (frozen, hashable: a primitive parameter).

    Attributes:
      layout: the producer's :class:`AccumLayout`.
      head_dim: ``D``.
      dtype: numpy dtype of dQ (bf16 or fp16 for the op; the transpose carries the cotangent's).
      seqlen_q: ``S`` of a dense batch; None for varlen.
      seqused_q: dense with ``seqused_q``: the aux operand holds the lengths.
      work: the varlen work list's static shape (``varlen.WorkList``); None for dense batches.
    """

    layout: AccumLayout
    head_dim: int
    dtype: np.dtype
    seqlen_q: int | None = None
    seqused_q: bool = False
    work: WorkList | None = None

    @property
    def tiling(self) -> Tiling:
        if self.work is not None:
            return Tiling.VARLEN
        return Tiling.DENSE_SEQUSED if self.seqused_q else Tiling.DENSE

    @property
    def padded_head_dim(self) -> int:
        return self.layout.padded_head_dim(self.head_dim)

    @property
    def kernel_key(self) -> tuple:
        """What changes the compiled binary (with the target GPU): nothing else is compiled in."""
        return OUT_DTYPES[np.dtype(self.dtype)], self.layout, self.padded_head_dim, self.tiling

    # ---- shapes ----------------------------------------------------------------------------------
    def aux_shape(self, batch: int) -> tuple[int]:
        if self.work is not None:
            return (self.work.size,)
        return (batch,) if self.seqused_q else (0,)

    def result_shape(self, acc_shape, aux_shape) -> tuple[int, ...]:
        """The shape of dQ for operands of these shapes; ``ValueError`` naming what does not fit."""
        dr, layout = self.padded_head_dim, self.layout
        if self.work is not None:
            w = self.work
            if tuple(aux_shape) != self.aux_shape(1):
                raise ValueError(f"the work list has {aux_shape} entries, expected ({w.size},) for {w}")
            if len(acc_shape) != 2 or acc_shape[1] != w.padded_total * dr:
                raise ValueError(
                    f"dq_accum must have shape (heads, Tp*Dr) = (heads, {w.padded_total}*{dr}) for "
                    f"total_q={w.total_q}, batch={w.batch}, head_dim={self.head_dim} and {layout} "
                    f"(Tp = ceil((total_q + batch*tile_m) / tile_m) * tile_m); got shape {tuple(acc_shape)}")
            return (w.total_q, acc_shape[0], self.head_dim)
        if len(acc_shape) != 3:
            raise ValueError(f"dq_accum must have shape (batch, heads, Sr*Dr), got shape {tuple(acc_shape)}")
        batch, heads, flat = acc_shape
        sr = layout.padded_seqlen(self.seqlen_q)
        if flat != sr * dr:
            raise ValueError(
                f"dq_accum.shape[2] must be Sr*Dr = {sr}*{dr} = {sr * dr} for seqlen_q={self.seqlen_q}, "
                f"head_dim={self.head_dim} and {layout}; got shape {tuple(acc_shape)}")
        if tuple(aux_shape) != self.aux_shape(batch):
            raise ValueError(f"seqused_q must have shape {self.aux_shape(batch)}, got {tuple(aux_shape)}")
        return (batch, self.seqlen_q, heads, self.head_dim)

    # ---- the CUDA kernel -------------------------------------------------------------------------
    def launch_extents(self, acc_shape) -> tuple[int, int, int, int, int]:
        """The kernel's int32 extents, in the order of its C ABI (``kernel.py``, ``DqPostprocess.__call__``):
        ``(batch, heads, S, D, ceil(S / tile_m))`` for dense tilings, ``(K, heads, T, D, num_tiles)`` for varlen
        (``K = batch + 2`` spans). The launch grid is ``(heads * extents[4], 1, batch)`` (varlen: batch 1).
        ``ValueError`` if CUDA cannot launch it (``gridDim.x < 2^31``, ``gridDim.z <= 65535``)."""
        if self.work is not None:
            heads, batch, rows = acc_shape[0], 1, self.work.total_q
            extents = (self.work.num_spans, heads, rows, self.head_dim, self.work.num_tiles)
        else:
            batch, heads, rows = acc_shape[0], acc_shape[1], self.seqlen_q
            extents = (batch, heads, rows, self.head_dim, self.layout.padded_seqlen(rows) // self.layout.tile_m)
        if batch > MAX_GRID_Z:
            raise ValueError(f"dq_postprocess on CUDA: batch (with any vmapped axes folded in) must be <= "
                             f"{MAX_GRID_Z}, got {batch}")
        if heads * extents[4] > INT32_MAX or rows > INT32_MAX:
            raise ValueError(f"dq_postprocess on CUDA: heads * ceil(rows / tile_m) must be < 2^31, got heads={heads}, "
                             f"{extents[4]} tiles per head ({rows} rows)")
        return extents

    def ffi_attributes(self) -> dict:
        """The custom call's attributes besides the module (``ffi/dqpost_ffi.cc``, ``Execute``)."""
        return dict(dtype=OUT_DTYPES[np.dtype(self.dtype)], mode=np.int64(self.tiling),
                    tile_m=np.int64(self.layout.tile_m), tile_hdim=np.int64(self.padded_head_dim),
                    num_tiles=np.int64(0 if self.work is None else self.work.num_tiles))

    # ---- sharding: batch and heads shard with no collective; every other axis is gathered ----------
    def sharding_rule(self) -> tuple[str, tuple[str, ...]]:
        """Shardy's einsum-like rule over (dq_accum, scale, aux) -> dq, and the factors needing replication."""
        if self.work is not None:
            return "h l, , k -> t h d", ("l", "k", "t", "d")
        if self.seqused_q:
            return "b h l, , b -> b s h d", ("l", "s", "d")
        return "b h l, , z -> b s h d", ("l", "z", "s", "d")

    def shard_specs(self, acc_spec: tuple):
        """``(dq_accum, aux, dq)`` partition specs (tuples) when dq_accum's axes are sharded as ``acc_spec``."""
        if self.work is not None:  # (H, Tp*Dr) -> (T, H, D): heads only
            heads = acc_spec[0]
            return (heads, None), (None,), (None, heads, None)
        batch, heads = acc_spec[0], acc_spec[1]  # (B, H, Sr*Dr) -> (B, S, H, D)
        return (batch, heads, None), ((batch,) if self.seqused_q else (None,)), (batch, None, heads, None)
