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
buffers in exactly this order and knows nothing else of it; the lowering (``lowering.py``), the kernel's entry
(``kernel.py``), the compile-time placeholders (``kernel_cache.py``) and the benchmark build their lists here.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

PARTS = ("dq", "dk", "dv")
"""The tensors a call converts, in order; a call has the first one or all three."""

SIDE = {"dq": "q", "dk": "k", "dv": "k"}
"""Which sequence side (its int32 operand) each part reads."""

EXTENTS = ("dim0", "heads", "rows", "head_dim", "grid_x")
"""Each part's int32 extents, in the entry's order (``plan.Part.launch_extents`` defines their values)."""

DTYPE_NAMES = {np.dtype(np.float32): "f32", np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.float16): "f16"}
"""The one dtype table: the names the kernel cache and the FFI attributes use."""

OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
"""Types of dq, dk and dv."""

SINK_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
"""Types of ``learnable_sink`` and ``dsink``."""

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


def operands(num_parts: int, sink: bool) -> tuple[str, ...]:
    parts = part_names(num_parts)
    names = tuple(f"{p}_accum" for p in parts) + tuple(f"{s}_aux" for s in sides(num_parts)) + ("scales",)
    return names + (("learnable_sink", "lse", "dpsum") if sink else ())


def results(num_parts: int, sink: bool) -> tuple[str, ...]:
    return part_names(num_parts) + (("dsink",) if sink else ())


def pointers(num_parts: int, sink: bool) -> tuple[str, ...]:
    """The entry's pointer arguments: operands, then results."""
    return operands(num_parts, sink) + results(num_parts, sink)


def extents(num_parts: int) -> tuple[str, ...]:
    """The entry's int32 arguments, after the pointers."""
    return tuple(f"{p}_{e}" for p in part_names(num_parts) for e in EXTENTS)


def arguments(num_parts: int, sink: bool) -> tuple[str, ...]:
    """The entry's arguments but the stream, in order."""
    return pointers(num_parts, sink) + extents(num_parts)
