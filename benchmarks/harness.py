"""Timing helpers of the benchmark and of the scripts beside it: CUDA-event and CUDA-graph timing (torch), wall-clock
timing of pipelined jitted calls, the GPU's own timeline from a jax.profiler trace, and the commit a report is of."""

from __future__ import annotations

import glob
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIN_SAMPLE_S = 2e-3
GRAPH_SAMPLE_S = 5e-3  # a CUDA graph's replay: its launch (a few us) amortised below 0.1%
MAX_GRAPH_CALLS = 20000
# Pipelined jax.jit calls: a sample's fixed costs (first dispatch, final sync: ~60 us) amortised below 1%
MIN_WALL_SAMPLE_S = 10e-3


OUR_KERNEL = "jax_dqpost_kernelkernelPostprocess"
"""What our kernel's name on the GPU timeline contains: the module of ``jax_dqpost._kernel.kernel.Postprocess``
without its dots, then the class's name."""


_STARTED = time.perf_counter()


def log(*a) -> None:
    """Progress on stderr (the report goes to stdout), after the seconds since this module was imported."""
    print(f"[{time.perf_counter() - _STARTED:6.1f} s]", *a, file=sys.stderr, flush=True)


def per_call(run, calls: int, samples: int, clock, min_sample_s: float = MIN_SAMPLE_S) -> float:
    """Median over ``samples`` of (time of ``run(n)``) / n, with n >= ``calls`` chosen so one sample lasts
    at least ``min_sample_s``; ``clock(run, n)`` returns seconds."""
    clock(run, calls)  # warm-up (compiles, first-touch)
    est = clock(run, calls) / calls
    n = max(calls, min(20000, math.ceil(min_sample_s / max(est, 1e-7) / calls) * calls))
    return statistics.median(clock(run, n) / n for _ in range(samples))


