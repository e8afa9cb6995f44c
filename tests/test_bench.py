"""The benchmark's parts that need no GPU: its problem sizes, and its jax.numpy gather baseline (what a
user writes without this package) computes the same bits as the op, dense and varlen, for every
FlashAttention configuration it times (so its speed is compared on equal work)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_dqpost import bench
from test_dq_postprocess import assert_same_bits


@pytest.mark.parametrize("mode", ["dense", "varlen"])
@pytest.mark.parametrize("name, head_dim, causal", bench.CONFIGS, ids=[c[0] for c in bench.CONFIGS])
def test_gather_baseline_matches_the_op(rng, name, head_dim, causal, mode):
    case = bench.Case(name, head_dim, causal, mode, 300_000, rng, torch=None, fa4=None)
    acc = rng.standard_normal(case.acc_shape).astype(np.float32)
    want = jax.jit(case.ours_jax_fn())(acc)
    got = jax.jit(case.gather_fn())(acc)
    assert got.shape == case.out_shape
    assert_same_bits(got, want, f"bench gather baseline {name} {mode}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_problem_sizes_span_kilobytes_to_a_gigabyte(rng, head_dim):
    for mode in ("dense", "varlen"):
        sizes = [bench.Case("x", head_dim, False, mode, s, rng, None, None).bytes for s in bench.SIZES]
        assert sizes == sorted(sizes) and sizes[0] < 16 << 10 and 0.8 * 2**30 < sizes[-1] < 1.3 * 2**30, sizes
    ref = bench.Case("x", head_dim, False, "dense", None, rng, None, None)
    assert (ref.B, ref.H, ref.S) == bench.REFERENCE_SHAPE
    lengths = np.diff(bench.Case("x", head_dim, False, "varlen", None, rng, None, None).cu)
    assert len(lengths) == 64 and lengths.sum() == 2 * 8192 and (lengths > 0).all()


def test_plot_draws_a_saved_report(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"config": c, "mode": m, "bytes": b, "ours": b / 3e12, "copy": b / 3.5e12, "ours_jax": b / 2.9e12,
             "jnp_gather": b / 0.5e12} for c, _, _ in bench.CONFIGS for m in ("dense", "varlen") for b in bench.SIZES]
    bench.plot({"sweep": rows, "gpu": "test", "date": "today", "commit": "abc"}, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 10_000
