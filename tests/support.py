"""The tests' shared helpers, one for each fact: an array's bits, rounding up, packed offsets from lengths, a one-
part kernel, a stand-in compile, an export for CUDA. The subprocess scripts (``*_main.py``, ``sanitize_varlen.py``),
``oracle.py`` and ``fa4_peer.py`` sit beside it in tests/; a test or a script imports it as ``support`` (tests/ is
on the path: pytest puts it there, conftest.py too, and a script started as ``python tests/X.py`` has its own folder
first).

Importing it imports numpy alone: ``oracle.py``, written apart from jax_dqpost, uses it too.
"""

from __future__ import annotations

import numpy as np


def bits(x) -> np.ndarray:
    """``x``'s bits as unsigned integers of its width (bf16 and fp16: uint16; float32: uint32)."""
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


def round_up(x, m):
    """``x`` rounded up to a multiple of ``m``."""
    return -(-x // m) * m


def cu_seqlens(lengths) -> np.ndarray:
    """int32 ``cu_seqlens`` of packed sequences of ``lengths``: 0, then the running sums (``.tolist()`` for the static
    offsets of a list)."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def fake_compile(*key):
    """Stands in for the CuTe compile (``kernel_cache.compile_executor``) in tests of the cache, not the kernel."""
    import types

    return types.SimpleNamespace(dump_to_object=lambda prefix: b"\x7fELF module of " + repr(key).encode())


def one_part_kernel(dtype, layout, padded_head_dim, tiling=0, split=1, short_heads=8):
    """The kernel of a one-part call without a sink (``Plan.kernel``); ``tiling`` 0 is the dense one; ``split``: CTAs
    per tile (``TensorKernel.split``); ``short_heads``: heads per short-tile CTA (``TensorKernel.short_heads``)."""
    from jax_dqpost.kernel_spec import KernelSpec, TensorKernel

    return KernelSpec(dtype, (TensorKernel(layout, padded_head_dim, tiling, split, short_heads),))


def export_dq(platforms=("cuda",), *, head_dim=128, seqlen=1000, dtype=None):
    """``dq_postprocess`` of a dense ``(2, seqlen, 4, head_dim)`` dQ (``dtype``, bf16 by default) in
    :func:`export_layout`'s order, scale traced, exported by ``jax.export`` for ``platforms`` (for CUDA, it compiles
    the kernel)."""
    import jax
    import jax.numpy as jnp

    from jax_dqpost import DISABLED_CHECKS, dq_postprocess

    layout, dtype = export_layout(), dtype or jnp.bfloat16
    f = jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=seqlen, head_dim=head_dim, dtype=dtype, layout=layout))
    return jax.export.export(f, platforms=list(platforms), disabled_checks=DISABLED_CHECKS)(
        jax.ShapeDtypeStruct(layout.accum_shape(2, 4, seqlen, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.float32))


def export_layout():
    """The order :func:`export_dq` reads: FlashAttention-4's sm90 dQ at head dim 128 (tile 80, swapped)."""
    from jax_dqpost import AccumLayout

    return AccumLayout(90, 80, 256, 1, True, 32)
