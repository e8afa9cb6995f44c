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


def test_many_short_sequences_launch_exactly_the_tiles_they_need(rng):
    """With static offsets the varlen grid is exact: 2000 short sequences launch the tiles their rows need
    (a partial tile per sequence end), no more."""
    case = bench.Case("x", 128, False, "varlen", None, rng, None, None, sequences=bench.MANY_SEQUENCES)
    lengths = np.diff(case.cu)
    assert len(lengths) == bench.MANY_SEQUENCES and (lengths > 0).all()
    tm = case.layout.tile_m
    assert case.num_tiles == case.tiles_needed == sum(-(-int(n) // tm) for n in lengths)


def test_main_reports_from_measurements(tmp_path, monkeypatch, capsys):
    """The report path of `python -m jax_dqpost.bench` (tables, JSON, plot) on synthetic measurements, so a
    GPU run never fails on its printing. The measurements themselves need a GPU (recorded runs)."""
    import sys
    import types

    def fake_measure(case, samples):
        t = case.bytes / 4e12
        r = {"config": case.name, "mode": case.mode, "bytes": case.bytes, "tokens": case.tokens, "ours": t,
             "FA4": t * 1.01, "copy": t * 0.98, "ours_jax": t * 1.1, "jnp_gather": t * 4}
        if case.mode == "varlen":
            r.update(sequences=len(case.cu) - 1, tiles_launched=case.num_tiles, tiles_needed=case.tiles_needed)
        return r

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True,
                                                                   get_device_name=lambda: "fake GPU"))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    # FlashAttention-4 must not be imported against the fake torch: a half-imported flash_attn would stay in
    # sys.modules and break the FlashAttention-4 tests later in this process (seen on the GPU machine).
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "chain_cost", lambda samples: {
        "shape": [1, 80, 1, 128], "calls": 200, "our_calls_in_program": 200, "ours": 3e-6, "ours_program_1": 1e-4,
        "ours_program_n": 7e-4, "ours_outputs_returned": 8e-6, "xla_kernels_in_program": 199,
        "xla_elementwise": 1.3e-6, "ours_device": {"kernels": 200, "per_call": 2e-6, "median_duration": 1.8e-6,
                                                   "median_gap": 2e-7}})
    start = {"import_jax": 1.0, "import_jax_dqpost": 0.03, "configs": [{"head_dim": 64, "get_kernel": 0.3,
                                                                         "first_result": 0.35}]}
    monkeypatch.setattr(bench, "start_costs", lambda: {"cold": start, "warm": start})
    monkeypatch.setattr(bench, "jax_path_costs", lambda: {"default": {"rotated_inputs": 1e-4}})
    has_plot = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        has_plot = False
        monkeypatch.setattr(bench, "plot", lambda report, path: None)
    assert bench.main(["--out", str(tmp_path), "--quick"]) == 0
    out = capsys.readouterr().out
    assert "fake GPU" in out and "2000 random lengths" in out and "per-call cost in a jitted chain" in out
    assert "GPU timeline (jax.profiler, one execution): ours 2.00 us per call" in out
    report = __import__("json").loads((tmp_path / "bench.json").read_text())
    assert len(report["reference"]) == 2 * len(bench.CONFIGS) and report["many_sequences"]["sequences"] == 2000
    assert (tmp_path / "bench.png").exists() == has_plot


def test_device_timeline_of_a_chain():
    """The chain's device-side split comes from jax.profiler's own trace: on a GPU, one kernel per call with
    their span, durations and gaps; without GPU activity (CPU) an empty result, never an exception."""
    import jax.numpy as jnp

    def chain(a, k):
        for i in range(k):
            a = jax.lax.optimization_barrier(a * (1 + (i + 1) / 4096))  # (x * 1 would be simplified away)
        return a

    res = bench._device_per_kernel(jax.jit(chain, static_argnums=1), jnp.ones((64, 128), np.float32), 5, "multiply")
    if jax.default_backend() != "gpu":
        assert res == {}
    else:
        assert res["kernels"] == 5 and res["median_duration"] > 0 and res["per_call"] > 0, res
