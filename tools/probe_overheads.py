"""Explain two gaps of the benchmark (GPU_RESULTS.md), in one process on the GPU:

    XLA_FLAGS=--xla_dump_to=/tmp/dump python tools/probe_overheads.py /tmp/dump

1. Per-call cost in a jitted chain of 200 tiny calls, by how the scale reaches each call: a distinct
   constant per call (as in the benchmark), one argument array sliced per call, or 200 scalar arguments;
   with the thunks XLA emitted for each program (command buffers, copies, custom calls).
2. A device-to-device copy of the same bytes with the two buffers at different relative offsets (does the
   placement of source and destination change the copy's bandwidth?).
"""

from __future__ import annotations

import glob
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_dqpost import AccumLayout, dq_postprocess

N = int(os.environ.get("PROBE_N", "200"))


def sync_time(f, *args, reps=30):
    for _ in range(3):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def thunk_counts(dump_dir, name):
    paths = sorted(glob.glob(os.path.join(dump_dir, f"*{name}*thunk_sequence_after_thunk_passes*.txt")))
    if not paths:
        return {}
    text = open(paths[-1]).read()
    return {k: len(re.findall(rf"\b{k}\b", text)) for k in ("kCommandBuffer", "kCopy", "kCustomCall", "kCustomKernel",
                                                            "kMemset32BitValue", "kMemzero")}


def chain(dump_dir):
    layout = AccumLayout.flash_attention(90, 128)
    S, D = layout.tile_m, 128
    acc = jax.random.normal(jax.random.PRNGKey(1), layout.accum_shape(1, 1, S, D), np.float32)
    op = lambda a, s: dq_postprocess(a, s, seqlen_q=S, head_dim=D, layout=layout)  # noqa: E731
    consume = lambda ys: sum(y[0, 0, 0, 0].astype(np.float32) for y in ys)  # noqa: E731

    def constants(a, k):
        return consume([op(a, 0.125 + i / 4096) for i in range(k)])

    def sliced(a, s, k):
        return consume([op(a, s[i]) for i in range(k)])

    def scalars(a, *s):
        return consume([op(a, x) for x in s])

    scales = jnp.asarray(0.125 + np.arange(N) / 4096, jnp.float32)
    for name, make in (("constants", lambda k: (jax.jit(constants, static_argnums=1), (acc, k))),
                       ("sliced_array", lambda k: (jax.jit(sliced, static_argnums=2), (acc, scales, k))),
                       ("scalar_args", lambda k: (jax.jit(scalars), (acc, *[scales[i] for i in range(k)])))):
        times = {}
        for k in (1, N):
            f, args = make(k)
            times[k] = sync_time(f, *args)
        counts = thunk_counts(dump_dir, "jit_" + ("constants" if name == "constants" else
                                                  "sliced" if name == "sliced_array" else "scalars"))
        print(f"chain of {N}, scale as {name}: {(times[N] - times[1]) / (N - 1) * 1e6:.2f} us per call "
              f"(program {times[N] * 1e6:.0f} us, one call {times[1] * 1e6:.0f} us); thunks of the last such "
              f"program: {counts}", flush=True)


def copy_placement():
    import torch

    half = 536_868_864  # bytes each way: the hd64 1 GB case of the benchmark
    pool = torch.empty(2 * half + (64 << 20), dtype=torch.uint8, device="cuda")
    g = torch.cuda.CUDAGraph()
    for offset in (0, 4096, 1 << 20, 2 << 20, 8 << 20, 32 << 20):
        src = pool[:half].view(torch.int32)
        dst = pool[half + offset: 2 * half + offset].view(torch.int32)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(8):
                dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(15):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 8 * 1e-3)
        t = statistics.median(ts)
        print(f"copy {2 * half / 1e6:.0f} MB moved, destination {half + offset} bytes after the source: "
              f"{t * 1e6:.1f} us, {2 * half / t / 1e12:.2f} TB/s", flush=True)


if __name__ == "__main__":
    chain(sys.argv[1] if len(sys.argv) > 1 else "")
    if jax.default_backend() == "gpu":
        copy_placement()
