"""One value describing a postprocess call: :class:`Plan` (one tensor), :class:`FusedPlan` (dQ, dK, dV and the
sink gradient in one launch, built of plans).

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

``Sr = ceil(S / P) * P``; ``Dr``, the padded head dim (``AccumLayout.padded_head_dim``);
``Tp = round_up(T + B * P, P)`` (``varlen.padded_total``), with ``P = tile_m * cluster_size``
(``AccumLayout.pad_rows``; ``P = tile_m`` but for Blackwell's 2-CTA dK/dV).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from .layout import AccumLayout
from .varlen import INT32_MAX, WorkList

OUT_DTYPES = {np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.float16): "f16"}
"""The output types, with the names the FFI attribute and the kernel cache use for them."""

MAX_GRID_Z = 65535  # CUDA's limit on gridDim.z: the batch of the dense tilings


class ArgNames(NamedTuple):
    """What the API calls one tensor's arguments: errors name the argument the caller passed."""

    accum: str
    seqlen: str
    total: str
    cu_seqlens: str
    seqused: str
    head_dim: str


ARG_NAMES = {
    "dq": ArgNames("dq_accum", "seqlen_q", "total_q", "cu_seqlens_q", "seqused_q", "head_dim"),
    "dk": ArgNames("dk_accum", "seqlen_k", "total_k", "cu_seqlens_k", "seqused_k", "head_dim"),
    "dv": ArgNames("dv_accum", "seqlen_k", "total_k", "cu_seqlens_k", "seqused_k", "head_dim_v"),
}
"""The names of each tensor's arguments (``dq_postprocess`` and ``dq_accum_from_dq`` use dQ's)."""


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

    def result_shape(self, acc_shape, aux_shape, names: ArgNames = ARG_NAMES["dq"]) -> tuple[int, ...]:
        """The shape of the result for operands of these shapes; ``ValueError`` naming what does not fit, in the
        words of ``names`` (the tensor's arguments)."""
        dr, layout, n = self.padded_head_dim, self.layout, names
        if self.work is not None:
            w = self.work
            if tuple(aux_shape) != self.aux_shape(1):
                raise ValueError(f"the work list has {aux_shape} entries, expected ({w.size},) for {w}")
            if len(acc_shape) != 2 or acc_shape[1] != w.padded_total * dr:
                raise ValueError(
                    f"{n.accum} must have shape (heads, Tp*Dr) = (heads, {w.padded_total}*{dr}) for "
                    f"{n.total}={w.total_q}, batch={w.batch}, {n.head_dim}={self.head_dim} and {layout} "
                    f"(Tp = ceil(({n.total} + batch*P) / P) * P, P = tile_m*cluster_size = {layout.pad_rows}); "
                    f"got shape {tuple(acc_shape)}")
            return (w.total_q, acc_shape[0], self.head_dim)
        if len(acc_shape) != 3:
            raise ValueError(f"{n.accum} must have shape (batch, heads, Sr*Dr), got shape {tuple(acc_shape)}")
        batch, heads, flat = acc_shape
        sr = layout.padded_seqlen(self.seqlen_q)
        if flat != sr * dr:
            raise ValueError(
                f"{n.accum}.shape[2] must be Sr*Dr = {sr}*{dr} = {sr * dr} for {n.seqlen}={self.seqlen_q}, "
                f"{n.head_dim}={self.head_dim} and {layout}; got shape {tuple(acc_shape)}")
        if tuple(aux_shape) != self.aux_shape(batch):
            raise ValueError(f"{n.seqused} must have shape {self.aux_shape(batch)} ({n.accum} has batch {batch}), "
                             f"got {tuple(aux_shape)}")
        return (batch, self.seqlen_q, heads, self.head_dim)

    # ---- the CUDA kernel -------------------------------------------------------------------------
    def launch_extents(self, acc_shape) -> tuple[int, int, int, int, int]:
        """The kernel's int32 extents, in the order of its C ABI (``kernel.py``, ``DqPostprocess.__call__``):
        ``(batch, heads, S, D, ceil(S / tile_m))`` for dense tilings, ``(K, heads, T, D, num_tiles)`` for varlen
        (``K = batch + 2`` spans). The launch grid is ``(heads * extents[4], 1, batch)`` (varlen: ``(ctas, 1, 1)``,
        :meth:`ctas`). ``ValueError`` if CUDA cannot launch it (``gridDim.x < 2^31``, ``gridDim.z <= 65535``)."""
        if self.work is not None:
            heads, batch, rows = acc_shape[0], 1, self.work.total_q
            extents = (self.work.num_spans, heads, rows, self.head_dim, self.work.num_tiles)
        else:
            batch, heads, rows = acc_shape[0], acc_shape[1], self.seqlen_q
            extents = (batch, heads, rows, self.head_dim, self.layout.num_tiles(rows))
        if batch > MAX_GRID_Z:
            raise ValueError(f"dq_postprocess on CUDA: batch (with any vmapped axes folded in) must be <= "
                             f"{MAX_GRID_Z}, got {batch}")
        if heads * extents[4] > INT32_MAX or rows > INT32_MAX:
            raise ValueError(f"dq_postprocess on CUDA: heads * ceil(rows / tile_m) must be < 2^31, got heads={heads}, "
                             f"{extents[4]} tiles per head ({rows} rows)")
        return extents

    def ctas(self, acc_shape) -> int:
        """CTAs of the kernel's launch for an accumulator of this shape (varlen: ``WorkList.ctas``)."""
        dim0, heads, _, _, grid_x = self.launch_extents(acc_shape)
        return self.work.ctas(heads) if self.work is not None else dim0 * heads * grid_x

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


