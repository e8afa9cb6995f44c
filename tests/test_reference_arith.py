"""The reference's integer fp32 multiply equals IEEE-754 (numpy) on every class of input, including
subnormal operands and results, which XLA's CPU runtime would flush to zero in a plain multiply."""

from __future__ import annotations

import jax
import numpy as np

from jax_dqpost.postprocess._primitive.reference import mul_f32_rn


def _check(a_bits, b_bits):
    x, y = a_bits.view(np.float32), b_bits.view(np.float32)
    with np.errstate(all="ignore"):
        want = x * y
    got = np.asarray(jax.jit(mul_f32_rn)(x, y))
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    bad = (got.view(np.uint32) != want.view(np.uint32)) & ~nan
    assert not bad.any(), f"{bad.sum()} mismatches, e.g. {x[bad][:3]} * {y[bad][:3]} = {got[bad][:3]} not {want[bad][:3]}"


def test_random_bit_patterns(rng):
    n = 1 << 20
    _check(rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32),
           rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32))


def test_near_the_subnormal_boundary(rng):
    n = 1 << 20
    mant = lambda: rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32) & np.uint32(0x807FFFFF)
    a = mant() | (rng.integers(0, 90, n).astype(np.uint32) << 23)
    b = mant() | (rng.integers(0, 170, n).astype(np.uint32) << 23)
    _check(a, b)


def test_special_values():
    specials = np.array([0, 0x80000000, 1, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                         0x7FC00000, 0x3F800000, 0x3F000000, 0x00400000], np.uint32)
    a, b = np.meshgrid(specials, specials)
    _check(a.ravel(), b.ravel())

