"""Where the time of the `jax.jit` path goes, on the GPU machine, from the repository root:

    python -m benchmarks.probe_timeline [TRACE_DIR]      (no TRACE_DIR: host-side timings only, no profiler)

1. `jax.jit(dq_postprocess)` at the benchmark's reference shape (hd128, B, H, S = 2, 32, 8192), pipelined calls
   on two rotating inputs, and for comparison an XLA op moving about the same bytes (x * s -> bf16 of the same
   accumulator): host time to enqueue the calls and wall time per call, with the outputs dropped at once (as
   the benchmark does) or kept alive.
2. The benchmark's chain of 200 tiny calls in one program (and XLA's elementwise chain): wall time per execution.
3. The chain as a training-loop step with a donated state (no address changes between executions) or not.
With TRACE_DIR, 1 and 2 also run under jax.profiler (which slows the host down) and print the GPU's own
timeline (CUPTI): every activity's count and median duration and the idle gaps between consecutive ones.
Run it again with XLA_FLAGS=--xla_gpu_enable_command_buffer= to see XLA's command buffers' share.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dqpost import AccumLayout, dq_postprocess  # noqa: E402

from .harness import gpu_activities  # noqa: E402


def summarize(label, acts):
    by_line = collections.defaultdict(list)
    for line, name, start, dur in acts:
        by_line[line].append((start, dur, name))
    for line, evs in sorted(by_line.items()):
        evs.sort()
        names = collections.Counter(n for _, _, n in evs)
        print(f"  [{label}] GPU line {line!r}: {len(evs)} activities")
        for n, c in names.most_common(6):
            durs = [d for _, d, m in evs if m == n]
            print(f"      {c:4d} x {n[:90]!r}: median {statistics.median(durs) / 1e3:.2f} us, "
                  f"min {min(durs) / 1e3:.2f}, max {max(durs) / 1e3:.2f}")
        gaps = [b[0] - (a[0] + a[1]) for a, b in zip(evs, evs[1:])]
        if gaps:
            span = evs[-1][0] + evs[-1][1] - evs[0][0]
            busy = sum(d for _, d, _ in evs)
            print(f"      gaps between consecutive activities: median {statistics.median(gaps) / 1e3:.2f} us, "
                  f"max {max(gaps) / 1e3:.2f} us; busy {busy / span:.1%} of {span / 1e3:.0f} us", flush=True)


def pipelined(label, f, inputs, trace_dir, n=20):
    for _ in range(3):
        jax.block_until_ready([f(x) for x in inputs])
    with jax.profiler.trace(trace_dir):
        t0 = time.perf_counter()
        out = [f(inputs[i % len(inputs)]) for i in range(n)]
        t1 = time.perf_counter()
        jax.block_until_ready(out[-1])
        t2 = time.perf_counter()
        del out
    print(f"{label}: {n} pipelined calls: host enqueue {(t1 - t0) / n * 1e6:.1f} us per call, wall to the last "
          f"result {(t2 - t0) / n * 1e6:.1f} us per call", flush=True)
    summarize(label, gpu_activities(trace_dir))


def host_costs(f, inputs, n=50, keep=False):
    """(host enqueue, wall to the last result) per call of n pipelined calls, median of 7 samples (after one
    warm-up)."""
    samples = []
    for _ in range(8):
        kept, out = [], None
        t0 = time.perf_counter()
        for i in range(n):
            out = f(inputs[i % len(inputs)])
            if keep:
                kept.append(out)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        samples.append(((t1 - t0) / n, (time.perf_counter() - t0) / n))
        del kept, out
    samples = samples[1:]
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def standalone(trace_root):
    layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
    B, H, S, D = 2, 32, 8192, 128
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    inputs = [jax.random.normal(k, layout.accum_shape(B, H, S, D), np.float32) for k in keys]
    ours = jax.jit(lambda a: dq_postprocess(a, D ** -0.5, seqlen_q=S, head_dim=D, layout=layout))
    xla = jax.jit(lambda a: (a * np.float32(D ** -0.5)).astype(jnp.bfloat16))
    flags = os.environ.get("XLA_FLAGS", "") or "default"
    for label, f in (("ours jax.jit", ours), ("XLA same bytes", xla)):
        for keep in (False, True):
            enq, wall = host_costs(f, inputs, keep=keep)
            print(f"{label} (XLA_FLAGS {flags}), 50 pipelined calls, outputs {'kept' if keep else 'dropped'}: "
                  f"host enqueue {enq * 1e6:.1f} us per call, wall {wall * 1e6:.1f} us per call", flush=True)
    if trace_root:
        pipelined("ours jax.jit", ours, inputs, os.path.join(trace_root, "ours"))
        pipelined("XLA same bytes", xla, inputs, os.path.join(trace_root, "xla"))


def chain(trace_root, n=200):
    layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
    S, D = layout.tile_m, 128
    acc = jax.random.normal(jax.random.PRNGKey(1), layout.accum_shape(1, 1, S, D), np.float32)

    def program(a):
        ys = [dq_postprocess(a, 0.125 + i / 4096, seqlen_q=S, head_dim=D, layout=layout) for i in range(n)]
        return sum(y[0, 0, 0, 0].astype(np.float32) for y in ys)

    def elementwise(a):
        for i in range(n):
            a = jax.lax.optimization_barrier(a * (1 + i / 4096))
        return a

    for label, fn in (("chain of ours", program), ("chain of XLA elementwise", elementwise)):
        f = jax.jit(fn)
        for _ in range(3):
            jax.block_until_ready(f(acc))
        walls = []
        for _ in range(30):
            t0 = time.perf_counter()
            jax.block_until_ready(f(acc))
            walls.append(time.perf_counter() - t0)
        print(f"{label} ({n} calls, no profiler): wall {statistics.median(walls) * 1e6:.0f} us per execution "
              f"(median of 30)", flush=True)
        if not trace_root:
            continue
        d = os.path.join(trace_root, label.replace(" ", "_"))
        with jax.profiler.trace(d):
            t0 = time.perf_counter()
            jax.block_until_ready(f(acc))
            t1 = time.perf_counter()
        print(f"{label} ({n} calls, one execution): wall {(t1 - t0) * 1e6:.0f} us", flush=True)
        summarize(label, gpu_activities(d))


def stable_addresses(n=200, reps=30):
    """The chain again, as a step function whose only result is a small state: donated (the result reuses the
    state's buffer, so no buffer the program touches changes address between executions, as in a training
    loop with donated state) or not (a new result buffer every execution). Per call: (t(n) - t(1)) / (n - 1)
    of the synchronous wall time per execution. Shows how much of a call's cost is XLA updating its command
    buffer when addresses change."""
    layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
    S, D = layout.tile_m, 128
    acc = jax.random.normal(jax.random.PRNGKey(1), layout.accum_shape(1, 1, S, D), np.float32)

    def ours(state, a, k):
        ys = [dq_postprocess(a, 0.125 + i / 4096, seqlen_q=S, head_dim=D, layout=layout) for i in range(k)]
        return state + sum(y[0, 0, 0, 0].astype(np.float32) for y in ys)

    def elementwise(state, a, k):
        for i in range(k):
            a = jax.lax.optimization_barrier(a * (1 + (i + 1) / 4096))
        return state + a[0, 0, 0]

    for label, fn in (("ours", ours), ("XLA elementwise", elementwise)):
        for donate in (True, False):
            per_k = {}
            for k in (1, n):
                f = jax.jit(fn, static_argnums=2, donate_argnums=(0,) if donate else ())
                state = jnp.zeros((), np.float32)
                for _ in range(3):
                    state = f(state, acc, k)
                walls = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    state = jax.block_until_ready(f(state, acc, k))
                    walls.append(time.perf_counter() - t0)
                per_k[k] = statistics.median(walls)
            print(f"chain step of {label}, state {'donated' if donate else 'not donated'}: "
                  f"{(per_k[n] - per_k[1]) / (n - 1) * 1e6:.2f} us per call (program {per_k[n] * 1e6:.0f} us, "
                  f"one call {per_k[1] * 1e6:.0f} us)", flush=True)


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else None
    standalone(root)
    chain(root)
    stable_addresses()
