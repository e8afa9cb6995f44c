"""The calling convention of the postprocess kernel, declared once (no cutlass here).

One kernel converts a call's parts (dQ, or dQ, dK and dV) and, with a learnable sink, reduces its gradient. The
custom call's operands and results, and the compiled module's entry point, follow one order:

    operands   dq_accum, [dk_accum, dv_accum], q_aux, [k_aux], scales, [learnable_sink, lse, dpsum]
    results    dq, [dk, dv], [dsink]
    entry      every operand, then every result, as a device pointer; then EXTENTS (int32) for each part;
               then the CUDA stream

``[...]``: only with dK/dV (three parts) or with a sink. ``q_aux``/``k_aux``: the int32 operand of the q side and of
the k side (empty, ``seqused`` or the varlen work list; ``plan.Part.aux_shape``); dK and dV share the k side's.
``scales``: float32 ``(parts,)``, one per part. The FFI handler (``ffi/dqpost_ffi.cc``, ``Execute``) passes the
buffers in exactly this order and checks each one's element type and rank by its row's kind (its ``Roles``, pinned
to this table by ``tests/test_cuda_lowering.py``). :data:`BUFFERS` is the table of them (kind, how many,
dtype, axes), from which every other list is derived.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

PARTS = ("dq", "dk", "dv")
"""The tensors a call converts, in order; a call has the first one or all three."""

SIDE = {"dq": "q", "dk": "k", "dv": "k"}
"""Which sequence side (its int32 operand) each part reads."""

EXTENTS = ("batch_or_spans", "heads", "rows", "head_dim", "grid_x")
"""Each part's int32 extents, in the entry's order (``plan.Part.launch_extents`` defines their values)."""

DTYPE_NAMES = {np.dtype(np.float32): "f32", np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.float16): "f16"}
"""The one dtype table: the names the kernel cache and the FFI attributes use."""

OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
"""Types of dq, dk and dv."""

SINK_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
"""Types of ``learnable_sink`` and ``dsink``."""

OUT_DTYPE_NAMES = tuple(DTYPE_NAMES[d] for d in OUT_DTYPES)
SINK_DTYPE_NAMES = tuple(DTYPE_NAMES[d] for d in SINK_DTYPES)
"""The types' names (:data:`DTYPE_NAMES`), as the kernel's record and precompile's options spell them."""

def dtype_of(value) -> np.dtype | None:
    """The dtype ``value`` is or names: a dtype (or anything numpy takes for one), or a string in either spelling,
    the short one of :data:`DTYPE_NAMES` (``"bf16"``) or numpy's (``"bfloat16"``); None if it is none."""
    if isinstance(value, str):
        named = next((d for d, short in DTYPE_NAMES.items() if value in (short, d.name)), None)
        if named is not None:
            return named
    try:
        return None if value is None else np.dtype(value)
    except TypeError:
        return None


VECTOR_ALIGN = 16
"""Every buffer's alignment in bytes (the accumulators and outputs are read and written as 16-byte vectors)."""


def part_names(num_parts: int) -> tuple[str, ...]:
    if num_parts not in (1, len(PARTS)):
        raise ValueError(f"a call converts dQ, or dQ, dK and dV; got {num_parts} parts")
    return PARTS[:num_parts]


def sides(num_parts: int) -> tuple[str, ...]:
    """The sides of a call's parts, once each, in order (``'q'``, then ``'k'`` with dK/dV)."""
    return tuple(dict.fromkeys(SIDE[p] for p in part_names(num_parts)))


class Tiling(enum.IntEnum):
    """How a CTA of the kernel finds its tile (compiled into the kernel; part of the cache key); the shapes of a
    part's buffers (``_primitive/plan.py``) and their axes (:data:`BUFFERS`) follow it."""

    DENSE = 0  # tile (b, h, m) of a dense accumulator
    DENSE_SEQUSED = 1  # the same; rows past seqused[b] are zeros
    VARLEN = 2  # tile m of head h looks its span up in the work list


