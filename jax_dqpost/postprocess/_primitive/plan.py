"""One value describing a postprocess call: :class:`Plan`, made of a :class:`Part` per tensor (dQ, or dQ, dK and
dV) and the learnable sink's dtype.

The API builds the plan from the arguments (``jax_dqpost/api.py``); it is the primitive's only parameter, and every
rule asks it: the operand and result shapes (abstract evaluation), the reference (``reference.py``), the kernel it
compiles (``Plan.kernel``), its launch grid and extents (``cuda_lowering.py``), the sharding rule and the vmap folding
(``rules.py``). Batch and heads are not part of it: they come from the operands' shapes, so vmap and sharding change
them without a new plan. The operands and results are in the order of the calling convention (``_kernel/abi.py``).

A part's accumulator comes in one of three tilings, one per way a CTA finds its tile (compiled into the kernel)::

    tiling          accumulator        aux (int32)            result
    DENSE           (B, H, Sr * Da)    (0,)                   (B, S, H, D)
    DENSE_SEQUSED   (B, H, Sr * Da)    seqused (B,)           (B, S, H, D)
    VARLEN          (H, Tp * Da)       the work list          (T, H, D)

``Sr = ceil(S / P) * P``; ``Dr``, the tiles' padded head dim (``AccumLayout.padded_head_dim``), ``Da >= Dr`` the
allocation's (``AccumLayout.alloc_head_dim``; tiles fill the first ``Sr * Dr`` floats of each row);
``Tp = round_up(T + B * P, P)`` (``layout.padded_total``), with ``P = tile_m * cluster_size``
(``AccumLayout.pad_rows``; ``P = tile_m`` but for Blackwell's 2-CTA dK/dV). ``S``, ``T``, ``seqused`` are the
part's side's: the query side for dQ, the key side for dK and dV.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from ..._kernel import abi, spec, varlen
from ..._kernel.abi import Tiling
from ..._kernel.spec import KernelSpec, TensorKernel, Tuning
from ..._kernel.tuning import choose as choose_tuning
from ...layout import AccumLayout
from ..._kernel.varlen import INT32_MAX, WorkList

MAX_GRID_Z = 65535  # CUDA's limit on gridDim.z: the batch of dense parts


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


@dataclasses.dataclass(frozen=True)
class Part:
    """The static description of one tensor of a call (frozen, hashable).

    Attributes:
      layout: the producer's :class:`AccumLayout`.
      head_dim: ``D``.
      dtype: numpy dtype of the result (bf16 or fp16 for the op; the transpose carries the cotangent's).
      seqlen: ``S`` of a dense side; None for varlen.
      seqused: dense with ``seqused``: the aux operand holds the lengths.
      work: the varlen work list's static shape (``varlen.WorkList``); None for dense sides.
    """

    layout: AccumLayout
    head_dim: int
    dtype: np.dtype
    seqlen: int | None = None
    seqused: bool = False
    work: WorkList | None = None

    @property
    def tiling(self) -> Tiling:
        if self.work is not None:
            return Tiling.VARLEN
        return Tiling.DENSE_SEQUSED if self.seqused else Tiling.DENSE

    @property
    def padded_head_dim(self) -> int:
        return self.layout.padded_head_dim(self.head_dim)

    @property
    def alloc_head_dim(self) -> int:
        """``Da``: the head dim as the accumulator's allocation pads it (``AccumLayout.alloc_head_dim``)."""
        return self.layout.alloc_head_dim(self.padded_head_dim)

    def kernel(self) -> TensorKernel:
        """What of this part changes the compiled binary."""
        return TensorKernel(self.layout, self.padded_head_dim, self.tiling)

    def tuning(self, acc_shape, single_part: bool) -> Tuning:
        """The kernel's tuning (``tuning.choose``) where this part is its first, on an accumulator of ``acc_shape``;
        ``single_part``: the kernel's grid is this part's own."""
        ctas = self.ctas(acc_shape) * (1 if self.work is not None else acc_shape[0]) if single_part else 0  # unsplit
        spans = self.work.num_spans if self.work is not None else 0
        return choose_tuning(self.layout, self.padded_head_dim, single_part=single_part, unsplit_ctas=ctas,
                             num_spans=spans, heads=self.heads(acc_shape))

    # ---- shapes ----------------------------------------------------------------------------------
    def aux_shape(self, batch: int) -> tuple[int]:
        if self.work is not None:
            return (self.work.size,)
        return (batch,) if self.seqused else (0,)

    def result_shape(self, acc_shape, aux_shape, names: ArgNames = ARG_NAMES["dq"]) -> tuple[int, ...]:
        """The shape of the result for operands of these shapes; ``ValueError`` naming what does not fit, in the
        words of ``names`` (the tensor's arguments)."""
        da, layout, n = self.alloc_head_dim, self.layout, names
        dr = "Da" if da != self.padded_head_dim else "Dr"  # the allocation's padded head dim, as AccumLayout names it
        if self.work is not None:
            w = self.work
            if tuple(aux_shape) != self.aux_shape(1):
                raise ValueError(f"the work list has {aux_shape} entries, expected ({w.size},) for {w}")
            if len(acc_shape) != 2 or acc_shape[1] != w.padded_total * da:
                fits = self._packed_batch(acc_shape)
                raise ValueError(
                    f"{n.accum} of shape {tuple(acc_shape)} is not the packed accumulator of {n.total}={w.total} and "
                    f"{n.cu_seqlens} of {_entries(w.batch + 1)} (batch={w.batch}): that is (heads, Tp*{dr}) = "
                    f"(heads, {w.padded_total}*{da}) for {n.head_dim}={self.head_dim} and {layout} (Tp = "
                    f"ceil(({n.total} + batch*P) / P) * P, P = tile_m*cluster_size = {layout.pad_rows})"
                    + ("" if fits is None else f"; the shape given is for {n.cu_seqlens} of {_entries(fits + 1)} "
                                               f"(batch={fits}) at {n.total}={w.total}"))
            return (w.total, acc_shape[0], self.head_dim)
        if len(acc_shape) != 3:
            raise ValueError(f"{n.accum} must have shape (batch, heads, Sr*{dr}), got shape {tuple(acc_shape)}")
        batch, heads, flat = acc_shape
        sr = layout.padded_seqlen(self.seqlen)
        if flat != sr * da:
            raise ValueError(
                f"{n.accum}.shape[2] must be Sr*{dr} = {sr}*{da} = {sr * da} for {n.seqlen}={self.seqlen}, "
                f"{n.head_dim}={self.head_dim} and {layout}; got shape {tuple(acc_shape)}")
        if tuple(aux_shape) != self.aux_shape(batch):
            raise ValueError(f"{n.seqused} must have shape {self.aux_shape(batch)} ({n.accum} has batch {batch}), "
                             f"got {tuple(aux_shape)}")
        return (batch, self.seqlen, heads, self.head_dim)

    def _packed_batch(self, acc_shape) -> int | None:
        """The batch whose packed accumulator of this part's total has shape ``acc_shape``, if there is one:
        ``Tp = (ceil(T / P) + batch) * P`` (``layout.padded_total``) gives it."""
        pad, da = self.layout.pad_rows, self.alloc_head_dim
        if len(acc_shape) != 2 or acc_shape[1] % (pad * da):
            return None
        batch = acc_shape[1] // (pad * da) - -(-self.work.total // pad)
        return batch if batch >= 0 else None

    def heads(self, acc_shape) -> int:
        return acc_shape[0] if self.work is not None else acc_shape[1]

    # ---- the CUDA kernel -------------------------------------------------------------------------
    def launch_extents(self, acc_shape) -> tuple[int, int, int, int, int]:
        """The part's int32 extents (``abi.EXTENTS``): ``(batch, heads, S, D, ceil(S / tile_m))`` for dense
        tilings, ``(K, heads, T, D, num_tiles)`` for varlen (``K = batch + 2`` spans). ``ValueError`` if CUDA
        cannot launch it (``gridDim.x < 2^31``, ``gridDim.z <= 65535``): the API asks at trace time, on every
        platform, so that what runs on one runs on all."""
        if self.work is not None:
            heads, batch, rows = acc_shape[0], 1, self.work.total
            extents = (self.work.num_spans, heads, rows, self.head_dim, self.work.num_tiles)
        else:
            batch, heads, rows = acc_shape[0], acc_shape[1], self.seqlen
            extents = (batch, heads, rows, self.head_dim, self.layout.num_tiles(rows))
        if batch > MAX_GRID_Z:
            raise ValueError(f"jax_dqpost: the batch (with any vmapped axes folded in) must be at most {MAX_GRID_Z}, "
                             f"CUDA's grid limit, got {batch}")
        if heads * extents[4] > INT32_MAX:
            raise ValueError(f"jax_dqpost: heads * ceil(rows / tile_m) must be below 2^31, CUDA's grid limit, got "
                             f"heads={heads} and {extents[4]} tiles per head ({rows} rows)")
        return extents

    def ctas(self, acc_shape, shares: int = 1, short_heads: int = varlen.SHORT_HEADS) -> int:
        """CTAs of this part, ``shares`` per tile and head (and ``short_heads`` heads per short-tile CTA): all of them
        varlen (``WorkList.ctas``), per batch (grid z) dense."""
        _, heads, _, _, grid_x = self.launch_extents(acc_shape)
        return self.work.ctas(heads, shares, short_heads) if self.work is not None else shares * heads * grid_x


def _entries(count: int) -> str:
    return f"{count} entr{'y' if count == 1 else 'ies'}"


class Operands(NamedTuple):
    """A call's operands by role (:meth:`Plan.group`): whatever stands for them (arrays, shapes, batch dims...)."""

    acc: tuple  # one per part: dq_accum, [dk_accum, dv_accum]
    aux: tuple  # one per side: q_aux, [k_aux] (dK and dV share the k side's)
    scales: Any
    learnable_sink: Any = None  # learnable_sink, lse, dpsum: with a sink only
    lse: Any = None
    dpsum: Any = None

    @property
    def sink(self) -> tuple:
        """``(learnable_sink, lse, dpsum)``."""
        return self.learnable_sink, self.lse, self.dpsum


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static description of a postprocess call (frozen, hashable: the primitive's parameter).

    Operands and results in the order of ``_kernel/abi.py``; the sink operands' shapes (:meth:`sink_shapes`) and the
    gradient are :func:`~jax_dqpost.flash_attention_postprocess`'s.

    Attributes:
      parts: a :class:`Part` per tensor: dQ's, or dQ's, dK's and dV's (``abi.PARTS``; one dtype).
      sink_dtype: ``learnable_sink``'s dtype, or None without a sink.
      dsink_dtype: the type the kernel writes ``dsink`` in: ``sink_dtype``, or float32 for the partial sums
        of a batch shard (reduced across shards, then rounded).
    """

    parts: tuple[Part, ...]
    sink_dtype: np.dtype | None = None
    dsink_dtype: np.dtype | None = None

    def __post_init__(self):
        abi.part_names(len(self.parts))  # one part or three

    @property
    def names(self) -> tuple[str, ...]:
        return abi.part_names(len(self.parts))

    @property
    def dq(self) -> Part:
        return self.parts[0]

    @property
    def has_sink(self) -> bool:
        return self.sink_dtype is not None

    @property
    def operands(self) -> tuple[abi.Buffer, ...]:
        return abi.operands(len(self.parts), self.has_sink)

    @property
    def results(self) -> tuple[abi.Buffer, ...]:
        return abi.results(len(self.parts), self.has_sink)

    @property
    def num_operands(self) -> int:
        return len(self.operands)

    @property
    def side_parts(self) -> tuple[Part, ...]:
        """The first part of each side (whose plan its aux operand follows): dQ's, then dK's."""
        return self.parts[:len(abi.sides(len(self.parts)))]

    def without_sink(self) -> "Plan":
        return dataclasses.replace(self, sink_dtype=None, dsink_dtype=None)

    # ---- operands and results (abi.BUFFERS) ----------------------------------------------------------
    def group(self, args) -> Operands:
        """The operands (or anything in their order) by role."""
        args = tuple(args)
        if len(args) != self.num_operands:
            raise ValueError(f"the call has {self.num_operands} operands, got {len(args)}")
        kinds: dict[str, list] = {}
        for buffer, arg in zip(self.operands, args):
            kinds.setdefault(buffer.kind, []).append(arg)
        one = {k: v[0] for k, v in kinds.items() if k not in ("accum", "aux")}
        return Operands(tuple(kinds["accum"]), tuple(kinds["aux"]), **one)

    def join(self, ops: Operands) -> list:
        """The inverse of :meth:`group`: the operands in the table's order."""
        kinds = {"accum": iter(ops.acc), "aux": iter(ops.aux), "scales": iter([ops.scales]),
                 "learnable_sink": iter([ops.learnable_sink]), "lse": iter([ops.lse]), "dpsum": iter([ops.dpsum])}
        return [next(kinds[buffer.kind]) for buffer in self.operands]

    def part_aux(self, ops: Operands) -> tuple:
        """The aux operand of each part: its side's."""
        sides = abi.sides(len(self.parts))
        return tuple(ops.aux[sides.index(abi.SIDE[name])] for name in self.names)

    def buffer_dtype(self, buffer: abi.Buffer) -> np.dtype:
        """The dtype of one of the call's buffers (its ``dtype`` rule in :data:`abi.BUFFERS`)."""
        rule = {"f32": np.float32, "s32": np.int32, "out": self.dq.dtype, "sink": self.sink_dtype,
                "dsink": self.dsink_dtype}
        return np.dtype(rule[buffer.dtype])

    def tiling_of(self, buffer: abi.Buffer) -> Tiling:
        """The tiling that shapes a buffer: its part's, or its side's first part's (``scales``: dQ's)."""
        if buffer.part is not None:
            return self.parts[self.names.index(buffer.part)].tiling
        return self.side_parts[abi.sides(len(self.parts)).index(buffer.side or "q")].tiling

    def check_dtypes(self, avals) -> None:
        """``TypeError`` naming the operand whose dtype (or rank, for the int32 operands) is not its table's."""
        for buffer, aval in zip(self.operands, avals, strict=True):
            want = self.buffer_dtype(buffer)
            if aval.dtype != want or (buffer.kind == "aux" and aval.ndim != 1):
                what = "a 1-D int32 array" if buffer.kind == "aux" else np.dtype(want).name
                got = f"{aval.dtype}{list(aval.shape)}" if buffer.kind == "aux" else f"{aval.dtype}"
                raise TypeError(f"{buffer.name} must be {what}, got {got}")

    def sink_shapes(self, dq_acc_shape) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Shapes of ``(learnable_sink, lse, dpsum)`` for a dQ accumulator of this shape."""
        q = self.dq
        if q.work is not None:
            heads = dq_acc_shape[0]
            return (heads,), (heads, q.work.total), (heads, q.work.padded_total)
        batch, heads = dq_acc_shape[0], dq_acc_shape[1]
        return (heads,), (batch, heads, q.seqlen), (batch, heads, q.layout.padded_seqlen(q.seqlen))

    def result_shapes(self, shapes) -> list[tuple[tuple[int, ...], np.dtype]]:
        """``(shape, dtype)`` of each result for operands of these shapes; ``ValueError`` naming what does not
        fit."""
        ops = self.group(shapes)
        if tuple(ops.scales) != (len(self.parts),):
            raise ValueError(f"the scales operand must have shape ({len(self.parts)},), got {ops.scales}")
        out = [(p.result_shape(a, x, ARG_NAMES[name]), p.dtype)
               for name, p, a, x in zip(self.names, self.parts, ops.acc, self.part_aux(ops))]
        if len(self.parts) > 1:
            q_heads, k_shape = out[0][0][-2], out[1][0]
            kv_heads = k_shape[-2]
            if out[2][0][:-1] != k_shape[:-1]:
                raise ValueError(f"dk_accum and dv_accum disagree on batch, rows or heads: dk {k_shape}, dv "
                                 f"{out[2][0]}")
            if kv_heads == 0 or q_heads % kv_heads:
                raise ValueError(f"the key/value heads ({kv_heads}) must divide the query heads ({q_heads})")
        if self.has_sink:
            want = self.sink_shapes(ops.acc[0])
            for name, got, w in zip(("learnable_sink", "lse", "dpsum"), ops.sink, want):
                if tuple(got) != w:
                    raise ValueError(f"{name} must have shape {w} for dq_accum of shape {tuple(ops.acc[0])}, "
                                     f"got {tuple(got)}")
            out.append(((want[0][0],), np.dtype(self.dsink_dtype)))
        return out

    def check_batch(self, acc_shapes) -> None:
        """``ValueError`` naming both sides unless the q and k sides hold the same number of sequences: a dense
        side's accumulator batch, a varlen side's ``len(cu_seqlens) - 1``. For the API's operands only, not in
        :meth:`result_shapes`: vmap and sharding fold and split a dense batch, never a varlen side's sequences."""
        if len(self.parts) == 1:
            return
        sides = []
        for name, part, shape in zip(self.names, self.parts, acc_shapes):
            names = ARG_NAMES[name]
            if part.work is not None:
                batch = part.work.batch
                sides.append((batch, f"{names.cu_seqlens} has {_entries(batch + 1)} ({batch} sequences)"))
            elif len(shape) == 3:
                sides.append((shape[0], f"{names.accum} has batch {shape[0]}"))
            else:
                return  # not an accumulator: result_shapes says so
        (q_batch, q_what), (k_batch, k_what) = sides[:2]
        if q_batch != k_batch:
            raise ValueError(f"the q and k sides must have the same batch: {q_what} but {k_what}")

    # ---- the CUDA kernel -------------------------------------------------------------------------
    def kernel(self, acc_shapes) -> KernelSpec:
        """The kernel the call compiles for accumulators of ``acc_shapes`` (with the target GPU): what of it changes
        the binary, its tuning chosen from the shapes (``Part.tuning``: a small call's tiles split, few spans' short
        tiles one head a CTA, in a kernel of one part's own grid)."""
        sink = None if not self.has_sink else (abi.DTYPE_NAMES[np.dtype(self.sink_dtype)],
                                               abi.DTYPE_NAMES[np.dtype(self.dsink_dtype)])
        return KernelSpec(abi.DTYPE_NAMES[np.dtype(self.dq.dtype)], tuple(p.kernel() for p in self.parts), sink,
                          self.tuning(acc_shapes))

    def tuning(self, acc_shapes) -> Tuning:
        """The kernel's tuning for accumulators of ``acc_shapes``: its first part's choice (``Part.tuning``)."""
        return self.dq.tuning(acc_shapes[0], spec.single_part(len(self.parts), self.has_sink))

    def launch(self, acc_shapes) -> tuple[tuple[int, ...], int]:
        """``(extents, ctas)``: the kernel's int32 extents (``abi.EXTENTS`` of each part, ``Part.launch_extents``)
        and the CTAs of its launch (:meth:`kernel`'s): with a sink ``H`` sink CTAs, then every part's, every batch's
        (the grid's z is the batch when ``KernelSpec.batch_on_grid_z``). ``ValueError`` if CUDA cannot launch it."""
        extents, ctas = [], self.dq.heads(acc_shapes[0]) if self.has_sink else 0
        t = self.tuning(acc_shapes)
        for p, shape in zip(self.parts, acc_shapes):
            ext = p.launch_extents(shape)
            extents += ext
            ctas += p.ctas(shape, t.shares, t.short_heads) * (1 if p.work is not None else ext[0])
        on_z = spec.batch_on_grid_z(len(self.parts), self.has_sink, self.dq.tiling)
        grid_x = ctas // extents[0] if on_z and extents[0] else ctas
        if grid_x > INT32_MAX:
            raise ValueError(f"jax_dqpost: {grid_x} CTAs along the grid's x, more than CUDA launches (2^31 - 1)")
        return tuple(extents), ctas
