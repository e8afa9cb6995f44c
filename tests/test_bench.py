"""The benchmark's parts that need no GPU: its problem sizes, and its jax.numpy gather baseline (what a
user writes without this package) computes the same bits as the op, dense and varlen, for every
FlashAttention configuration it times (so its speed is compared on equal work)."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jax_dqpost.bench import __main__ as bench_main
from jax_dqpost.bench import cases, fused, harness, probes, report
from test_dq_postprocess import assert_same_bits


@pytest.mark.parametrize("packing", cases.PACKINGS)
@pytest.mark.parametrize("name, head_dim, causal", cases.CONFIGS, ids=[c[0] for c in cases.CONFIGS])
def test_gather_baseline_matches_the_op(rng, name, head_dim, causal, packing):
    case = cases.Case(name, head_dim, causal, packing, 300_000, rng, torch=None, fa4=None)
    acc = rng.standard_normal(case.acc_shape).astype(np.float32)
    want = jax.jit(case.ours_jax_fn())(acc)
    got = jax.jit(case.gather_fn())(acc)
    assert got.shape == case.out_shape
    assert_same_bits(got, want, f"bench gather baseline {name} {packing}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_problem_sizes_span_kilobytes_to_a_gigabyte(rng, head_dim):
    for packing in cases.PACKINGS:
        sizes = [cases.Case("x", head_dim, False, packing, s, rng, None, None).bytes for s in cases.SIZES]
        assert sizes == sorted(sizes) and sizes[0] < 16 << 10 and 0.8 * 2**30 < sizes[-1] < 1.3 * 2**30, sizes
    ref = cases.Case("x", head_dim, False, "dense", None, rng, None, None)
    assert (ref.B, ref.H, ref.S) == cases.REFERENCE_SHAPE
    lengths = np.diff(cases.Case("x", head_dim, False, "varlen", None, rng, None, None).cu)
    assert len(lengths) == 64 and lengths.sum() == 2 * 8192 and (lengths > 0).all()


def test_plot_draws_a_saved_report(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"config": c, "packing": m, "bytes": b, "ours": b / 3e12, "copy": b / 3.5e12, "ours_jax": b / 2.9e12,
             "jnp_gather": b / 0.5e12} for c, _, _ in cases.CONFIGS for m in cases.PACKINGS for b in cases.SIZES]
    report.plot({"sweep": rows, "gpu": "test", "date": "today", "commit": "abc"}, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 10_000


def test_many_short_sequences_launch_exactly_the_tiles_they_need(rng):
    """With static offsets the varlen grid is exact: 2000 short sequences launch the tiles their rows need
    (a partial tile per sequence end), no more."""
    case = cases.Case("x", 128, False, "varlen", None, rng, None, None, sequences=cases.MANY_SEQUENCES)
    lengths = np.diff(case.cu)
    assert len(lengths) == cases.MANY_SEQUENCES and (lengths > 0).all()
    tm = case.layout.tile_m
    assert case.num_tiles == case.tiles_needed == sum(-(-int(n) // tm) for n in lengths)


@pytest.mark.parametrize("with_torch", [True, False], ids=["torch", "no-torch"])
def test_main_reports_from_measurements(tmp_path, monkeypatch, capsys, with_torch):
    """The report path of `python -m jax_dqpost.bench` (tables, JSON, plot) on synthetic measurements, so a
    GPU run never fails on its printing; without torch the graph-replay columns are skipped with a message, the
    others still run. The measurements themselves need a GPU (recorded runs)."""
    import sys
    import types

    def fake_measure(case, samples):
        t = case.bytes / 4e12
        r = {"config": case.name, "packing": case.packing, "bytes": case.bytes, "tokens": case.tokens,
             "ours_jax": t * 1.1, "xla_same_bytes": t * 1.05, "jnp_gather": t * 4}
        if case.torch is not None:
            r.update(ours=t, FA4=t * 1.01, copy=t * 0.98)
        if case.cu is not None:
            r.update(sequences=len(case.cu) - 1, tiles_launched=case.num_tiles, tiles_needed=case.tiles_needed)
        return r

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch if with_torch else None)
    # FlashAttention-4 must not be imported against the fake torch: a half-imported flash_attn would stay in
    # sys.modules and break the FlashAttention-4 tests later in this process (seen on the GPU machine).
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(cases, "measure", fake_measure)

    def fake_fused(case, samples):
        t = case.bytes / 4.2e12
        r = {"config": case.name, "sink": case.sink, "bytes": case.bytes, "xla_same_bytes": t * 1.01,
             "fused_jax": t}
        if case.torch is not None:
            r.update(fused=t, ours_3=t * 1.03, FA4_3=t * 1.06, same_bits_as_FA4=True)
            if case.sink:
                r["fused_sink"] = t * 1.01
        return r

    monkeypatch.setattr(fused, "measure_case", fake_fused)
    monkeypatch.setattr(probes, "chain_cost", lambda samples: {
        "shape": [1, 80, 1, 128], "calls": 200, "our_calls_in_program": 200, "ours": 3e-6, "ours_program_1": 1e-4,
        "ours_program_n": 7e-4, "ours_outputs_returned": 8e-6, "xla_kernels_in_program": 199,
        "xla_elementwise": 1.3e-6, "ours_device": {"kernels": 200, "per_call": 2e-6, "median_duration": 1.8e-6,
                                                   "median_gap": 2e-7}})
    start = {"import_jax": 1.0, "import_jax_dqpost": 0.03, "configs": [{"head_dim": 64, "get_kernel": 0.3,
                                                                         "first_result": 0.35}]}
    monkeypatch.setattr(probes, "start_costs", lambda: {"cold": start, "warm": start})
    monkeypatch.setattr(probes, "jax_path_costs", lambda: {"default": {"rotated_inputs": 1e-4}})
    try:
        import matplotlib  # noqa: F401
        has_plot = True
    except ImportError:
        has_plot = False
    assert bench_main.main(["--out", str(tmp_path), "--quick"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "2000 random lengths" in out and "per-call cost in a jitted chain" in out
    assert "fused dQ + dK + dV (+ dsink) in one launch" in out and "hd128-dense-sink" in out
    assert "GPU timeline (jax.profiler, one execution): ours 2.00 us per call" in out
    assert ("torch is not installed" in captured.err) == (not with_torch)
    result = json.loads((tmp_path / "bench.json").read_text())
    assert len(result["reference"]) == 2 * len(cases.CONFIGS) and result["many_sequences"]["sequences"] == 2000
    assert all(("ours" in r) == with_torch and "xla_same_bytes" in r for r in result["reference"])
    assert (tmp_path / "bench.png").exists() == has_plot


def _run_cli(args, block=(), cwd=None):
    """``python -m jax_dqpost.bench ARGS`` in a fresh process, with the modules in ``block`` unimportable."""
    code = ("import sys; [sys.modules.__setitem__(m, None) for m in sys.argv[1].split(',') if m]; "
            "from jax_dqpost.bench.__main__ import main; sys.exit(main(sys.argv[2:]))")
    return subprocess.run([sys.executable, "-c", code, ",".join(block), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_cli_without_a_gpu_says_so_in_one_line_and_writes_nothing(tmp_path):
    from jax_dqpost import arch

    if arch.cuda_devices():
        pytest.skip("this machine has a GPU: the benchmark would run")
    out = _run_cli(["--out", str(tmp_path / "results")], block=("torch",))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in out.stderr, out.stderr
    assert not (tmp_path / "results").exists()


def test_cli_plot_without_matplotlib_says_what_to_install(tmp_path):
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps({"sweep": [], "gpu": "x", "date": "today", "commit": "abc"}))
    out = _run_cli(["--plot", str(saved), "--out", str(tmp_path / "plots")], block=("matplotlib",))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "matplotlib is not installed" in out.stderr and "jax-dqpost[bench]" in out.stderr, out.stderr
    assert not (tmp_path / "plots").exists()
    bad = _run_cli(["--plot", str(tmp_path / "missing.json"), "--out", str(tmp_path / "plots")])
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "missing.json" in bad.stderr, bad.stderr


def test_device_timeline_of_a_chain():
    """The chain's device-side split comes from jax.profiler's own trace: on a GPU, one kernel per call with
    their span, durations and gaps; without GPU activity (CPU) an empty result, never an exception."""
    import jax.numpy as jnp

    def chain(a, k):
        for i in range(k):
            a = jax.lax.optimization_barrier(a * (1 + (i + 1) / 4096))  # (x * 1 would be simplified away)
        return a

    res = harness.device_per_kernel(jax.jit(chain, static_argnums=1), (jnp.ones((64, 128), np.float32), 5), "multiply")
    if jax.default_backend() != "gpu":
        assert res == {}
    else:
        assert res["kernels"] == 5 and res["median_duration"] > 0 and res["per_call"] > 0, res
