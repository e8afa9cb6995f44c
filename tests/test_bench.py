"""The benchmark's parts that need no GPU (``benchmarks/``, beside the package, not installed): its problem sizes,
and its jax.numpy gather baseline (what a user writes without this package) computes the same bits as the op, dense
and varlen, for every FlashAttention configuration it times (so its speed is compared on equal work)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from oracle import assert_same_bits
from support import cu_seqlens

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # benchmarks/; last on the path, so that jax_dqpost stays the one imported first

from benchmarks import __main__ as bench_main  # noqa: E402
from benchmarks import cases, fused, harness, probes, report, step  # noqa: E402


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
def test_problem_sizes_span_tens_of_kilobytes_to_a_gigabyte(rng, head_dim):
    for packing in cases.PACKINGS:
        sizes = [cases.Case("x", head_dim, False, packing, s, rng, None, None).bytes for s in cases.SIZES]
        assert sizes == sorted(sizes) and sizes[0] < 128 << 10 and 0.8 * 2**30 < sizes[-1] < 1.3 * 2**30, sizes
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


def test_short_sequences_launch_exactly_the_tiles_they_need(rng):
    """The sweep's lengths fill the tokens exactly; with static offsets the varlen grid is exact (the long tiles, and
    one CTA per span and group of 8 heads for the short ones), with traced ones it is the work list's bound."""
    for count in cases.SHORT_SEQUENCES:
        cu = cases.short_lengths(rng, cases.SHORT_TOKENS, count)
        lengths = np.diff(cu)
        top = 2 * cases.SHORT_TOKENS // count - 1
        assert cu[-1] == cases.SHORT_TOKENS and (lengths >= 1).all() and lengths.max() <= top
        assert 0.8 * count < len(lengths) < 1.25 * count, (count, len(lengths))
    case = cases.Case("x", 128, False, "varlen", None, rng, None, None, cu=cu)
    tm, H, spans = case.layout.tile_m, case.H, len(lengths) + 2
    long_tiles = sum(int(n) // tm + (int(n) % tm > 16) for n in lengths)
    assert case.tile_ctas == H * sum(-(-int(n) // tm) for n in lengths)
    assert case.ctas == H * long_tiles + spans * -(-H // 8)
    traced = cases.Case("x", 128, False, "varlen", None, rng, None, None, cu=cu, traced=True)
    T = cases.SHORT_TOKENS
    assert traced.ctas == H * min((T + (tm - 17) * spans) // tm, T // 17) + spans * -(-H // 8)
    small = cases.Case("x", 128, False, "varlen", 2**20, rng, None, None, cu=[0, 700, 1365])  # 9 + 9 long tiles
    assert small.H == 1 and small.ctas == 4 * 1 + 4 * 18  # 22 CTAs unsplit: the long tiles split in four


@pytest.mark.parametrize("granule", [32, 64])
@pytest.mark.parametrize("tensor, head_dim, causal", [("dq", 128, False), ("dq", 128, True), ("dq", 64, False),
                                                      ("dkv", 192, False)])
def test_sector_bound_counts_the_sectors_of_the_rows(rng, tensor, head_dim, causal, granule):
    """The bound against a brute-force count over the index map: every 32-byte sector (64-byte granule) of a tile
    holding an element of a converted row, plus the dQ rows; a full tile's sectors are all of its bytes."""
    layout = cases.AccumLayout.flash_attention(90, head_dim, causal=causal, tensor=tensor, version="4.0.0b36")
    tm, dr = layout.tile_m, layout.padded_head_dim(head_dim)
    pos = layout.tile_index_map(head_dim)
    lengths = [int(n) for n in rng.integers(0, 3 * tm, 40)] + [tm, 1]
    cu = cu_seqlens(lengths).tolist()
    used = [int(rng.integers(0, n + 1)) for n in lengths]
    want = 0
    for n, u in zip(lengths, used):
        for start in range(0, u, tm):
            want += granule * len({int(f) * 4 // granule for f in pos[: min(tm, u - start)].ravel()})
        want += n * head_dim * 2
    assert cases.sector_bound_bytes(layout, head_dim, 3, cu, used, granule=granule) == 3 * want
    assert cases.sector_bound_bytes(layout, head_dim, 1, [0, tm], granule=granule) == tm * (dr * 4 + head_dim * 2)
    if granule == 64 and layout.swap_ab:  # one row uses a quarter of its granules' floats: (1, 4) in a 4-row group
        assert cases.sector_bound_bytes(layout, head_dim, 1, [0, 1], granule=64) == \
            2 * cases.sector_bound_bytes(layout, head_dim, 1, [0, 1]) - head_dim * 2


def test_devices_mode_programs_shard_without_collectives():
    """--devices' sharded programs (batch, heads) compile with no collective (8 CPU devices stand in for GPUs; the
    measurement itself needs GPUs), and the collective finder finds the ones a gathered axis needs."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from benchmarks import devices

    cpus = jax.devices("cpu")
    if len(cpus) < 2:
        pytest.skip("needs several CPU devices")
    layout = cases.AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
    B, H, S = 2, 4, 200
    acc = jax.ShapeDtypeStruct(layout.accum_shape(B, H, S, 128), np.float32)
    mesh = Mesh(np.array(cpus[:2]), ("d",))
    for spec in (P("d", None, None), P(None, "d", None)):
        sharding = NamedSharding(mesh, spec)
        text = jax.jit(devices.program(layout, 128, S), in_shardings=([sharding] * 2,)).lower([acc] * 2).compile()
        assert devices.collectives(text.as_text()) == [], spec
    gathered = jax.jit(lambda x: x.sum(), in_shardings=NamedSharding(mesh, P("d"))).lower(
        jax.ShapeDtypeStruct((8,), np.float32)).compile().as_text()
    assert devices.collectives(gathered), gathered


@pytest.mark.parametrize("with_torch", [True, False], ids=["torch", "no-torch"])
def test_main_reports_from_measurements(tmp_path, monkeypatch, capsys, with_torch):
    """The report path of `python -m benchmarks` (tables, JSON, plot) on synthetic measurements, so a
    GPU run never fails on its printing; without torch the graph-replay columns are skipped with a message, the
    others still run. The measurements themselves need a GPU (recorded runs)."""
    import sys
    import types

    def fake_measure(case, samples, wall=True):
        t = case.bytes / 4e12
        r = {"config": case.name, "packing": case.packing, "bytes": case.bytes, "tokens": case.tokens,
             "xla_device": t * 0.99, "ours_jax_device": t}
        if wall:
            r.update(ours_jax=t * 1.1, xla_same_bytes=t * 1.05, jnp_gather=t * 4)
        if case.torch is not None:
            r.update(ours=t, FA4=t * 1.01, copy=t * 0.98)
        if case.cu is not None:
            r.update(sequences=len(case.cu) - 1, ctas=case.ctas, tile_ctas=case.tile_ctas, cu=list(case.cu))
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

    def fake_short(case, samples):
        lengths = np.diff(case.cu)
        t = case.bytes / 2e12
        r = {"config": case.name, "packing": "varlen", "traced": case.traced, "sequences": len(lengths),
             "max_length": int(lengths.max()), "tokens": case.tokens, "bytes": case.bytes,
             "bound_bytes": int(case.bytes * 1.1), "granule_bound_bytes": int(case.bytes * 1.3), "ctas": case.ctas,
             "ours_jax_device": t}
        if case.torch is not None:
            r["ours"] = t
        return r

    monkeypatch.setattr(cases, "measure_short", fake_short)
    monkeypatch.setattr(probes, "chain_cost", lambda samples: {
        "shape": [1, 80, 1, 128], "calls": 200, "our_calls_in_program": 200, "ours": 3e-6, "ours_program_1": 1e-4,
        "ours_program_n": 7e-4, "ours_outputs_returned": 8e-6, "xla_kernels_in_program": 199,
        "xla_elementwise": 1.3e-6, "ours_device": {"kernels": 200, "per_call": 2e-6, "median_duration": 1.8e-6,
                                                   "median_gap": 2e-7}})
    start = {"import_jax": 1.0, "import_jax_dqpost": 0.03, "configs": [{"head_dim": 64, "get_kernel": 0.3,
                                                                         "first_result": 0.35}]}
    monkeypatch.setattr(probes, "start_costs", lambda: {"cold": start, "warm": start})
    monkeypatch.setattr(probes, "jax_path_costs", lambda: {"default": {"rotated_inputs": 1e-4}})
    step_row = dict(packing="dense", head_dim=128, batch=1, seqlen=1024, tokens=1024, bytes=25_000_000,
                    wall_us=9.0, slot_us=6.0, gap_us=0.5)
    monkeypatch.setattr(step, "measure", lambda quick: {
        "launched": [dict(step_row, slot="ours", slot_us=7.5, gap_us=2.0), dict(step_row, slot="xla")],
        "captured": {"error": "the child failed"}})
    try:
        import matplotlib  # noqa: F401
        has_plot = True
    except ImportError:
        has_plot = False
    assert bench_main.main(["--out", str(tmp_path), "--quick"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "short sequences, hd128" in out and "per-call cost in a jitted chain" in out
    assert "goal short of dense >= 75%" in out and "goal short of sector bound >= 75%" in out
    assert "goal short of granule bound >= 75%" in out
    assert "fused dQ + dK + dV (+ dsink) in one launch" in out and "hd128-dense-sink" in out
    assert "GPU timeline (jax.profiler, one execution): ours 2.00 us per call" in out
    assert "| hd128 B=1 S=1024 | 25.0 | launched | 7.5 | 6.0 | 1.250 | 2.00 / 0.50 | 9.0 / 9.0 |" in out
    assert "the child failed" in out
    assert ("torch is not installed" in captured.err) == (not with_torch)
    result = json.loads((tmp_path / "bench.json").read_text())
    assert len(result["reference"]) == 2 * len(cases.CONFIGS)
    measured = [r["cu"] for r in result["reference"] + result["sweep"] if "cu" in r]
    assert measured == _lengths_in_the_benchmarks_order(cases.SIZES[::2])  # --quick: its own sizes' draw
    assert len(result["short"]) == 2 * len(cases.SHORT_SEQUENCES)
    assert all(("ours" in r) == with_torch and "xla_same_bytes" in r for r in result["reference"])
    assert (tmp_path / "bench.png").exists() == has_plot


def _lengths_in_the_benchmarks_order(sizes):
    """Every varlen row's ``cu_seqlens`` as the benchmark draws them, written out here independently of
    ``cases.benchmark_cases``: one generator seeded 0, every configuration's reference shape (dense, varlen), then
    each configuration's, packing's and size's row."""
    rng, out = np.random.default_rng(0), []
    todo = [(c, p, None) for c in cases.CONFIGS for p in cases.PACKINGS]
    todo += [(c, p, s) for c in cases.CONFIGS for p in cases.PACKINGS for s in sizes]
    for (_, head_dim, _), packing, size in todo:
        if packing == "varlen":
            B, _, S = cases.problem(head_dim, size)
            count = cases.REFERENCE_SEQUENCES if size is None else cases.pack_size(B * S)
            out.append(cases.random_lengths(rng, B * S, count))
    return out


def test_the_kernel_tools_measure_the_benchmarks_rows():
    """`ncu_kernels` times and profiles the size sweep's rows with the lengths a full `python -m benchmarks` run
    draws: the reference rows first, then each configuration's sizes, every varlen row a pack of 2-8 lengths."""
    from benchmarks import ncu_kernels

    rows = list(cases.benchmark_cases(None, None))
    assert [size for size, _ in rows[:2 * len(cases.CONFIGS)]] == [None] * 2 * len(cases.CONFIGS)
    assert [case.cu for _, case in rows if case.cu is not None] == _lengths_in_the_benchmarks_order(cases.SIZES)
    names = [c[0] for c in cases.CONFIGS]
    for size in cases.SIZES[1:]:
        picked = ncu_kernels.sweep_rows(names, size, None, None)
        expected = {(case.name, case.packing): case.cu for s, case in rows if s == size}
        assert {key: case.cu for key, case in picked.items()} == expected
        packs = [len(cu) - 1 for cu in expected.values() if cu is not None]
        assert len(packs) == len(names) and all(2 <= n <= 8 for n in packs), packs


@pytest.mark.parametrize("command, args, message", [
    ("profile", ["--bytes"], "argument --bytes: expected one argument"), ("profile", ["--bytes", "hd128"], "got 'hd128'"),
    ("profile", ["--bytes", "123"], "got '123'"), ("profile", ["hd7"], "unknown configurations ['hd7']"),
    ("profile", ["--bytes", "1048576", "--bytes", "16777216"], "given once, got 1048576 and 16777216"),
    ("sizes", ["--bytes", "4096"], "of 65536 to 4294967296 bytes, got '4096'"),
    ("sizes", ["hd96", "--bytes"], "argument --bytes: expected one argument"),
    ("sizes", ["--bytes", "8388608", "--bytes", "8388608"], "--bytes 8388608 is given twice"),
    ("sizes", ["hd128", "hd7"], "unknown configurations ['hd7']"), ("sweep", ["hd7"], "unknown configurations ['hd7']"),
    ("sweep", ["--bytes", "1048576"], "unrecognized arguments: --bytes"), ("sizes", ["--bytes", "8589934592"], "got '85"),
    ("sizes", ["--bytes", "\u00b2"], "got '\u00b2'"), ("short", ["66"], "unknown sequence counts ['66']"),
    ("short", ["--l2-fetch"], "argument --l2-fetch: expected one argument"), ("short", ["--l2-fetch", "-1"], "got '-1'"),
    ("short", ["64", "--l2-fetch", "32", "--l2-fetch", "64"], "got '32' and another"),
    ("sizes", ["--variants", "splits"], "got 'splits'"), ("sizes", ["--variants"], "argument --variants: expected one argument"),
    ("sizes", ["--variants", "split,split"], "each once"), ("sizes", ["--variants", ""], "got ''"),
    ("sizes", ["--variants", "split", "--variants", "short"], "got 'split' and another"),
    ("sweep", ["--variants", "split"], "unrecognized arguments: --variants"),
    ("profile", ["--variants", "split"], "unrecognized arguments: --variants"),
    ("short", ["--variants", "split"], "unrecognized arguments: --variants"),
    ("sizes", ["--bytes", "--variants", "split", "1048576"], "argument --bytes: expected one argument")])
def test_kernel_tools_name_a_bad_argument(command, args, message, capsys, monkeypatch):
    from benchmarks import ncu_kernels

    monkeypatch.setitem(sys.modules, "torch", None)  # a bad argument is named before torch is imported

    with pytest.raises(SystemExit) as exit_:
        ncu_kernels.parse([command, *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert ncu_kernels.main([command, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ncu_kernels {command}: error: ") and message in err and err.count("\n") == 1


def test_kernel_tools_name_a_bad_command(capsys):
    from benchmarks import ncu_kernels

    assert ncu_kernels.main(["profiles"]) == 2 and "invalid choice: 'profiles'" in capsys.readouterr().err


def test_kernel_tools_arguments_and_their_defaults():
    from benchmarks import ncu_kernels

    configs = [c[0] for c in cases.CONFIGS]

    def command_args(*argv):
        args = ncu_kernels.parse(list(argv))
        return args.bytes, args.configs
    assert command_args("profile", "hd128", "--bytes", str(cases.SIZES[2])) == ([cases.SIZES[2]], ["hd128"])
    assert command_args("profile", "--bytes", str(cases.SIZES[2])) == ([cases.SIZES[2]], configs)
    assert command_args("profile") == ([], ["hd96", "hd128", "hd192"])
    assert command_args("sizes") == (cases.SIZES[1:], configs)
    assert command_args("sizes", "--bytes", "8388608", "hd64", "--bytes", str(cases.SIZES[2])) == \
        ([8388608, cases.SIZES[2]], ["hd64"])
    assert command_args("sweep", "hd256") == ([], ["hd256"])
    short = ncu_kernels.parse(["short", "ref", "8000", "--l2-fetch", "64"])
    assert (short.l2_fetch, short.counts) == (64, ["ref", "8000"])
    short = ncu_kernels.parse(["short"])
    assert (short.l2_fetch, short.counts) == (None, [])
    groups = tuple(ncu_kernels.SIZE_VARIANTS)
    assert ncu_kernels.parse(["sizes", "hd64", "--bytes", "8388608"]).variants == groups
    sizes = ncu_kernels.parse(["sizes", "hd64", "--variants", "short,split"])
    assert (sizes.variants, sizes.configs) == (("short", "split"), ["hd64"])
    for sizes in (cases.SIZES, cases.SIZES[::2], []):
        assert cases.benchmark_rows(sizes) == len(list(cases.benchmark_cases(None, None, sizes)))


def test_kernel_tools_measure_sizes_off_the_sweep_with_lengths_of_their_own():
    """`ncu_kernels sizes --bytes N` takes the benchmark's rows at its sweep's sizes and builds the others, each
    configuration dense and varlen, the varlen lengths from a generator seeded by the size (the same in every run);
    `short` measures the benchmark's short-sequence lengths against its hd128 reference rows."""
    from benchmarks import ncu_kernels

    rows = list(ncu_kernels.size_rows(["hd64", "hd192"], [8388608, cases.SIZES[2]], None, None))
    assert [(size, case.name, case.packing) for size, case in rows] == \
        [(cases.SIZES[2], n, p) for n in ("hd64", "hd192") for p in cases.PACKINGS] + \
        [(8388608, n, p) for n in ("hd64", "hd192") for p in cases.PACKINGS]
    at_sweep = [case.cu for s, case in cases.benchmark_cases(None, None) if s == cases.SIZES[2] and
                case.name in ("hd64", "hd192")]
    assert [case.cu for _, case in rows[:4]] == at_sweep
    alone = list(ncu_kernels.size_rows(["hd192"], [8388608], None, None))  # lengths whatever else is named
    assert [case.cu for _, case in alone] == [case.cu for _, case in rows[6:]]
    assert 2 <= len(rows[5][1].cu) - 1 <= 8 and rows[5][1].cu != rows[7][1].cu
    assert all(abs(case.bytes - 8388608) < 0.05 * 8388608 for _, case in rows[4:])
    default = list(ncu_kernels.size_rows([c[0] for c in cases.CONFIGS], cases.SIZES[1:], None, None))
    assert [(s, c.name, c.packing, c.cu) for s, c in default] == \
        [(s, c.name, c.packing, c.cu) for s, c in cases.benchmark_cases(None, None) if s not in (None, cases.SIZES[0])]
    dense, ref = ncu_kernels.short_reference(None, None)
    reference = dict(((case.name, case.packing), case) for size, case in cases.benchmark_cases(None, None)
                     if size is None)
    assert (dense.packing, ref.cu) == ("dense", reference["hd128", "varlen"].cu) and len(ref.cu) == 65
    short = list(cases.short_cases(None, None))
    assert [c.cu for c in short[::2]] == [c.cu for c in short[1::2]]  # static and traced: the same lengths
    assert [c.cu for c in short] == [c.cu for c in cases.short_cases(None, None)]
    measured = json.loads((ROOT / "docs" / "bench.json").read_text())["short"]  # what a full run measured
    assert [(len(c.cu) - 1, int(np.diff(c.cu).max()), c.traced) for c in short] == \
        [(r["sequences"], r["max_length"], r["traced"]) for r in measured]


def _run_cli(args, block=()):
    """``python -m benchmarks ARGS`` in a fresh process in the repository root, as a user runs it, with the modules
    in ``block`` unimportable."""
    code = ("import sys; [sys.modules.__setitem__(m, None) for m in sys.argv[1].split(',') if m]; "
            "from benchmarks.__main__ import main; sys.exit(main(sys.argv[2:]))")
    return subprocess.run([sys.executable, "-c", code, ",".join(block), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def test_cli_without_a_gpu_says_so_in_one_line_and_writes_nothing(tmp_path):
    from jax_dqpost._kernel import arch

    if arch.cuda_devices():
        pytest.skip("this machine has a GPU: the benchmark would run")
    out = _run_cli(["--out", str(tmp_path / "results")], block=("torch",))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in out.stderr, out.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("module", ["fa4jax", "attention"])
def test_the_fa4jax_benchmarks_without_a_gpu_say_why_in_one_line(tmp_path, module):
    """Without fa4-jax, or without a GPU: exit status 2, one line naming what is missing, nothing written."""
    from jax_dqpost._kernel import arch

    if arch.cuda_devices():
        pytest.skip("this machine has a GPU: the benchmark would run")
    out = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--out", str(tmp_path / "results")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "needs a CUDA GPU" in out.stderr or "pip install fa4-jax==0.1.0" in out.stderr, out.stderr
    assert not (tmp_path / "results").exists()


def test_cli_plot_without_matplotlib_says_what_to_install(tmp_path):
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps({"sweep": [], "gpu": "x", "date": "today", "commit": "abc"}))
    out = _run_cli(["--plot", str(saved), "--out", str(tmp_path / "plots")], block=("matplotlib",))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "matplotlib is not installed" in out.stderr and 'pip install ".[bench]"' in out.stderr, out.stderr
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


def test_a_report_records_the_commit_or_unknown(tmp_path, monkeypatch):
    """$JAX_DQPOST_COMMIT (a copy of the tree without its history), else the checkout's HEAD; without git, or where
    benchmarks/ is not at the root of a checkout, "unknown" and never an exception."""
    monkeypatch.setenv("JAX_DQPOST_COMMIT", "abc1234")
    assert harness.commit() == "abc1234"
    monkeypatch.delenv("JAX_DQPOST_COMMIT")
    head = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True)
    lines = head.stdout.splitlines()
    if head.returncode == 0 and Path(lines[0]).resolve() == ROOT:
        assert harness.commit() == lines[1]
    with monkeypatch.context() as m:
        m.setattr(harness, "__file__", str(tmp_path / "benchmarks" / "harness.py"))  # not in a checkout
        assert harness.commit() == "unknown"
    monkeypatch.setenv("PATH", str(tmp_path))  # no git
    assert harness.commit() == "unknown"


def test_only_internals_imports_private_apis():
    """The benchmark imports jax_dqpost's public names (``__all__``, ``jax_dqpost.fa4jax``) anywhere and its private
    modules in benchmarks/internals.py alone."""
    import ast

    import jax_dqpost

    public = set(jax_dqpost.__all__) | {"fa4jax"}
    seen = 0
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jax_dqpost":
                names = {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                names = {a.name.removeprefix("jax_dqpost.") for a in node.names if a.name.startswith("jax_dqpost.")}
            else:
                continue
            private = names - public if getattr(node, "module", None) in (None, "jax_dqpost") else {node.module}
            seen += bool(names)
            if path.name != "internals.py":
                assert not private, f"benchmarks/{path.name}: {ast.unparse(node)}"
    assert seen > 5


def test_resume_goes_on_only_with_an_unfinished_run_of_the_same_setup_and_package(tmp_path):
    """``--resume`` keeps a cut-short run's measurements only where the new ones are comparable: an unfinished run of
    the same GPU, jax, FlashAttention and samples, and a package of the same sources (by git, where the commits
    differ)."""
    _cannot_resume = bench_main._cannot_resume
    now = {"gpu": "NVIDIA H200", "jax": "0.11.2", "flash_attn": "4.0.0b36", "samples": 25, "method": "m",
           "commit": "abc1234"}
    kept = {**now, "complete": False}
    assert _cannot_resume(kept, now) is None
    assert _cannot_resume({**kept, "complete": True}, now) == "that run is complete"
    assert _cannot_resume({**kept, "samples": 9}, now) == "its samples is 9, this run's 25"
    assert _cannot_resume({**kept, "gpu": "NVIDIA H100"}, now) == "its gpu is 'NVIDIA H100', this run's 'NVIDIA H200'"
    why = _cannot_resume({**kept, "commit": "0000000"}, now)  # no such commit: git cannot tell
    assert why.startswith("it measured commit 0000000, whose jax_dqpost/, ffi/ or benchmarks/ differ"), why
    assert _cannot_resume({**kept, "method": "other"}, {**now, "method": "ours"}) == ("its method is 'other', this "
                                                                                      "run's 'ours'")


def test_step_shapes_are_one_layers_dq_from_ten_megabytes(rng):
    """The in-step shapes: H=32, head dims 64-256, B 1-2 and S 1k-8k dense, packs of 2-8 sequences, every one moving
    at least 10 MB; the quick set is a subset; the sweep's varlen rows pack 2-8 sequences (1 if there are fewer
    tokens)."""
    full, quick = step.shapes(False), step.shapes(True)
    assert quick and all(s in full for s in quick)
    for s in full:
        assert s["head_dim"] in (64, 128, 256)
        if s["packing"] == "dense":
            assert s["batch"] in (1, 2) and 1024 <= s["seqlen"] <= 8192
        else:
            assert 2 <= s["sequences"] <= 8
        assert s["tokens"] * step.H * s["head_dim"] * 6 >= 10e6, s
    assert [cases.pack_size(t) for t in (1, 3, 1000, 4096, 10_000, 1 << 20)] == [1, 2, 2, 2, 5, 8]
    for size in cases.SIZES:
        case = cases.Case("x", 128, False, "varlen", size, rng, None, None)
        assert len(case.cu) - 1 == cases.pack_size(case.tokens) and case.cu[-1] == case.tokens


def test_step_spans_are_read_from_the_kernel_before_the_slot(rng):
    """The timeline arithmetic of benchmarks/step.py on a synthetic trace: programs split at the marker kernels, each
    program's executions into equal runs, our kernel's places found in the ``ours`` program and checked to hold one
    other kernel in the ``xla`` one, and per slot end(slot) - end(previous) and start(slot) - end(previous), negative
    where the slot starts early (ns in, us out), against values written out by hand."""
    t, events, want = 0, [], {"slot": [], "gap": []}
    slot_names = (harness.OUR_KERNEL + "_0", "loop_convert_fusion")
    for program in range(2):
        events.append((t, t + 100, "loop_sine_fusion"))
        t += 1000
        for _ in range(3):  # executions: producer, slot, consumer, producer, slot, consumer
            for _ in range(2):
                p_end = t + int(rng.integers(500, 900))
                events.append((t, p_end, "loop_multiply_fusion"))
                gap = int(rng.integers(-300, 3000))
                s_end = p_end + max(gap, 0) + int(rng.integers(1000, 5000))
                events.append((p_end + gap, s_end, slot_names[program]))
                c_end = s_end + 400
                events.append((s_end + 10, c_end, "loop_add_fusion"))
                t = c_end + 5
                if program == 1:
                    want["slot"].append((s_end - p_end) * 1e-3)
                    want["gap"].append(gap * 1e-3)
            t += 20_000
    ours, xla = step._split(events, 2)
    assert len(ours) == len(xla) == 18
    positions = step._slot_positions(ours, 3)
    assert positions == [1, 4]
    step._check_same_places(xla, 3, positions)
    got = step._spans(xla, 3, positions)
    assert got["kernels_per_execution"] == 6 and got["slot_kernel"] == "loop_convert_fusion"
    assert got["slot_us"] == pytest.approx(np.median(want["slot"]))
    assert got["gap_us"] == pytest.approx(np.median(want["gap"]))
    with pytest.raises(RuntimeError, match="marker"):
        step._split(events[1:], 2)
    with pytest.raises(RuntimeError, match="executions"):
        step._spans(xla[:-1], 3, positions)
    with pytest.raises(RuntimeError, match="slot's kernels"):  # another kernel where ours was: not the same program
        step._check_same_places(xla, 3, [0, 4])


class _FakeGpu:
    """A stand-in for torch's CUDA events and graphs (``harness.graph_per_call``): a device clock that an eager call
    advances by its launch cost and a replayed call by its device time."""

    def __init__(self, launch_s: float, device_s: float):
        self.now, self.launch_s, self.device_s, self.capturing, self.samples = 0.0, launch_s, device_s, None, []
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = gpu.now

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                gpu.samples.append(other.t - self.t)
                return (other.t - self.t) * 1e3  # ms

        class CUDAGraph:
            def __init__(self):
                self.calls = 0

            def replay(self):
                gpu.now += self.calls * gpu.device_s

        class Capture:
            def __init__(self, graph, **_):
                self.graph = graph

            def __enter__(self):
                gpu.capturing = self.graph

            def __exit__(self, *_):
                gpu.capturing = None

        self.cuda = type("cuda", (), dict(Event=Event, CUDAGraph=CUDAGraph, Stream=lambda: None, graph=Capture,
                                          synchronize=staticmethod(lambda: None)))

    def run(self, n):
        if self.capturing is not None:
            self.capturing.calls += n
        else:
            self.now += n * max(self.launch_s, self.device_s)


@pytest.mark.parametrize("launch_s, device_s", [(28e-6, 1.1e-6), (10e-6, 250e-6), (5e-6, 3e-3)])
def test_graph_samples_last_five_milliseconds_of_device_time(launch_s, device_s):
    """Launch-bound tiny calls and long ones alike: every timed replay lasts about ``GRAPH_SAMPLE_S`` (or holds
    ``MAX_GRAPH_CALLS`` calls, or is one call longer than that), and the per-call time is the device's."""
    gpu = _FakeGpu(launch_s, device_s)
    per_call, eager = harness.graph_per_call(gpu, gpu.run, 2, 9)
    assert per_call == pytest.approx(device_s) and eager == pytest.approx(max(launch_s, device_s))
    replays = gpu.samples[-9:]
    assert replays == pytest.approx([replays[0]] * 9)
    calls = round(replays[0] / device_s)
    if device_s * 2 > harness.GRAPH_SAMPLE_S:
        assert calls == 2  # the fewest: one sample is one graph of the calls rotated through
    else:
        assert calls % 2 == 0
        assert harness.GRAPH_SAMPLE_S <= replays[0] * (1 + 1e-9) < harness.GRAPH_SAMPLE_S + 2 * device_s


def test_the_attention_benchmarks_table_and_shapes():
    """gpt-oss's shapes (hd 64, 64/8 heads, window (127, 0) and causal) and a llama-like one (hd 128, 32/8 heads), T 4096
    and 8192; the table's ratios are the goals' (cuDNN over 'fa4', 'xla' over 'fa4' with sinks, the sinks' cost,
    jax.nn's 'xla' over ours)."""
    from benchmarks import attention

    shapes = attention.shapes(quick=False)
    assert {(s["head_dim"], s["heads"], s["heads_kv"], s["window"], s["seqlen"]) for s in shapes} == {
        (d, n, k, w, t) for t in (4096, 8192) for d, n, k, w in ((64, 64, 8, 127), (64, 64, 8, None),
                                                                  (128, 32, 8, None))}
    result = dict(shapes[0], **{name: {"step_us": us} for name, us in
                                (("fa4", 100.0), ("fa4 sinks", 101.0), ("cudnn", 150.0), ("xla sinks", 2000.0),
                                 ("xla_chunked sinks", 3000.0), ("xla", 1800.0), ("jax.nn xla", 1980.0))})
    result["xla sinks"]["memory_mib"], result["xla_chunked sinks"]["memory_mib"] = 16384.4, 300.2
    row = attention.table([result]).splitlines()[-1]
    assert row == ("| gpt-oss, window (127, 0) | 4096 | 100.0 | 101.0 | +1.0% | 150.0 | 1.50x | 2000.0 | 19.80x | "
                   "3000.0 | 16384 / 300 | 1800.0 | 1980.0 | 1.10x |"), row
    del result["cudnn"]
    result["xla sinks"] = {"memory_mib": 16384.4}  # compiled, skipped: it would not fit
    assert "| 150.0 |" not in attention.table([result]) and "| skipped | n/a | 3000.0 | 16384 / 300 |" in \
        attention.table([result])


def test_context_parallel_paper_and_a_run_over_two_devices(tmp_path, capsys):
    """``benchmarks.context_parallel``: the cost on paper is its formulas (two devices receive half of K and V, and
    compute half of the causal FLOPs each), and ``--devices 2`` runs the three measured rows on two of this machine's
    devices, writing them."""
    from benchmarks import context_parallel

    if len(jax.devices()) < 2:
        pytest.skip(f"two devices of the default backend needed, {len(jax.devices())} here")
    rows = {(r["shape"], r["tokens"], r["devices"]): r for r in context_parallel.paper()}
    r = rows[("gpt-oss", 32 * 1024, 2)]
    assert r["gathered_mib"] == r["kv_mib"] / 2 == 2 * 32 * 1024 * 8 * 64 * 2 / 2 ** 21
    assert r["tflops"] == 2 * (32 * 1024) ** 2 * 64 * 64 / 2 / 1e12
    assert rows[("gpt-oss", 32 * 1024, 64)]["ratio"] > 1 > rows[("gpt-oss", 32 * 1024, 8)]["ratio"]
    assert context_parallel.main(["--devices", "2", "--seqlen", "64", "--steps", "1", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "context_parallel.json").read_text())["measured"]
    assert [w["name"].split(",")[0] for w in written] == ["batch sharded over 2", "sequence sharded under jax.jit "
                                                         "over 2", "context parallel over 2"]
    assert all(w["one_s"] > 0 and w["sharded_s"] > 0 for w in written)
    assert "speed-up" in capsys.readouterr().out
