"""What bounds the calls that trail XLA's op: hd64 at the reference shape, and calls of 1 MB and less. On the GPU
machine, from the repository root:

    python -m benchmarks.bounds [NAME ...]  device time (jax.profiler's GPU timeline, median of 5 programs of rotated
                                           buffers) of ours, XLA's convert of the same bytes in one flat array (the
                                           benchmark's roofline column), and XLA's convert that writes the gradient's
                                           natural layout (B, S, H, D) from (B, H, S, Dr) as ours does: the same
                                           bytes in the same access pattern; with the CTAs and waves of our launch
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers \
        python -m benchmarks.bounds --once [NAME ...]
                                           each program once between cudaProfilerStart and Stop (after a warm-up
                                           run), for Nsight Compute's counters (NAME: only the cases whose name
                                           contains it)

The cases: hd64 and hd128 (FlashAttention-4's sm90 dQ presets) at B=2, H=32, S=8192, dense and packed (64 random
lengths, as the benchmark draws them); hd128 dense at one tile, one wave of tiles (132 CTAs), 1 MB and 4 MB.
"""

from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from . import cases as bench_cases, harness  # noqa: E402

SMS = 132  # an H100/H200's multiprocessors
ROTATE_BYTES = 256 << 20


def _cases():
    """``(name, head_dim, B, H, S, cu)``: ``cu`` the packed batch's offsets, or None (dense)."""
    rng = np.random.default_rng(0)
    B, H, S = bench_cases.REFERENCE_SHAPE
    for d in (64, 128):
        yield f"hd{d} ref", d, B, H, S, None
        yield f"hd{d} ref varlen", d, B, H, S, bench_cases.random_lengths(rng, B * S, 64)
    tile = 80  # hd128's dQ tile_m (non-causal)
    yield "hd128 1 tile", 128, 1, 1, tile, None
    yield "hd128 1 wave", 128, 1, 4, SMS // 4 * tile, None
    for mb in (1, 4):
        yield f"hd128 {mb} MB", 128, 1, 8, (mb << 20) // (8 * 128 * 6), None


def _programs(name, d, B, H, S, cu):
    """``(label, jitted program over a list of buffers, its buffers, kernel name filter, calls)``."""
    import jax
    import jax.numpy as jnp

    from jax_dqpost import AccumLayout, dq_postprocess

    layout = AccumLayout.flash_attention(90, d, causal=False, tensor="dq", version="4.0.0b36")
    dr, scale = layout.padded_head_dim(d), np.float32(d ** -0.5)
    tokens = B * S
    if cu is None:
        acc_shape = layout.accum_shape(B, H, S, d)
        ours = lambda a: dq_postprocess(a, scale, seqlen_q=S, head_dim=d, layout=layout)
        natural_shape = (B, H, S, dr)
        natural = lambda x: (x * scale).astype(jnp.bfloat16)[..., :d].transpose(0, 2, 1, 3)
    else:
        acc_shape = layout.varlen_accum_shape(len(cu) - 1, H, tokens, d)
        ours = lambda a: dq_postprocess(a, scale, head_dim=d, total_q=tokens, cu_seqlens_q=cu, layout=layout)
        natural_shape = (H, tokens, dr)
        natural = lambda x: (x * scale).astype(jnp.bfloat16)[..., :d].transpose(1, 0, 2)
    per_call = tokens * H * (dr * 4 + d * 2)
    copies = max(2, min(64, -(-ROTATE_BYTES // per_call)))
    keys = jax.random.split(jax.random.PRNGKey(0), copies)
    acc = [jax.random.normal(k, acc_shape, np.float32) for k in keys]
    flat = [jax.random.normal(k, (tokens * H * dr,), np.float32) for k in keys]
    nat = [jax.random.normal(k, natural_shape, np.float32) for k in keys]
    contiguous = lambda x: (x * scale).astype(jnp.bfloat16)
    many = lambda f: jax.jit(lambda xs: [f(x) for x in xs])
    return per_call, copies, [("ours", many(ours), acc, harness.OUR_KERNEL),
                              ("XLA, flat", many(contiguous), flat, ""),
                              ("XLA, natural layout", many(natural), nat, "")]


def main(argv) -> int:
    import jax

    from . import internals

    once = "--once" in argv
    only = [a for a in argv if not a.startswith("--")]
    for name, d, B, H, S, cu in _cases():
        if only and not any(o in name for o in only):
            continue
        per_call, copies, programs = _programs(name, d, B, H, S, cu)
        ctas = internals.launch_ctas(d, B, H, S, cu)
        times, kernels = {}, {}
        for label, f, args, kernel in programs:
            if once:
                from cuda.bindings import runtime as cudart

                jax.block_until_ready(f(args))  # compile, load, first touch
                cudart.cudaProfilerStart()
                jax.block_until_ready(f(args))
                cudart.cudaProfilerStop()
                continue
            times[label] = harness.device_time_per_call(f, (args,), kernel, copies, 5)
            kernels[label] = harness.device_per_kernel(f, (args,), kernel or "fusion")
        if once:
            print(f"ran {name}", flush=True)
            continue
        print(f"{name}: {per_call / 1e6:.2f} MB a call, our launch {ctas} CTAs ({ctas / SMS:.1f} per SM); "
              f"ours {times['XLA, natural layout'] / times['ours']:.1%} of XLA's natural-layout op", flush=True)
        for label, t in times.items():
            k = kernels[label]
            print(f"    {label:20s} {t * 1e6:7.2f} us a call {per_call / t / 1e12:5.2f} TB/s   a kernel "
                  f"{k.get('median_duration', 0) * 1e6:7.2f} us, then {k.get('median_gap', 0) * 1e6:5.2f} us idle",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
