"""Kernel-level evidence for the benchmark's gaps, on the GPU machine (B, H, S = 2, 32, 8192, bf16).

    python tools/ncu_kernels.py sweep hd96 hd128 hd192
        graph-replay time of our kernel with tuning variants (DqPostprocess keyword arguments; each checked
        bit-equal to the default's output), FlashAttention-4 and the same-bytes copy, side by side, median of 15
        (as the benchmark measures them), dense and varlen (64 random lengths)
    ncu --clock-control none --profile-from-start off --set full python tools/ncu_kernels.py profile hd96 hd128
        one launch of ours (the first two variants) and one of FlashAttention-4 per dense configuration,
        between cudaProfilerStart/Stop (after warm-up), for Nsight Compute's counters

Configuration names are the benchmark's (jax_dqpost.bench.cases.CONFIGS).
"""

from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from jax_dqpost.bench import cases as bench_cases, harness  # noqa: E402

# Variants tried per configuration by `sweep` (the first, {}, is the package's default).
VARIANTS = [{}, {"heads_fastest": False}, {"min_ctas_per_sm": 0}]


def cases(names, torch, fa4, packings=("dense",)):
    configs = {c[0]: c for c in bench_cases.CONFIGS}
    for name in names:
        for packing in packings:
            _, D, causal = configs[name]
            case = bench_cases.Case(name, D, causal, packing, None, np.random.default_rng(0), torch, fa4)
            case.torch_buffers()
            yield case
            case.free_torch()


def sweep(names, torch, fa4, samples=15):
    for case in cases(names, torch, fa4, packings=("dense", "varlen")):
        copy, _ = harness.graph_per_call(torch, case.copy_run(), case.copies, samples)
        rows = [("copy", copy)]
        if fa4 is not None:
            rows.append(("FA4", harness.graph_per_call(torch, case.fa4_run(), case.copies, samples)[0]))
        expected = None
        for tuning in VARIANTS:
            try:
                run = case.ours(**tuning)
                case.t_out[0].fill_(float("nan"))
                run(1)
                out = case.t_out[0].view(torch.int16).clone()
                expected = out if expected is None else expected
                same = "same bits" if torch.equal(out, expected) else "DIFFERENT BITS"
                t, _ = harness.graph_per_call(torch, run, case.copies, samples)
            except Exception as e:  # noqa: BLE001 - a variant that cannot compile for this tile
                print(f"{case.name} ours {tuning}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            rows.append((f"ours {tuning or 'default'} ({same})", t))
        for label, t in rows:
            print(f"{case.name:13s} {case.packing:7s} {label:45s} {t * 1e6:8.1f} us {case.bytes / t / 1e12:5.2f} TB/s "
                  f"{copy / t:7.1%} of copy", flush=True)


def profile(names, torch, fa4):
    for case in cases(names, torch, fa4):
        runs = [case.ours(**t) for t in VARIANTS[:2]] + ([case.fa4_run()] if fa4 is not None else [])
        for run in runs:
            run(2)  # compile, load, first touch
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for run in runs:
            run(1)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled {case.name}: ours {VARIANTS[:2]}{' and FlashAttention-4' if fa4 else ''}", flush=True)


def main(argv):
    import torch

    try:
        from flash_attn.cute.interface import _bwd_postprocess_convert as fa4
    except Exception:  # noqa: BLE001
        fa4 = None
    what, names = argv[0], argv[1:] or ["hd96", "hd128", "hd192"]
    {"sweep": sweep, "profile": profile}[what](names, torch, fa4)


if __name__ == "__main__":
    main(sys.argv[1:])
