"""Kernel-level evidence for the benchmark's gaps, on the GPU machine (B, H, S = 2, 32, 8192, bf16), from the
repository root:

    python -m benchmarks.ncu_kernels sweep [CONFIG ...]
        graph-replay time of our kernel with tuning variants (fields of its Tuning, VARIANTS; each
        checked bit-equal to the default's output; one that raises for a packing is reported and skipped),
        FlashAttention-4 and the same-bytes copy, side by side, median of 15 (the benchmark's timing), dense and
        varlen (the benchmark's reference rows); CONFIG: default hd96 hd128 hd192
    python -m benchmarks.ncu_kernels sizes [CONFIG ...] [--bytes N ...] [--variants GROUP,...]
        the size sweep's rows from 1 MB to 1 GB (``cases.SIZES``; varlen: packs of 2-8 sequences, the benchmark's
        lengths), or of the sizes N given (64 KiB to 4 GiB; outside the sweep with lengths of their own), ours with
        the default and the tuning variants of SIZE_VARIANTS' groups (all, or those named; a group adds nothing to
        the rows it is not for, e.g. short to dense ones; each checked bit-equal to the default's output) against
        the same-bytes copy, graph replay, median of 15, then each row's fastest
    python -m benchmarks.ncu_kernels short [COUNT ...] [--l2-fetch BYTES]
        the benchmark's short-sequence cases (hd128, 64 to 8000 sequences in 16384 tokens, static and traced offsets;
        COUNT: only those of ``cases.SHORT_SEQUENCES``, "ref": the benchmark's hd128 varlen reference row), ours with
        the tuning variants of SHORT_VARIANTS (each checked bit-equal to the default's output, the default to
        FlashAttention-4's), FlashAttention-4 (static offsets), against our dense hd128 call of the same tokens and
        the sector bound of the lengths. --l2-fetch sets this process's cudaLimitMaxL2FetchGranularity first (an
        experiment: does the L2 fetch DRAM in 64-byte granules?)
    ncu --clock-control none --profile-from-start off --set full python -m benchmarks.ncu_kernels profile hd96 hd128
        one launch of ours (the package's tuning) and one of FlashAttention-4 per dense configuration (default: hd96,
        hd128, hd192), between cudaProfilerStart/Stop (after warm-up), for Nsight Compute's counters; with
        ``--bytes N`` (one of ``cases.SIZES``) the size sweep's rows of N bytes instead (default: every
        configuration; dense, and varlen with the benchmark's lengths), a varlen call of one sequence, and the copy

Configuration names are the benchmark's (``cases.CONFIGS``); the benchmark's rows and lengths are a full run's
(``cases.benchmark_cases``).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from . import cases as bench_cases, harness  # noqa: E402

# Tunings (fields of the kernel's Tuning, in its cache key) tried by `sizes` after the package's choice, by group:
# (which rows, variants); "short": varlen of orders with short tiles. A tuning the kernel cannot take is skipped.
SPLIT_VARIANTS = [{"shares": 1}, {"shares": 2}, {"shares": 4}, {"shares": 8}]
SIZE_VARIANTS = {
    "split": ("all", SPLIT_VARIANTS),
    "short": ("short", [{"short_heads": 1}, {"short_heads": 8}]),
}
# ... by `sweep` per configuration (the first, {}, is the package's choice), and by `short` (varlen only).
VARIANTS = [{}] + SPLIT_VARIANTS
SHORT_VARIANTS = [{}, {"short_heads": 1}, {"short_heads": 8}]


def cases(names, torch, fa4, packings=("dense",), size=None):
    """Each configuration's case of each packing, its torch buffers allocated while it is in use: the benchmark's
    rows (:func:`sweep_rows`) of ``size`` (None: the reference shape; else one of ``cases.SIZES``). Packing
    ``"varlen1"``: varlen, one sequence of all the tokens."""
    configs = {c[0]: c for c in bench_cases.CONFIGS}
    rows = sweep_rows(names, size, torch, fa4)
    for name in names:
        for packing in packings:
            _, D, causal = configs[name]
            if (name, packing) in rows:
                case = rows[name, packing]
            else:
                B, _, S = bench_cases.problem(D, size)
                cu = [0, B * S] if packing == "varlen1" else None
                case = bench_cases.Case(name, D, causal, "varlen" if cu else packing, size, np.random.default_rng(0),
                                        torch, fa4, cu=cu)
            case.torch_buffers()
            yield case
            case.free_torch()


def sweep_rows(names, size, torch, fa4) -> dict:
    """``{(configuration, packing): Case}``: the benchmark's rows of ``size`` bytes (None: the reference shape) of
    these configurations, as ``python -m benchmarks`` builds them (``cases.benchmark_cases``: the same lengths)."""
    return {(case.name, case.packing): case for s, case in bench_cases.benchmark_cases(torch, fa4)
            if s == size and case.name in names}


def size_rows(names, sizes, torch, fa4):
    """``(size, Case)`` of each configuration in ``names`` and packing at each of ``sizes``: the benchmark's rows at
    its sweep's sizes, in its order (:func:`sweep_rows`), then those of other sizes, each configuration's lengths
    drawn from a generator seeded by the size and the configuration."""
    for size, case in bench_cases.benchmark_cases(torch, fa4):
        if size in sizes and case.name in names:
            yield size, case
    for size in sizes:
        if size not in bench_cases.SIZES:
            for k, (name, head_dim, causal) in enumerate(bench_cases.CONFIGS):
                rng = np.random.default_rng([size, k])
                for packing in bench_cases.PACKINGS:
                    if name in names:
                        yield size, bench_cases.Case(name, head_dim, causal, packing, size, rng, torch, fa4)


def sweep(args, torch, fa4, samples=15):
    for case in cases(args.configs, torch, fa4, packings=("dense", "varlen")):
        copy, _ = harness.graph_per_call(torch, case.copy_run(), case.copies, samples)
        rows = [("copy", copy)]
        if fa4 is not None:
            rows.append(("FA4", harness.graph_per_call(torch, case.fa4_run(), case.copies, samples)[0]))
        rows += _time_variants(case, VARIANTS, samples, case.name)
        for label, t in rows:
            print(f"{case.name:13s} {case.packing:7s} {label:45s} {t * 1e6:8.1f} us {case.bytes / t / 1e12:5.2f} TB/s "
                  f"{copy / t:7.1%} of copy", flush=True)


def sizes(args, torch, fa4, samples=15):
    groups = args.variants
    for size, case in size_rows(args.configs, args.bytes, torch, fa4):
        case.torch_buffers()
        copy, _ = harness.graph_per_call(torch, case.copy_run(), case.copies, samples)
        tag = f"{case.bytes / 1e6:8.1f} MB {case.name:13s} {case.packing:7s} {case.ctas:6d} CTAs"
        kinds = {"all"} | ({"varlen"} if case.cu is not None else set())
        if case.cu is not None and case.part.work.short_rows:  # the work list's (internals.varlen_part)
            kinds.add("short")
        variants = [{}] + [v for g in groups if SIZE_VARIANTS[g][0] in kinds for v in SIZE_VARIANTS[g][1]]
        rows = _time_variants(case, variants, samples, tag)
        for label, t in [("copy", copy)] + rows:
            print(f"{tag} {label:60s} {t * 1e6:8.2f} us {copy / t:7.1%} of copy", flush=True)
        same = [(label, t) for label, t in rows if label.endswith("(same bits)")]
        if same:  # the first row is the default's (or, if that failed, the reference of the bits)
            label, t = min(same, key=lambda r: r[1])
            print(f"{tag} fastest: {label} {t * 1e6:.2f} us, {rows[0][1] / t - 1:+.1%} over the first", flush=True)
        case.free_torch()


def _time_variants(case, variants, samples, tag):
    """``(label, seconds per call)`` of ours with each tuning in ``variants`` (graph replay), each one's output
    (poisoned first) checked bit-equal to the first variant's; a variant that cannot compile is reported and skipped."""
    torch, rows, expected = case.torch, [], None
    for tuning in variants:
        try:
            run = case.ours(**tuning)
            case.t_out[0].fill_(float("nan"))
            run(1)
            out = case.t_out[0].view(torch.int16).clone()
            expected = out if expected is None else expected
            same = "same bits" if torch.equal(out, expected) else "DIFFERENT BITS"
            t, _ = harness.graph_per_call(torch, run, case.copies, samples)
        except Exception as e:  # noqa: BLE001 - a variant that cannot compile for this tile
            print(f"{tag} ours {tuning}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        rows.append((f"ours {tuning or 'default'} ({same})", t))
    return rows


def _set_l2_fetch_granularity(nbytes: int) -> int:
    from cuda.bindings import runtime as cudart

    (err,) = cudart.cudaDeviceSetLimit(cudart.cudaLimit.cudaLimitMaxL2FetchGranularity, nbytes)
    assert err == cudart.cudaError_t.cudaSuccess, err
    return harness.l2_fetch_granularity()


def short(args, torch, fa4, samples=15):
    l2_fetch, names = args.l2_fetch, args.counts
    torch.cuda.init()
    granularity = harness.l2_fetch_granularity()
    if l2_fetch is not None:
        granularity = f"{granularity} -> {_set_l2_fetch_granularity(l2_fetch)}"
    print(f"cudaLimitMaxL2FetchGranularity: {granularity}", flush=True)
    dense, ref = short_reference(torch, fa4)
    dense.torch_buffers()
    d, _ = harness.graph_per_call(torch, dense.ours(), dense.copies, samples)
    dense.free_torch()
    print(f"dense hd128 {d * 1e6:.1f} us", flush=True)
    traced = bench_cases.Case("hd128", 128, False, "varlen", None, None, torch, fa4, cu=ref.cu, traced=True)
    todo = ([ref, traced] if not names or "ref" in names else []) + list(bench_cases.short_cases(torch, fa4))
    for case in todo:
        if names and case.cu is not None and case.name.startswith("hd128-") and \
                case.name[len("hd128-"):-len("seq")] not in names:
            continue
        case.torch_buffers()
        lengths = np.diff(case.cu)
        bound = bench_cases.sector_bound_bytes(case.layout, case.D, case.H, case.cu)
        tag = (f"{case.name:14s} {'traced' if case.traced else 'static'} {len(lengths):5d} seqs 1..{lengths.max():<4d} "
               f"{case.ctas:6d} CTAs")
        rows = []
        if fa4 is not None and not case.traced:
            rows.append(("FA4", harness.graph_per_call(torch, case.fa4_run(), case.copies, samples)[0]))
            print(f"{tag} ours default: {'same' if case.same_bits_as_fa4() else 'DIFFERENT'} bits as FA4", flush=True)
        rows += _time_variants(case, SHORT_VARIANTS, samples, tag)
        for label, t in rows:
            of_bound = d * bound / case.bytes / t
            print(f"{tag} {label:48s} {t * 1e6:8.1f} us  of dense {d / t:6.1%}  of bound {of_bound:6.1%}", flush=True)
        case.free_torch()


def short_reference(torch, fa4):
    """``short``'s yardsticks: the benchmark's hd128 reference rows, dense and varlen (:func:`sweep_rows`)."""
    rows = sweep_rows(["hd128"], None, torch, fa4)
    return rows["hd128", "dense"], rows["hd128", "varlen"]


def _is_count(value: str) -> bool:
    return value.isascii() and value.isdigit()


MAX_BYTES = 1 << 32
"""The largest ``--bytes`` of ``sizes`` (its buffers fill 256 MiB or more of the GPU's memory, several per call)."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, ``PROG: error: MESSAGE``, with exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _sizes_bytes(text: str) -> int:
    """``sizes``' ``--bytes``: a size of ``cases.SIZES[0]`` to :data:`MAX_BYTES` bytes."""
    if not _is_count(text) or not bench_cases.SIZES[0] <= int(text) <= MAX_BYTES:
        raise argparse.ArgumentTypeError(f"a size of {bench_cases.SIZES[0]} to {MAX_BYTES} bytes, got {text!r}")
    return int(text)


def _profile_bytes(text: str) -> int:
    """``profile``'s ``--bytes``: one of the size sweep's sizes."""
    if not _is_count(text) or int(text) not in bench_cases.SIZES:
        raise argparse.ArgumentTypeError(f"one of the size sweep's sizes {bench_cases.SIZES}, got {text!r}")
    return int(text)


def _l2_fetch(text: str) -> int:
    if not _is_count(text):
        raise argparse.ArgumentTypeError(f"a size in bytes, got {text!r}")
    return int(text)


def _variants(text: str) -> tuple[str, ...]:
    """``--variants GROUP,...``: groups of :data:`SIZE_VARIANTS`, each once."""
    groups = text.split(",")
    if not text or any(g not in SIZE_VARIANTS for g in groups) or len(set(groups)) < len(groups):
        raise argparse.ArgumentTypeError(f"groups of {list(SIZE_VARIANTS)}, comma-separated, each once; got {text!r}")
    return tuple(groups)


def parser() -> _Parser:
    """The command line (module docstring): a command, its configurations (or sequence counts) and options."""
    p = _Parser(prog="ncu_kernels", description="Kernel-level evidence for the benchmark's gaps, on the GPU machine.")
    commands = p.add_subparsers(dest="command", required=True)
    configs = ", ".join(c[0] for c in bench_cases.CONFIGS)
    for name, bytes_type, what in (("sweep", None, "the tuning variants at the reference shape"),
                                   ("sizes", _sizes_bytes, "the size sweep's rows, or those of --bytes N"),
                                   ("profile", _profile_bytes, "one launch of each, for Nsight Compute")):
        command = commands.add_parser(name, help=what)
        command.add_argument("configs", nargs="*", metavar="CONFIG", help=f"from {configs}")
        if bytes_type is not None:
            command.add_argument("--bytes", type=bytes_type, action="append", metavar="N")
    commands.choices["sizes"].add_argument("--variants", type=_variants, action="append", metavar="GROUP,...",
                                           help=f"groups of variants, from {', '.join(SIZE_VARIANTS)} (default: all)")
    short_ = commands.add_parser("short", help="the short-sequence cases")
    short_.add_argument("counts", nargs="*", metavar="COUNT",
                        help=f"from {', '.join(map(str, bench_cases.SHORT_SEQUENCES))}, ref")
    short_.add_argument("--l2-fetch", type=_l2_fetch, action="append", metavar="BYTES")
    p.commands = commands.choices
    return p


def parse(argv) -> argparse.Namespace:
    """The arguments of ``argv`` with their defaults (``command``; ``configs`` and ``bytes``, sweep, sizes and profile;
    ``variants``, sizes; ``counts`` and ``l2_fetch``, short), each checked before torch is imported: a bad one exits
    with status 2 and one line naming it and its value."""
    p = parser()
    command = p.parse_args(list(argv[:1])).command
    sub = p.commands[command]
    args = sub.parse_intermixed_args(list(argv[1:]))
    args.command = command
    if command == "short":
        allowed = [str(n) for n in bench_cases.SHORT_SEQUENCES] + ["ref"]
        unknown = [n for n in args.counts if n not in allowed]
        if unknown:
            sub.error(f"unknown sequence counts {unknown}; they are {allowed}")
        if args.l2_fetch is not None and len(args.l2_fetch) > 1:
            sub.error(f"--l2-fetch takes a size in bytes, once, got '{args.l2_fetch[0]}' and another")
        args.l2_fetch = None if args.l2_fetch is None else args.l2_fetch[0]
        return args
    configs = [c[0] for c in bench_cases.CONFIGS]
    unknown = [n for n in args.configs if n not in configs]
    if unknown:
        sub.error(f"unknown configurations {unknown}; they are {configs}")
    sizes = getattr(args, "bytes", None) or []
    if command == "profile" and len(sizes) > 1:
        sub.error(f"--bytes is given once, got {sizes[0]} and {sizes[1]}")
    twice = [n for k, n in enumerate(sizes) if n in sizes[:k]]
    if twice:
        sub.error(f"--bytes {twice[0]} is given twice")
    if command == "sizes":
        variants = args.variants or [tuple(SIZE_VARIANTS)]
        if len(variants) > 1:
            sub.error(f"--variants takes groups of {list(SIZE_VARIANTS)}, comma-separated, each once, once; got "
                      f"'{','.join(variants[0])}' and another")
        args.variants = variants[0]
        args.bytes, args.configs = sizes or bench_cases.SIZES[1:], args.configs or configs
    else:
        args.bytes = sizes
        args.configs = args.configs or (["hd96", "hd128", "hd192"] if not sizes else configs)
    return args


def profile(args, torch, fa4):
    names, size = args.configs, (args.bytes[0] if args.bytes else None)
    packings = ("dense",) if size is None else ("dense", "varlen1", "varlen")
    for case in cases(names, torch, fa4, packings, size):
        runs = [case.ours()] + ([case.fa4_run()] if fa4 is not None else [])
        runs += [case.copy_run()] if size is not None else []
        for run in runs:
            run(2)  # compile, load, first touch
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for run in runs:
            run(1)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        n = 0 if case.cu is None else len(case.cu) - 1
        lengths = f" ({n} sequence{'s' * (n > 1)}: {np.diff(case.cu).tolist()})" if n else ""
        print(f"profiled {case.name} {case.packing}{lengths}, {case.bytes / 1e6:.1f} MB, {case.ctas} CTAs: ours"
              f"{', FlashAttention-4' if fa4 else ''}{', the copy' if size is not None else ''}", flush=True)


COMMANDS = {"sweep": sweep, "sizes": sizes, "short": short, "profile": profile}


def main(argv) -> int:
    try:
        args = parse(argv)
    except SystemExit as e:  # a usage error (status 2), or --help (0)
        return e.code
    import torch

    try:
        from flash_attn.cute.interface import _bwd_postprocess_convert as fa4
    except Exception:  # noqa: BLE001
        fa4 = None
    COMMANDS[args.command](args, torch, fa4)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
