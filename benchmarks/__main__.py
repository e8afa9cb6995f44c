"""Benchmark of the dQ postprocess on the local GPU, every implementation side by side in one run:

    python -m benchmarks [--out DIR] [--quick]       (from the repository root; benchmarks/README.md)

For FlashAttention's Hopper configurations (head dims 64, 96, 128, 128 causal, 192, 256), dense and varlen (at the
reference shape 64 random lengths, the same tokens; in the size sweep packs of 2 to 8, ``cases.pack_size``), sizes
from 64 KB to 1 GB moved per call, it times

- ``ours``: our CuTe kernel (the module the FFI target runs), launched from a torch stream;
- ``FA4``: FlashAttention-4's postprocess (``flash_attn.cute``), when importable;
- ``copy``: a device-to-device copy of the same number of bytes;
- ``ours_jax``: ``jax.jit(dq_postprocess)`` called from Python, pipelined (wall clock per call);
- ``xla_same_bytes``: XLA's own fused ``(acc * scale).astype(bf16)`` of the same accumulator, likewise;
- ``jnp_gather``: what a JAX user writes without this package (a gather by the tile order, a multiply and a
  cast), likewise.

The first three are captured in a CUDA graph of back-to-back calls and timed with CUDA events around its replay
(device time); they need torch, and the others run without it. Each sample cycles through enough distinct
buffers (>= 256 MiB) that no call finds its data in L2; the median of the samples is reported. Bandwidth counts
the useful bytes of a call: for every row of dQ, the accumulator's row (4 bytes per element, head dim padded as
the producer stores it) and the row written (2 bytes per element). ``xla_device`` is XLA's fused op of exactly the
useful bytes in device time from jax.profiler's timeline (the roofline the goals are set against), beside our op's
(``ours_jax_device``); the wall-clock columns are taken at the reference shape only. It also sweeps short sequences
(64 to 8000 random lengths over 16384 tokens, hd128, static and traced offsets, against a sector bound), the per-call
cost in a jitted chain of 200 tiny calls, cold and warm start, the jax.jit path with and without XLA's command
buffers, and the op inside a step (``benchmarks/step.py``). Prints tables, writes ``bench.json`` (and
``bench.png`` with matplotlib: device times only, of every row) into ``--out``; progress goes to stderr. ``--plot
JSON`` only redraws the plot of a saved report; ``--devices N`` only compares one GPU with N (sharded over batch and
over heads, device time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

EXTRAS = 'python -m pip install ".[bench]"'


def _import_optional(name: str, what: str):
    try:
        return __import__(name)
    except ImportError:
        print(f"{name} is not installed: {what} ({EXTRAS} installs it)", file=sys.stderr)
        return None


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    # The docstring's first line, as a sentence (there a colon leads into the list of what is timed).
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.split("\n")[0].rstrip(":") + ".")
    parser.add_argument("--out", default="bench_results", help="directory for bench.json and bench.png")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and samples")
    parser.add_argument("--samples", type=int, default=None, help="samples per measurement (median)")
    parser.add_argument("--plot", metavar="JSON", help="only redraw the plot of a saved bench.json into --out")
    parser.add_argument("--resume", metavar="JSON",
                        help="go on with a bench.json cut short (its measurements kept, the missing ones taken; the "
                             "package must be the one it measured: the same jax_dqpost/ and ffi/)")
    parser.add_argument("--fused-only", action="store_true",
                        help="only the fused dQ/dK/dV(/dsink) cases at grouped-query attention shapes")
    parser.add_argument("--devices", type=int, metavar="N",
                        help="only the reference shape on one GPU against N GPUs of this host, sharded over batch "
                             "and over heads (device time)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.plot:
        try:
            report = json.loads(Path(args.plot).read_text())
        except (OSError, ValueError) as e:
            parser.error(f"--plot {args.plot}: cannot read a report: {e}")
        if _import_optional("matplotlib", "--plot draws with it") is None:
            return 1
        from .report import plot

        out.mkdir(parents=True, exist_ok=True)
        plot(report, out / "bench.png")
        print(f"wrote {out / 'bench.png'}")
        return 0

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
    import jax

    if jax.default_backend() != "gpu":
        print(f"python -m benchmarks needs a CUDA GPU visible to JAX (JAX's backend here: "
              f"{jax.default_backend()})", file=sys.stderr)
        return 1
    torch = _import_optional("torch", "the ours/FA4/copy columns (CUDA-graph replay) are skipped")
    if torch is not None and not torch.cuda.is_available():
        print("torch sees no CUDA GPU: the ours/FA4/copy columns are skipped", file=sys.stderr)
        torch = None
    fa4 = None
    if torch is not None:
        try:
            from flash_attn.cute.interface import _bwd_postprocess_convert as fa4
        except Exception as e:  # noqa: BLE001 - any failure to import the peer only empties its column
            print(f"FlashAttention-4 not importable ({type(e).__name__}: {e}); its columns stay empty",
                  file=sys.stderr)
    has_plot = _import_optional("matplotlib", "no bench.png") is not None

    from . import cases, fused, harness, probes, report as report_, step

    samples = args.samples or (9 if args.quick else 25)
    sizes = cases.SIZES[::2] if args.quick else cases.SIZES
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "commit": harness.commit(), "gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
              "flash_attn": _version("flash-attn-4") or _version("flash_attn"), "samples": samples,
              "method": cases.METHOD, "reference": [], "sweep": []}
    out.mkdir(parents=True, exist_ok=True)
    kept = {}
    if args.resume:
        kept = json.loads(Path(args.resume).read_text())
        why = _cannot_resume(kept, report)
        if why:
            parser.error(f"--resume {args.resume}: {why}")
        report = {**kept, "resumed": {"date": report["date"], "commit": report["commit"]}}

    def save(done: bool = False):  # after every measurement: a run cut short keeps what it measured
        (out / "bench.json").write_text(json.dumps({**report, "complete": done}, indent=1) + "\n")

    if args.devices is not None:
        from . import devices

        if args.devices < 2:
            parser.error(f"--devices must be at least 2, got {args.devices}")
        report["devices"] = devices.measure(args.devices, samples)
        save(done=True)
        print(devices.table(report["devices"]))
        print(f"\nwrote {out / 'bench.json'}")
        return 0 if "error" not in report["devices"] else 1
    report["fused_method"] = fused.METHOD
    if "fused" not in kept:
        report["fused"] = fused.measure(samples, torch, fa4, np.random.default_rng(2))
    save(done=args.fused_only)
    if args.fused_only:
        print(fused.table(report["fused"]))
        print(f"\nwrote {out / 'bench.json'}")
        return 0
    # the reference shape of every configuration first (the tables), then the size sweeps (the plot)
    rows = cases.benchmark_rows(sizes)
    for k, (size, case) in enumerate(cases.benchmark_cases(torch, fa4, sizes)):  # every case draws its lengths
        if k < len(kept.get("reference", [])) + len(kept.get("sweep", [])):
            continue  # kept from the run that was cut short
        harness.log(f"[{k + 1}/{rows}] {case.name} {case.packing} "
                    f"{'B,H,S=' + str(cases.REFERENCE_SHAPE) if size is None else size}")
        r = cases.measure(case, samples, wall=size is None)
        report["reference" if size is None else "sweep"].append(r)
        save()
    report["short"] = list(kept.get("short", []))
    for k, case in enumerate(cases.short_cases(torch, fa4)):
        if k < len(kept.get("short", [])):
            continue
        harness.log(f"short sequences: {case.name} {'traced' if case.traced else 'static'}")
        report["short"].append(cases.measure_short(case, samples))
        save()
    for name, what, probe in (("chain", "chain of 200 tiny calls", lambda: probes.chain_cost(samples)),
                              ("start", "cold and warm start", probes.start_costs),
                              ("jax_path", "jax path with and without command buffers", probes.jax_path_costs),
                              ("step", "the postprocess inside a step", lambda: step.measure(args.quick))):
        if name not in kept:
            harness.log(what)
            report[name] = probe()
            save()
    save(done=True)
    if has_plot:
        report_.plot(report, out / "bench.png")
    print(report_.summary(report))
    print(f"\nwrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if has_plot else ""))
    return 0


def _cannot_resume(kept: dict, now: dict) -> str | None:
    """Why a run cut short (``kept``, its bench.json) cannot go on in this one (``now``'s header), or None: it must
    be unfinished, of the same GPU, jax, FlashAttention, samples and method, and of the same package and benchmark
    sources (each section draws from its own random generator, so the cases go on as in a run never cut short)."""
    if kept.get("complete"):
        return "that run is complete"
    for key in ("gpu", "jax", "flash_attn", "samples", "method"):
        if kept.get(key) != now[key]:
            return f"its {key} is {kept.get(key)!r}, this run's {now[key]!r}"
    if kept.get("commit") != now["commit"]:
        root = Path(__file__).resolve().parents[1]
        diff = subprocess.run(["git", "diff", "--quiet", kept.get("commit", ""), "--", "jax_dqpost", "ffi",
                               "benchmarks"], cwd=root, capture_output=True)
        if diff.returncode != 0:
            return (f"it measured commit {kept.get('commit')}, whose jax_dqpost/, ffi/ or benchmarks/ differ from "
                    f"this tree's (or git cannot tell)")
    return None


if __name__ == "__main__":
    sys.exit(main())