# ---- the whole postprocess: dQ, dK and dV in one launch, and the learnable-sink gradient --------------
SINK_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
"""Types of ``learnable_sink`` (and of ``dsink``)."""

PARTS = ("dq", "dk", "dv")
NUM_EXTENTS = 5 * len(PARTS)  # the fused kernel's int32 extents: Plan.launch_extents of each part


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    """The static description of a whole postprocess call (``flash_attention_postprocess``; also
    ``dq_postprocess`` with a sink or a clustered layout): a :class:`Plan` per tensor, and the sink gradient.

    The operands of the fused primitive, in order (``[...]``: only when present)::

        dq_accum, q_aux, [dk_accum, dv_accum, k_aux], scales (3,) f32, [learnable_sink, lse, dpsum]

    ``q_aux``/``k_aux``: the int32 operand of the q-side / k-side plans (``Plan.aux_shape``); dK and dV share
    the k side's. ``scales``: dQ's, dK's and dV's. The sink operands, for ``H`` query heads::

        dense (dq):   learnable_sink (H,)   lse (B, H, S)   dpsum (B, H, Sr)
        varlen (dq):  learnable_sink (H,)   lse (H, T)      dpsum (H, Tp)

    The results: ``dq, [dk, dv], [dsink (H,)]``. ``dsink[h] = sum over sequences b and rows r < len_b of
    -p * dpsum[b, h, r]``, ``p = exp(sink[h] - lse[b, h, r])`` (1 where ``lse = -inf``); varlen rows at ``lse[h,
    cu[b] + r]`` and ``dpsum[h, acc_row[b] + r]`` (the padded offset), ``len_b`` honouring ``seqused_q``.

    Attributes:
      dq, dk, dv: the tensors' plans (``dk``/``dv``: both or neither; their dtype is dq's).
      sink_dtype: ``learnable_sink``'s dtype, or None without a sink.
      dsink_dtype: the type the kernel writes ``dsink`` in: ``sink_dtype``, or float32 for the partial sums
        of a batch shard (reduced across shards, then rounded).
    """

    dq: Plan
    dk: Plan | None = None
    dv: Plan | None = None
    sink_dtype: np.dtype | None = None
    dsink_dtype: np.dtype | None = None

    @property
    def parts(self) -> tuple[Plan, ...]:
        return (self.dq,) if self.dk is None else (self.dq, self.dk, self.dv)

    @property
    def has_kv(self) -> bool:
        return self.dk is not None

    @property
    def has_sink(self) -> bool:
        return self.sink_dtype is not None

    @property
    def num_operands(self) -> int:
        return 3 + (3 if self.has_kv else 0) + (3 if self.has_sink else 0)

    def without_sink(self) -> "FusedPlan":
        return dataclasses.replace(self, sink_dtype=None, dsink_dtype=None)

    # ---- operands and results ----------------------------------------------------------------------
    def split(self, args) -> dict:
        """The operands by name (see the class docstring): ``acc`` (a tuple per part), ``aux`` (a tuple per
        part), ``scales``, and ``sink``/``lse``/``dpsum`` (None without a sink)."""
        args = list(args)
        if self.has_kv:
            dq_acc, q_aux, dk_acc, dv_acc, k_aux, scales, *sink = args
            acc, aux = (dq_acc, dk_acc, dv_acc), (q_aux, k_aux, k_aux)
        else:
            dq_acc, q_aux, scales, *sink = args
            acc, aux = (dq_acc,), (q_aux,)
        sink, lse, dpsum = sink if self.has_sink else (None, None, None)
        return dict(acc=acc, aux=aux, scales=scales, sink=sink, lse=lse, dpsum=dpsum)

    def join(self, acc, aux, scales, sink=None, lse=None, dpsum=None) -> list:
        """The inverse of :meth:`split` (``aux``: the q-side operand, then the k-side one)."""
        args = [acc[0], aux[0]] + ([acc[1], acc[2], aux[1]] if self.has_kv else []) + [scales]
        return args + ([sink, lse, dpsum] if self.has_sink else [])

    def sink_shapes(self, dq_acc_shape) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Shapes of ``(learnable_sink, lse, dpsum)`` for a dQ accumulator of this shape."""
        q = self.dq
        if q.work is not None:
            heads = dq_acc_shape[0]
            return (heads,), (heads, q.work.total_q), (heads, q.work.padded_total)
        batch, heads = dq_acc_shape[0], dq_acc_shape[1]
        return (heads,), (batch, heads, q.seqlen_q), (batch, heads, q.layout.padded_seqlen(q.seqlen_q))

    def result_shapes(self, shapes) -> list[tuple[tuple[int, ...], np.dtype]]:
        """``(shape, dtype)`` of each result for operands of these shapes; ``ValueError`` naming what does not
        fit."""
        ops = self.split(shapes)
        out = [(p.result_shape(a, x, ARG_NAMES[name]), p.dtype)
               for name, p, a, x in zip(PARTS, self.parts, ops["acc"], ops["aux"])]
        if self.has_kv:
            (_, _, q_heads, _), (k_shape, _) = _batch_heads(self.dq, out[0][0]), out[1]
            _, _, kv_heads, _ = _batch_heads(self.dk, k_shape)
            if out[2][0][:-1] != k_shape[:-1]:
                raise ValueError(f"dk_accum and dv_accum disagree on batch, rows or heads: dk {k_shape}, dv "
                                 f"{out[2][0]}")
            if kv_heads == 0 or q_heads % kv_heads:
                raise ValueError(f"the key/value heads ({kv_heads}) must divide the query heads ({q_heads})")
        if self.has_sink:
            want = self.sink_shapes(ops["acc"][0])
            for name, got, w in zip(("learnable_sink", "lse", "dpsum"), (ops["sink"], ops["lse"], ops["dpsum"]),
                                    want):
                if tuple(got) != w:
                    raise ValueError(f"{name} must have shape {w} for dq_accum of shape {tuple(ops['acc'][0])}, "
                                     f"got {tuple(got)}")
            out.append(((want[0][0],), np.dtype(self.dsink_dtype)))
        return out

    def check_batch(self, acc_shapes) -> None:
        """``ValueError`` naming both sides unless the q and k sides hold the same number of sequences: a dense
        side's accumulator batch, a varlen side's ``len(cu_seqlens) - 1``. For the API's operands only, not in
        :meth:`result_shapes`: vmap and sharding fold and split a dense batch, never a varlen side's sequences."""
        if not self.has_kv:
            return
        sides = []
        for part, plan, shape in zip(PARTS, self.parts, acc_shapes):
            names = ARG_NAMES[part]
            if plan.work is not None:
                sides.append((plan.work.batch, f"{names.cu_seqlens} has {plan.work.batch} sequences"))
            elif len(shape) == 3:
                sides.append((shape[0], f"{names.accum} has batch {shape[0]}"))
            else:
                return  # not an accumulator: result_shapes says so
        (q_batch, q_what), (k_batch, k_what) = sides
        if q_batch != k_batch:
            raise ValueError(f"the q and k sides must have the same batch: {q_what} but {k_what}")

    # ---- the CUDA kernel -------------------------------------------------------------------------
    @property
    def kernel_key(self) -> tuple:
        """What changes the compiled binary (with the target GPU)."""
        parts = tuple((p.layout, p.padded_head_dim, p.tiling) for p in self.parts)
        sink = None if not self.has_sink else (_SINK_NAMES[np.dtype(self.sink_dtype)],
                                               _SINK_NAMES[np.dtype(self.dsink_dtype)])
        return OUT_DTYPES[np.dtype(self.dq.dtype)], parts, sink

    def launch(self, acc_shapes) -> tuple[tuple[int, ...], int]:
        """``(extents, ctas)``: the fused kernel's :data:`NUM_EXTENTS` int32 extents (each part's
        ``Plan.launch_extents``, zeros for absent parts) and its one-dimensional grid: ``H`` sink CTAs (with a
        sink), then every part's tiles. ``ValueError`` if CUDA cannot launch that many (``2^31 - 1``)."""
        extents, ctas = [], self.dq_heads(acc_shapes[0]) if self.has_sink else 0
        for p, shape in zip(self.parts, acc_shapes):
            extents += p.launch_extents(shape)
            ctas += p.ctas(shape)
        if ctas > INT32_MAX:
            raise ValueError(f"flash_attention_postprocess on CUDA: {ctas} CTAs, more than CUDA launches (2^31 - 1)")
        return tuple(extents) + (0,) * (NUM_EXTENTS - len(extents)), ctas

    def dq_heads(self, dq_acc_shape) -> int:
        return dq_acc_shape[0] if self.dq.work is not None else dq_acc_shape[1]


_SINK_NAMES = {np.dtype(np.float32): "f32", np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.float16): "f16"}


def _batch_heads(plan: Plan, out_shape):
    """``(batch or None, rows, heads, head_dim)`` of a result shape."""
    if plan.work is not None:
        return (None,) + tuple(out_shape)
    return tuple(out_shape)
