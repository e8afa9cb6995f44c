"""The tests' shared helpers, one for each fact: an array's bits, a value's rounding step and the bound between two
computations that may sum in other orders, closeness to a float64 formula at its scale, rounding up, packed offsets from lengths, a one-part kernel, a stand-in compile, an export for CUDA. The subprocess scripts (``*_main.py``, ``sanitize_varlen.py``),
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


_MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23, "float64": 52}
_MIN_EXPONENT = {"bfloat16": -126, "float16": -14, "float32": -126, "float64": -1022}
FLOAT32_EPS = 2.0 ** -23


def ulp(x, dtype) -> np.ndarray:
    """The spacing of ``dtype``'s values (bfloat16, float16, float32, float64) at ``|x|``, in float64: a value's
    rounding to ``dtype`` moves it by at most half of this (below the normal range, the subnormals' spacing)."""
    name = np.dtype(dtype).name
    x = np.abs(np.asarray(x, np.float64))
    tiny = 2.0 ** _MIN_EXPONENT[name]
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.maximum(x, tiny)))
    return np.exp2(exponent - _MANTISSA_BITS[name])


def assert_within_roundings(got, want, what="", *, roundings=1, terms=0, magnitude=None):
    """``got`` and ``want``, two computations of one formula in ``got``'s precision that may sum in other orders
    (another program, another CPU, a sharded sum): the same shape and non-finite values, and each finite element
    within ``roundings`` steps of ``got``'s dtype at its own magnitude, plus what reordering a float32 sum of
    ``terms`` terms can move it before that rounding: ``terms * 2**-23 * magnitude``, ``magnitude`` the sum of the
    terms' absolute values (by default the largest ``|want|``, for sums without cancellation). A wrong row, scale
    or sign is off by the element's own size, far beyond this."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    assert np.array_equal(np.isnan(g), np.isnan(w)), f"{what}: NaNs in other places"
    assert np.array_equal(np.isinf(g), np.isinf(w)) and np.array_equal(g[np.isinf(w)], w[np.isinf(w)]), \
        f"{what}: infinities in other places"
    if magnitude is None:
        magnitude = np.max(np.abs(w[finite]), initial=0.0)
    bound = roundings * ulp(np.maximum(np.abs(g), np.abs(w)), got.dtype) + terms * FLOAT32_EPS * np.asarray(magnitude)
    bound = np.broadcast_to(bound, w.shape)
    err = np.where(finite, np.abs(g - w), 0.0)
    bad = err > bound
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements beyond {roundings} rounding(s) and "
                             f"{terms} float32 sum terms, first at {list(i)}: got {g[i]!r}, want {w[i]!r}, "
                             f"bound {bound[i]:.3g}")


def assert_close_to_scale(got, want, rel, what=""):
    """``got`` within ``rel`` of ``want``'s largest magnitude, element by element, and finite where ``want`` is (a
    computation in lower precision against a float64 formula; a wrong row, sign or scale is off by the element's
    own size)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), f"{what}: non-finite values in other places"
    assert np.array_equal(got[~finite], want[~finite]), f"{what}: other infinities"
    scale = np.abs(want[finite]).max(initial=0)
    err = np.abs(got[finite] - want[finite]).max(initial=0)
    assert err <= rel * scale, f"{what}: max error {err:.3g} beyond {rel:.3g} of {scale:.3g}"


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


def one_part_kernel(dtype, layout, padded_head_dim, tiling=0, shares=1, short_heads=8):
    """The kernel of a one-part call without a sink (``Plan.kernel``); ``tiling`` 0 is the dense one; ``shares``: CTAs
    per tile (``Tuning.shares``); ``short_heads``: heads per short-tile CTA (``Tuning.short_heads``)."""
    from jax_dqpost._kernel.spec import KernelSpec, TensorKernel, Tuning

    return KernelSpec(dtype, (TensorKernel(layout, padded_head_dim, tiling),), tuning=Tuning(shares, short_heads))


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
