"""The private APIs of jax_dqpost that the benchmark uses, in one place: nothing else in ``benchmarks/`` imports
them. They are jax_dqpost's internals as they are in this tree, not its public API (``jax_dqpost.__all__``), and
change with it: the plan of a call (``jax_dqpost.postprocess._primitive.plan``, ``jax_dqpost._kernel.varlen``; ``cases`` and
``fused`` read the parts made here for their work lists and padded head dims), the kernel compiled and launched from
Python on torch's buffers (``jax_dqpost._kernel``: ``cache``, ``kernel``, ``abi``), and the handler's registration
(``jax_dqpost.postprocess._primitive.ffi``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_dqpost._kernel import abi, arch, cache as kernel_cache
from jax_dqpost._kernel.varlen import WorkList
from jax_dqpost.postprocess._primitive import ffi as _ffi
from jax_dqpost.postprocess._primitive.plan import Part, Plan

TARGET_NAME = _ffi.TARGET_NAME
"""The custom-call target of our op in a compiled program's text."""
command_buffers = _ffi.command_buffers  # whether XLA may capture our calls into its command buffers

_EXECUTORS: dict = {}


def dense_part(layout, head_dim: int, dtype, seqlen: int) -> Part:
    """The part of a dense tensor of ``seqlen`` rows per sequence."""
    return Part(layout, head_dim, np.dtype(dtype), seqlen=seqlen)


def varlen_part(layout, head_dim: int, dtype, cu, total: int, traced: bool = False) -> tuple[Part, np.ndarray]:
    """``(part, work list)`` of packed sequences ``cu`` (``cu_seqlens``) over ``total`` tokens: the work list (the
    aux operand) of static offsets, the exact grid, or with ``traced`` the grid of traced ones (its bound)."""
    grid = WorkList.max_tiles(total, len(cu) - 1, layout) if traced else None
    work, work_list = WorkList.build(np, cu, None, total=total, layout=layout, num_tiles=grid)
    return Part(layout, head_dim, np.dtype(dtype), work=work), work_list


def plan(parts, sink_dtype=None) -> Plan:
    """The plan of a call of ``parts`` (dQ's, or dQ's, dK's and dV's), with the learnable sink of ``sink_dtype``."""
    return Plan(tuple(parts), sink_dtype=sink_dtype, dsink_dtype=sink_dtype)


def get_kernel(p: Plan, acc_shapes):
    """The package's own kernel lookup for ``p`` on accumulators of ``acc_shapes`` (memory, disk, else a compile), as
    its first lowering does it."""
    return kernel_cache.get_kernel(p.kernel(acc_shapes))


def executor(p: Plan, acc_shapes, **tuning):
    """CuTe's executor of ``p``'s kernel on accumulators of ``acc_shapes`` for this GPU, compiled once per kernel;
    ``tuning``: fields of its ``Tuning`` (``shares``, ``short_heads``) instead of the package's choice, the key the
    package's own cache would compile (``ValueError`` for a tuning the kernel cannot take, ``TypeError`` for a name
    that is not a field)."""
    spec = p.kernel(acc_shapes)
    spec = dataclasses.replace(spec, tuning=dataclasses.replace(spec.tuning, **tuning))
    if spec not in _EXECUTORS:
        _EXECUTORS[spec] = kernel_cache.compile_executor(spec, arch.target_arch())
    return _EXECUTORS[spec]


def launch_args(p: Plan, acc_shapes, buffers: dict) -> tuple:
    """:func:`executor`'s arguments but the stream, for accumulators of ``acc_shapes``: the device address of each
    of the kernel's pointers (``buffers``: torch tensors by ``abi.pointers`` name, extra ones unused), then the
    extents."""
    spec = p.kernel(acc_shapes)
    extents, _ = p.launch(acc_shapes)
    addresses = [buffers[name].data_ptr() for name in abi.pointers(len(p.parts), p.has_sink)]
    from jax_dqpost._kernel.kernel import entry_args  # imports cutlass

    return entry_args(spec.dtype, len(p.parts), spec.sink, addresses, extents)