class Buffer(NamedTuple):
    """One operand or result of the call (a row of :data:`BUFFERS`).

    ``kind``: the role. ``part``: the part it belongs to (accumulators and results), else None. ``side``: the side
    whose tiling shapes it (``'q'`` or ``'k'``; None for ``scales``). ``dtype``: ``"f32"``, ``"s32"``, ``"out"`` (the
    parts' type), ``"sink"`` (``learnable_sink``'s) or ``"dsink"`` (the type ``dsink`` is written in). ``vector``: read
    or written as 16-byte vectors (:data:`VECTOR_ALIGN`). ``axes``: its axes under each :class:`Tiling` of its side, as
    sharding factors: ``b`` the batch, ``h`` the side's heads, ``.`` an axis that is never sharded.
    """

    name: str
    kind: str
    part: str | None
    side: str | None
    dtype: str
    vector: bool
    axes: tuple[str, str, str]  # by Tiling: DENSE, DENSE_SEQUSED, VARLEN


class Row(NamedTuple):
    """A kind of buffer: ``per`` says how many a call has: one per part (named ``{part}_accum`` and ``{part}``), per
    side (``{side}_aux``), per call, or, with a sink only, one of the q side (``sink``)."""

    kind: str
    per: str
    dtype: str
    vector: bool
    axes: tuple[str, str, str]


BUFFERS = (
    #   kind              per     dtype    vector  axes: DENSE  DENSE_SEQUSED  VARLEN
    Row("accum", "part", "f32", True, ("b h .", "b h .", "h .")),
    Row("aux", "side", "s32", False, (".", "b", ".")),
    Row("scales", "call", "f32", False, (".", ".", ".")),
    Row("learnable_sink", "sink", "sink", False, ("h", "h", "h")),
    Row("lse", "sink", "f32", False, ("b h .", "b h .", "h .")),
    Row("dpsum", "sink", "f32", False, ("b h .", "b h .", "h .")),
    Row("out", "part", "out", True, ("b . h .", "b . h .", ". h .")),
    Row("dsink", "sink", "dsink", False, ("h", "h", "h")),
)
"""The table of the call's buffers, in order: the operands (every kind before ``out``), then the results. Every list
of them is derived from it: :meth:`Plan.group <jax_dqpost._primitive.plan.Plan.group>` and ``join``, the dtypes abstract
evaluation checks, the kernel entry's arguments (``kernel.entry_args``), the partition specs and the Shardy rule
(``_primitive/rules.py``)."""

_RESULT_KINDS = ("out", "dsink")


def buffers(num_parts: int, sink: bool) -> tuple[Buffer, ...]:
    """Every operand, then every result, of a call of ``num_parts`` parts (with a sink or not)."""
    out = []
    for kind, per, dtype, vector, axes in BUFFERS:
        if per == "part":
            out += [Buffer(f"{p}_accum" if kind == "accum" else p, kind, p, SIDE[p], dtype, vector, axes)
                    for p in part_names(num_parts)]
        elif per == "side":
            out += [Buffer(f"{s}_{kind}", kind, None, s, dtype, vector, axes) for s in sides(num_parts)]
        elif per == "call":
            out.append(Buffer(kind, kind, None, None, dtype, vector, axes))
        elif sink:
            out.append(Buffer(kind, kind, None, "q", dtype, vector, axes))
    return tuple(out)


def operands(num_parts: int, sink: bool) -> tuple[Buffer, ...]:
    return tuple(b for b in buffers(num_parts, sink) if b.kind not in _RESULT_KINDS)


def results(num_parts: int, sink: bool) -> tuple[Buffer, ...]:
    return tuple(b for b in buffers(num_parts, sink) if b.kind in _RESULT_KINDS)


def pointers(num_parts: int, sink: bool) -> tuple[str, ...]:
    """The names of the entry's pointer arguments: operands, then results."""
    return tuple(b.name for b in buffers(num_parts, sink))


def extents(num_parts: int) -> tuple[str, ...]:
    """The entry's int32 arguments, after the pointers."""
    return tuple(f"{p}_{e}" for p in part_names(num_parts) for e in EXTENTS)


def arguments(num_parts: int, sink: bool) -> tuple[str, ...]:
    """The entry's arguments but the stream, in order."""
    return pointers(num_parts, sink) + extents(num_parts)