def event_clock(torch):
    """A clock for :func:`per_call`: CUDA events around ``run(n)`` on torch's current stream."""
    def clock(run, n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run(n)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e-3
    return clock


def graph_per_call(torch, run, calls: int, samples: int) -> tuple[float, float]:
    """(device seconds per call from CUDA-graph replay, eager seconds per call). ``run(n)`` enqueues n calls
    on torch's current stream. A sample is one replay of a graph of ``n`` calls lasting about ``GRAPH_SAMPLE_S``
    (``n`` a multiple of ``calls``, at most ``MAX_GRAPH_CALLS``), sized from a first graph of the calls that take that
    long to launch eagerly."""
    eager = per_call(run, calls, samples, event_clock(torch))
    clock = event_clock(torch)
    n = _multiple(GRAPH_SAMPLE_S / eager, calls)
    graph = _capture(torch, run, n)
    device = clock(lambda _: graph.replay(), n) / n
    if device * n < GRAPH_SAMPLE_S and n < _multiple(MAX_GRAPH_CALLS, calls):  # launch-bound calls: a longer graph
        n = _multiple(GRAPH_SAMPLE_S / max(device, 1e-9), calls)
        graph = _capture(torch, run, n)
    return statistics.median(clock(lambda _: graph.replay(), n) / n for _ in range(samples)), eager


def _multiple(count: float, calls: int) -> int:
    """``count`` rounded up to a multiple of ``calls``, within ``calls .. MAX_GRAPH_CALLS``."""
    return max(calls, min(MAX_GRAPH_CALLS, math.ceil(count)) // calls * calls)


def _capture(torch, run, n: int):
    """A CUDA graph of ``run(n)``, replayed once."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    # thread_local: only this thread's calls can invalidate the capture (JAX's runtime threads run alongside)
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        run(n)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def wall_clock(run, n) -> float:
    """A clock for :func:`per_call`: wall time of ``run(n)`` up to its last result (a jax array)."""
    t0 = time.perf_counter()
    run(n).block_until_ready()
    return time.perf_counter() - t0


def l2_fetch_granularity() -> int:
    """The current device's ``cudaLimitMaxL2FetchGranularity`` (bytes the L2 fetches from DRAM per miss at most; 64
    by default on the H200: a 32-byte sector read brings its 64-byte granule); 32 if it cannot be read."""
    try:
        from cuda.bindings import runtime as cudart

        err, value = cudart.cudaDeviceGetLimit(cudart.cudaLimit.cudaLimitMaxL2FetchGranularity)
        return int(value) if err == cudart.cudaError_t.cudaSuccess else 32
    except Exception:  # noqa: BLE001 - a bound for the report, not the measurement
        return 32


def gpu_activities(trace_dir, with_plane: bool = False) -> list[tuple]:
    """(GPU timeline line, activity name, start ns, duration ns) of every GPU activity in the newest
    jax.profiler trace under ``trace_dir`` (CUPTI's own timestamps); ``with_plane``: the GPU's plane name first."""
    from jax.profiler import ProfileData

    path = max(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    return [(plane.name,) * with_plane + (line.name, e.name, e.start_ns, e.duration_ns)
            for plane in ProfileData.from_file(path).planes if plane.name.startswith("/device:GPU")
            for line in plane.lines for e in line.events]


def traced_activities(f, args, executions: int = 1) -> list[tuple]:
    """Run ``f(*args)`` once (compile, warm up), then ``executions`` times under one jax.profiler trace, each to its
    result: every GPU activity of the traced runs, as :func:`gpu_activities` with planes."""
    import jax

    jax.block_until_ready(f(*args))
    trace_dir = tempfile.mkdtemp(prefix="jax_dqpost_trace_")
    try:
        with jax.profiler.trace(trace_dir):
            for _ in range(executions):
                jax.block_until_ready(f(*args))
        return gpu_activities(trace_dir, with_plane=True)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def device_per_kernel(f, args, name: str) -> dict:
    """One execution of ``f(*args)`` under jax.profiler: the GPU time per kernel whose name contains ``name``
    (span from the first one's start to the last one's end, over their count), their median duration and the
    median idle gap between consecutive ones. Empty if the profiler records no GPU activity."""
    try:
        evs = sorted((start, dur) for _, _, ev, start, dur in traced_activities(f, args) if name in ev)
    except Exception as e:  # noqa: BLE001 - the profiler is optional evidence, not the measurement
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    if len(evs) < 2:
        return {}
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(evs, evs[1:])]
    return {"kernels": len(evs), "per_call": (evs[-1][0] + evs[-1][1] - evs[0][0]) / len(evs) * 1e-9,
            "median_duration": statistics.median(d for _, d in evs) * 1e-9,
            "median_gap": statistics.median(gaps) * 1e-9}


def device_spans(f, args, name: str = "", executions: int = 1) -> dict[str, list[float]]:
    """``executions`` runs of ``f(*args)`` in one jax.profiler trace: per GPU, the seconds from the first kernel's
    start to the last one's end of each run, over the kernels whose name contains ``name`` (all: ``""``; copies and
    memsets never count). A GPU's kernels are split into ``executions`` runs of equal count, in time order."""
    kernels: dict[str, list] = {}
    for plane, _, ev, start, dur in traced_activities(f, args, executions):
        if name in ev and not ev.lower().startswith(("memcpy", "memset")):
            kernels.setdefault(plane, []).append((start, start + dur))
    spans = {}
    for plane, evs in kernels.items():
        evs.sort()
        n = len(evs) // executions
        if n * executions != len(evs):
            raise RuntimeError(f"{len(evs)} kernels on {plane} for {executions} runs")
        spans[plane] = [(max(e for _, e in run) - run[0][0]) * 1e-9
                        for run in (evs[k * n:(k + 1) * n] for k in range(executions))]
    return spans


def device_time_per_call(f, args, name: str, calls: int, executions: int) -> float | None:
    """Device seconds per call of a program ``f(*args)`` making ``calls`` calls: over ``executions`` runs in one trace,
    the median of the slowest GPU's :func:`device_spans`, over ``calls``; None if nothing was recorded."""
    try:
        spans = device_spans(f, args, name, executions)
    except RuntimeError as e:  # a timeline that does not split into the runs: no number, the run goes on
        log(f"device time not taken: {e}")
        return None
    if not spans:
        return None
    per_run = [max(s[k] for s in spans.values()) for k in range(executions)]
    return statistics.median(per_run) / calls


_ROOT = str(Path(__file__).resolve().parents[1])  # the folder holding benchmarks/


def python_child(code: str, env: dict, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``python -c code args`` in a fresh process (this one's working directory, ``env``), where ``benchmarks``
    imports as here: the folder holding it comes last on the path, after the jax_dqpost that process finds."""
    prelude = f"import sys; sys.path.append({_ROOT!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def commit() -> str:
    """The commit a report is of: $JAX_DQPOST_COMMIT if set (a copy of the tree without its git history), else the
    HEAD of the git checkout whose root holds ``benchmarks/``; "unknown" without git or outside such a checkout."""
    if os.environ.get("JAX_DQPOST_COMMIT"):
        return os.environ["JAX_DQPOST_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        c = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], cwd=root, capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = c.stdout.splitlines()
    if c.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == root:
        return lines[1].strip()
    return "unknown"
