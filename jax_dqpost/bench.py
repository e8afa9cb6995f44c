"""Benchmark of the dQ postprocess on the local GPU, every implementation side by side in one run:

    python -m jax_dqpost.bench [--out DIR] [--quick]

For FlashAttention's Hopper configurations (head dims 64, 96, 128, 128 causal, 192, 256), dense and
varlen (64 random lengths, the same tokens), sizes from a few KB to 1 GB moved per call, it times

- ``ours``: our CuTe kernel (the module the FFI target runs), launched from a torch stream;
- ``FA4``: FlashAttention-4's postprocess (``flash_attn.cute``), when importable;
- ``copy``: a device-to-device copy of the same number of bytes, the ceiling;
- ``ours_jax``: ``jax.jit(dq_postprocess)`` called from Python, pipelined (wall clock per call);
- ``jnp_gather``: what a JAX user writes without this package, a gather by the tile order, a multiply
  and a cast, under ``jax.jit`` (wall clock per call, pipelined like ``ours_jax``).

The first three are captured in a CUDA graph of back-to-back calls and timed with CUDA events around its
replay: device time, free of Python's launch cost (their eager times are kept in the JSON too). Each
sample runs enough calls for at least 2 ms, cycling through enough distinct input and output buffers (at
least 256 MiB, several times the L2) that no call finds its data in L2; the median of the samples is
reported. Bandwidth counts the useful bytes of a call: for every row of dQ, the accumulator's
row (4 bytes per element, head dim padded as the producer stores it) and the row written (2 bytes per
element); padding rows of partial tiles and of varlen allocations are not counted. It also measures the per-call
cost in a jitted chain of 200 tiny calls, cold and warm (on-disk cache hit) start, and the import time.
Prints tables, writes ``bench.json`` and ``bench.png`` into ``--out``; progress goes to stderr. Needs a
CUDA GPU and torch (for events and the copy); ``python -m jax_dqpost.bench --plot JSON`` redraws a plot.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CONFIGS = [("hd64", 64, False), ("hd96", 96, False), ("hd128-causal", 128, True), ("hd128", 128, False),
           ("hd192", 192, False), ("hd256", 256, False)]
SIZES = [2**12, 2**16, 2**20, 2**24, 2**27, 2**30]  # bytes moved per call (approximately)
REFERENCE_SHAPE = (2, 32, 8192)  # (B, H, S): the sizes of the performance issue's table
ROTATE_BYTES = 256 << 20  # distinct buffers cycled per sample (H200 L2: 50 MiB)
MIN_SAMPLE_S = 2e-3
# Pipelined jax.jit calls: a sample's fixed costs (first dispatch, final sync: ~60 us) amortised below 1%
MIN_WALL_SAMPLE_S = 10e-3
MANY_SEQUENCES = 2000  # "large batches of short sequences"
IMPLS = ("ours", "FA4", "copy", "ours_jax", "jnp_gather")
METHOD = ("ours/FA4/copy: CUDA events around the replay of a CUDA graph of back-to-back calls (*_eager: "
          "events around eager launches); ours_jax/jnp_gather: wall clock of pipelined jitted calls; median of "
          "samples of >= 2 ms; >= 256 MiB of rotated buffers; seconds per call")
_EXECUTORS: dict = {}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---- timing ------------------------------------------------------------------------------------------
def _per_call(run, calls: int, samples: int, clock, min_sample_s: float = MIN_SAMPLE_S) -> float:
    """Median over ``samples`` of (time of ``run(n)``) / n, with n >= ``calls`` chosen so one sample lasts
    at least ``min_sample_s``; ``clock(run, n)`` returns seconds."""
    clock(run, calls)  # warm-up (compiles, first-touch)
    est = clock(run, calls) / calls
    n = max(calls, min(20000, math.ceil(min_sample_s / max(est, 1e-7) / calls) * calls))
    return statistics.median(clock(run, n) / n for _ in range(samples))


def _event_clock(torch):
    def clock(run, n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run(n)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e-3
    return clock


def _graph_per_call(torch, run, calls: int, samples: int) -> tuple[float, float]:
    """(device seconds per call from CUDA-graph replay, eager seconds per call). ``run(n)`` enqueues n calls
    on torch's current stream."""
    eager = _per_call(run, calls, samples, _event_clock(torch))
    n = max(calls, min(4000, max(200, math.ceil(MIN_SAMPLE_S / eager))) // calls * calls)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        run(n)
    graph.replay()
    torch.cuda.synchronize()
    replay = _event_clock(torch)
    return statistics.median(replay(lambda _: graph.replay(), n) / n for _ in range(samples)), eager


def _wall_clock(run, n):
    t0 = time.perf_counter()
    run(n).block_until_ready()
    return time.perf_counter() - t0


# ---- problem sizes -----------------------------------------------------------------------------------
def problem(head_dim: int, target_bytes: int | None):
    """(B, H, S) moving about ``target_bytes`` per call (None: the issue's reference shape)."""
    if target_bytes is None:
        return REFERENCE_SHAPE
    per_token_head = head_dim * 6
    heads = int(min(32, max(1, target_bytes // (per_token_head * 1024))))
    seqlen = max(8, round(target_bytes / (heads * per_token_head)))
    return 1, heads, seqlen


def random_lengths(rng, total: int, count: int) -> list[int]:
    count = max(1, min(count, total))
    cuts = np.sort(rng.choice(np.arange(1, total), count - 1, replace=False)) if count > 1 else np.array([], int)
    return [0] + [int(c) for c in cuts] + [total]


# ---- the implementations -----------------------------------------------------------------------------
class Case:
    """One (configuration, mode, size): buffers and launchers of every implementation."""

    def __init__(self, name, head_dim, causal, mode, target_bytes, rng, torch, fa4, sequences=64):
        from . import AccumLayout
        from . import varlen as varlen_

        self.torch, self.fa4 = torch, fa4
        self.layout = AccumLayout.flash_attention(90, head_dim, causal=causal)
        self.name, self.mode, self.D = name, mode, head_dim
        B, H, S = problem(head_dim, target_bytes)
        self.B, self.H, self.S = B, H, S
        Dr = self.layout.padded_head_dim(head_dim)
        tm = self.layout.tile_m
        if mode == "dense":
            self.acc_shape, self.out_shape = self.layout.accum_shape(B, H, S, head_dim), (B, S, H, head_dim)
            self.tokens = B * S
            self.cu = None
        else:
            self.tokens = B * S
            self.cu = random_lengths(rng, self.tokens, sequences)
            batch = len(self.cu) - 1
            self.acc_shape = self.layout.varlen_accum_shape(batch, H, self.tokens, head_dim)
            self.out_shape = (self.tokens, H, head_dim)
            self.meta, self.num_tiles = varlen_.work_list(np, self.cu, None, total_q=self.tokens, tile_m=tm)
            # CTAs per head: launched (the work list's grid) and what the sequences' rows need at the least
            self.tiles_needed = int(sum(-(-n // tm) for n in np.diff(self.cu)))
            self.spans = varlen_.num_spans(batch)
        self.bytes = self.tokens * H * (Dr * 4 + head_dim * 2)  # useful bytes: rows of the sequences only
        per_call = int(np.prod(self.acc_shape)) * 4 + int(np.prod(self.out_shape)) * 2
        self.copies = max(2, min(256, -(-ROTATE_BYTES // per_call)))
        self.scale = head_dim ** -0.5

    # torch-side buffers (ours, FA4, copy)
    def torch_buffers(self):
        t = self.torch
        self.t_acc = [t.randn(self.acc_shape, device="cuda", dtype=t.float32) for _ in range(self.copies)]
        self.t_out = [t.empty(self.out_shape, device="cuda", dtype=t.bfloat16) for _ in range(self.copies)]
        self.t_scale = t.tensor([self.scale], device="cuda", dtype=t.float32)
        self.t_meta = t.from_numpy(self.meta).cuda() if self.mode == "varlen" else self.t_scale
        self.t_cu = t.tensor(self.cu, dtype=t.int32, device="cuda") if self.cu is not None else None

    def free_torch(self):
        self.t_acc = self.t_out = self.t_meta = self.t_cu = None
        self.torch.cuda.empty_cache()

    def ours(self, **tuning):
        """Launcher of our kernel; ``tuning``: DqPostprocess keyword arguments (experiments only)."""
        import cuda.bindings.driver as cuda

        from . import compile as compile_

        key = (self.layout, self.D, self.mode, tuple(sorted(tuning.items())))
        if key not in _EXECUTORS:
            _EXECUTORS[key] = compile_.compile_executor("bf16", self.layout, self.layout.padded_head_dim(self.D),
                                                        self.mode, compile_.target_arch(), **tuning)
        ex = _EXECUTORS[key]
        if self.mode == "dense":
            dims = (self.B, self.H, self.S, self.D, -(-self.S // self.layout.tile_m))
        else:
            dims = (self.spans, self.H, self.tokens, self.D, self.num_tiles)
        args = [compile_.executor_args("bf16", a.data_ptr(), o.data_ptr(), self.t_scale.data_ptr(),
                                       self.t_meta.data_ptr(), dims) for a, o in zip(self.t_acc, self.t_out)]

        def run(n):
            stream = cuda.CUstream(self.torch.cuda.current_stream().cuda_stream)  # the capture stream, too
            for i in range(n):
                ex(*args[i % self.copies], stream)
        return run

    def fa4_run(self):
        import cutlass

        lt = self.layout

        def run(n):
            for i in range(n):
                k = i % self.copies
                self.fa4(self.t_acc[k], self.t_out[k], self.scale, self.t_cu, None, 90, cutlass.BFloat16, self.D,
                         lt.tile_m, lt.num_threads, lt.atom_layout, lt.swap_ab, fake_mode=False,
                         hdim_multiple_of=lt.hdim_multiple_of)
        return run

    def copy_run(self):
        t = self.torch
        words = self.bytes // 2 // 16 * 4  # half the bytes each way, as int32 (16-byte multiples)
        src = [t.empty(words, dtype=t.int32, device="cuda") for _ in range(self.copies)]
        dst = [t.empty(words, dtype=t.int32, device="cuda") for _ in range(self.copies)]

        def run(n):
            for i in range(n):
                dst[i % self.copies].copy_(src[i % self.copies])
        return run

    # JAX side (ours through jax.jit, and the gather a user would write)
    def jax_inputs(self):
        import jax

        keys = jax.random.split(jax.random.PRNGKey(0), self.copies)
        self.j_acc = [jax.random.normal(k, self.acc_shape, np.float32) for k in keys]

    def jax_run(self, fn, rotate=True):
        import jax

        f = jax.jit(fn)
        copies = self.copies if rotate else 1

        def run(n):
            out = None
            for i in range(n):
                out = f(self.j_acc[i % copies])
            return out
        return run

    def ours_jax_fn(self):
        import jax.numpy as jnp

        from . import dq_postprocess

        if self.mode == "dense":
            return lambda a: dq_postprocess(a, self.scale, seqlen_q=self.S, head_dim=self.D, dtype=jnp.bfloat16,
                                            layout=self.layout)
        return lambda a: dq_postprocess(a, self.scale, head_dim=self.D, total_q=self.tokens, cu_seqlens_q=self.cu,
                                        dtype=jnp.bfloat16, layout=self.layout)

    def same_bytes_fn(self):
        """An XLA op moving about the bytes of a dense call (x * scale -> bf16 of the whole accumulator, its
        padded rows included, no reordering): what a plain jax.jit call of this size costs, for comparison
        with ours through jax.jit."""
        import jax.numpy as jnp

        return lambda a: (a * np.float32(self.scale)).astype(jnp.bfloat16)

    def gather_fn(self):
        """A user's jax.numpy version: gather every element from its position in the tile order."""
        import jax.numpy as jnp

        lt, D = self.layout, self.D
        Dr, tm = lt.padded_head_dim(D), lt.tile_m
        pos = jnp.asarray(lt.tile_index_map(D)[:, :D].astype(np.int32))  # (tm, D)
        if self.mode == "dense":
            S = self.S

            def f(a):
                tiles = a.reshape(self.B, self.H, -1, tm * Dr)
                x = jnp.take(tiles, pos.ravel(), axis=3).reshape(self.B, self.H, -1, D)[:, :, :S]
                return (jnp.transpose(x, (0, 2, 1, 3)) * self.scale).astype(jnp.bfloat16)
            return f
        cu = np.asarray(self.cu)
        t = np.arange(self.tokens)
        b = np.searchsorted(cu, t, side="right") - 1
        row = (cu[b] + b * tm) // tm * tm + (t - cu[b])  # accumulator row of every token
        flat = jnp.asarray((row // tm * tm * Dr)[:, None] + np.asarray(pos)[row % tm])  # (T, D)

        def f(a):
            return (jnp.transpose(a[:, flat], (1, 0, 2)) * self.scale).astype(jnp.bfloat16)
        return f

    def same_bits_as_fa4(self) -> bool:
        t = self.torch
        self.ours()(1)
        mine = self.t_out[0].clone()
        self.t_out[0].fill_(float("nan"))
        self.fa4_run()(1)
        t.cuda.synchronize()  # (varlen: the sequences cover every row, so FlashAttention-4 writes them all)
        return bool(t.equal(mine.view(t.int16), self.t_out[0].view(t.int16)))


def measure(case: Case, samples: int) -> dict:
    torch = case.torch
    res = {"config": case.name, "mode": case.mode, "head_dim": case.D, "B": case.B, "H": case.H, "S": case.S,
           "tokens": case.tokens, "bytes": case.bytes, "buffers": case.copies,
           "layout": [case.layout.tile_m, case.layout.num_threads, case.layout.atom_layout, case.layout.swap_ab,
                      case.layout.hdim_multiple_of]}
    if case.mode == "varlen":
        res.update(sequences=len(case.cu) - 1, tiles_launched=case.num_tiles, tiles_needed=case.tiles_needed)
    case.torch_buffers()
    res["ours"], res["ours_eager"] = _graph_per_call(torch, case.ours(), case.copies, samples)
    if case.fa4 is not None:
        try:
            res["FA4"], res["FA4_eager"] = _graph_per_call(torch, case.fa4_run(), case.copies, samples)
            res["same_bits_as_FA4"] = case.same_bits_as_fa4()
        except Exception as e:  # noqa: BLE001 - report what the peer cannot run
            res["FA4_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    res["copy"], res["copy_eager"] = _graph_per_call(torch, case.copy_run(), case.copies, samples)
    case.free_torch()
    case.jax_inputs()
    wall = functools.partial(_per_call, calls=case.copies, samples=samples, clock=_wall_clock,
                             min_sample_s=MIN_WALL_SAMPLE_S)
    res["ours_jax"] = wall(case.jax_run(case.ours_jax_fn()))
    res["ours_jax_same_input"] = wall(case.jax_run(case.ours_jax_fn(), rotate=False))
    res["jnp_gather"] = wall(case.jax_run(case.gather_fn()))
    case.j_acc = None
    return res


# ---- overheads -----------------------------------------------------------------------------------------
def chain_cost(samples: int, n: int = 200) -> dict:
    """Per-call cost inside one jitted program of ``n`` tiny calls: (t(n) - t(1)) / (n - 1), where t is the
    median time from dispatch to result of the whole program. Each call has its own scale (no two are
    common subexpressions) and every output is returned (none is dead); the compiled program is checked
    to launch ``n`` of our calls. For comparison, a chain of XLA elementwise ops of the same bytes
    (x -> x * s, each on the previous result), per kernel XLA launched. Both also from the GPU's own timeline
    (jax.profiler): device time per call, kernel duration and idle gap, which the wall clock cannot split."""
    import re

    import jax

    from . import AccumLayout, _ffi, dq_postprocess

    layout = AccumLayout.flash_attention(90, 128)
    S, D = layout.tile_m, 128
    acc = jax.random.normal(jax.random.PRNGKey(1), layout.accum_shape(1, 1, S, D), np.float32)

    def returned(a, k):  # every output is a result of the program: fresh buffers at every run
        return [dq_postprocess(a, 0.125 + i / 4096, seqlen_q=S, head_dim=D, layout=layout) for i in range(k)]

    def ours(a, k):  # outputs consumed inside the program, as in a training step (one reduction at the end)
        return sum(y[0, 0, 0, 0].astype(np.float32) for y in returned(a, k))

    def elementwise(a, k):
        for i in range(k):
            a = jax.lax.optimization_barrier(a * (1 + i / 4096))
        return a

    def timed(fn, k):
        f = jax.jit(fn, static_argnums=1)
        text = f.lower(acc, k).compile().as_text()
        for _ in range(3):
            jax.block_until_ready(f(acc, k))
        ts = []
        for _ in range(max(samples, 30)):
            t0 = time.perf_counter()
            jax.block_until_ready(f(acc, k))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts), text

    out = {"shape": [1, S, 1, D], "calls": n}
    t1, _ = timed(ours, 1)
    tn, text = timed(ours, n)
    out["ours_device"] = _device_per_kernel(jax.jit(ours, static_argnums=1), acc, n, "DqPostprocess")
    out["our_calls_in_program"] = len(re.findall(f'custom_call_target="{_ffi.TARGET_NAME}"', text))
    out["ours"] = (tn - t1) / (n - 1)
    out["ours_program_1"], out["ours_program_n"] = t1, tn
    t1, _ = timed(returned, 1)
    tn, _ = timed(returned, n)
    out["ours_outputs_returned"] = (tn - t1) / (n - 1)
    t1, text1 = timed(elementwise, 1)
    tn, textn = timed(elementwise, n)
    kernels = lambda t: len(re.findall(r"^\s*(?:ROOT )?\S+ = \S+ fusion\(", t, re.M))  # noqa: E731
    out["xla_kernels_in_program"] = kernels(textn)
    out["xla_elementwise"] = (tn - t1) / max(1, kernels(textn) - kernels(text1))
    out["xla_device"] = _device_per_kernel(jax.jit(elementwise, static_argnums=1), acc, n, "multiply")
    return out


def gpu_activities(trace_dir) -> list[tuple[str, str, int, int]]:
    """(GPU timeline line, activity name, start ns, duration ns) of every GPU activity in the newest
    jax.profiler trace under ``trace_dir`` (CUPTI's own timestamps)."""
    import glob

    from jax.profiler import ProfileData

    path = max(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    return [(line.name, e.name, e.start_ns, e.duration_ns)
            for plane in ProfileData.from_file(path).planes if plane.name.startswith("/device:GPU")
            for line in plane.lines for e in line.events]


def _device_per_kernel(f, acc, n: int, name: str) -> dict:
    """One execution of ``f(acc, n)`` under jax.profiler: the GPU time per kernel whose name contains ``name``
    (span from the first one's start to the last one's end, over their count), their median duration and the
    median idle gap between consecutive ones. Empty if the profiler records no GPU activity."""
    import shutil
    import tempfile

    import jax

    jax.block_until_ready(f(acc, n))
    trace_dir = tempfile.mkdtemp(prefix="jax_dqpost_trace_")
    try:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(f(acc, n))
        evs = sorted((start, dur) for _, ev, start, dur in gpu_activities(trace_dir) if name in ev)
    except Exception as e:  # noqa: BLE001 - the profiler is optional evidence, not the measurement
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    if len(evs) < 2:
        return {}
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(evs, evs[1:])]
    return {"kernels": len(evs), "per_call": (evs[-1][0] + evs[-1][1] - evs[0][0]) / len(evs) * 1e-9,
            "median_duration": statistics.median(d for _, d in evs) * 1e-9, "median_gap": statistics.median(gaps) * 1e-9}


_START_PROBE = r"""
import os, sys, time, json
t0 = time.perf_counter()
import jax, jax.numpy as jnp
t1 = time.perf_counter()
import jax_dqpost
from jax_dqpost import AccumLayout, dq_postprocess, compile as compile_
t2 = time.perf_counter()
jnp.zeros(1).block_until_ready()
jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(8)).block_until_ready()  # XLA's compiler warmed up, not ours
res = {"import_jax": t1 - t0, "import_jax_dqpost": t2 - t1, "configs": []}
for D in map(int, sys.argv[1].split(",")):
    layout = AccumLayout.flash_attention(90, D)
    acc = jnp.ones(layout.accum_shape(1, 2, 256, D), jnp.float32).block_until_ready()
    s = time.perf_counter()
    compile_.get_kernel(jnp.bfloat16, layout, layout.padded_head_dim(D))
    k = time.perf_counter()
    jax.jit(lambda a: dq_postprocess(a, 0.1, seqlen_q=256, head_dim=D, layout=layout))(acc).block_until_ready()
    e = time.perf_counter()
    res["configs"].append({"head_dim": D, "get_kernel": k - s, "first_result": e - s})
print(json.dumps(res))
"""


_JAX_PATH_PROBE = r"""
import json, sys
from jax_dqpost import bench
case = bench.Case("hd128", 128, False, "dense", None, None, None, None)
case.jax_inputs()
res = {}
for name, fn, rotate in (("rotated_inputs", case.ours_jax_fn(), True), ("same_input", case.ours_jax_fn(), False),
                         ("xla_same_bytes_op", case.same_bytes_fn(), True)):
    res[name] = bench._per_call(case.jax_run(fn, rotate=rotate), case.copies, 15, bench._wall_clock,
                                bench.MIN_WALL_SAMPLE_S)
print(json.dumps(res))
"""


def jax_path_costs() -> dict:
    """ours_jax at the reference shape (hd128) in fresh processes, with XLA's command buffers (CUDA graphs)
    as configured by default and with them off: what a standalone call on new buffers costs; and an XLA op of
    the same bytes (Case.same_bytes_fn) in the same harness: the cost of a jax.jit call of that size as such."""
    out = {}
    for name, flags in (("default", ""), ("command_buffers_off", "--xla_gpu_enable_command_buffer=")):
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip(),
               "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        p = subprocess.run([sys.executable, "-c", _JAX_PATH_PROBE], env=env, capture_output=True, text=True)
        out[name] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-1500:]}
    return out


def start_costs(head_dims=(64, 128, 256)) -> dict:
    """Fresh processes: cold start (empty on-disk cache: the CuTe DSL compiles), then warm start (cache hit),
    per configuration: time from the first call's start to its first result (kernel lookup, XLA compile of the
    jitted function, module load, run); plus import times."""
    import tempfile

    cache = tempfile.mkdtemp(prefix="jax_dqpost_bench_cache_")
    arg = ",".join(map(str, head_dims))
    env = {**os.environ, "JAX_DQPOST_CACHE_DIR": cache, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    out = {}
    for name in ("cold", "warm"):
        p = subprocess.run([sys.executable, "-c", _START_PROBE, arg], env=env, capture_output=True, text=True)
        if p.returncode:
            return {"error": p.stderr[-2000:]}
        out[name] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


# ---- report ----------------------------------------------------------------------------------------------
def _tbps(res, impl):
    return res["bytes"] / res[impl] / 1e12 if impl in res else float("nan")


def table(rows) -> str:
    head = (f"{'config':>13} {'mode':>6} | {'MB':>6} | {'ours us (TB/s)':>15} | {'FA4 us (TB/s)':>15} | "
            f"{'copy us (TB/s)':>15} | {'ours/FA4':>8} | {'of copy':>7} | {'jax us':>8} | {'gather us':>9} | "
            f"{'x gather':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        us = lambda k: f"{r[k] * 1e6:7.1f} ({_tbps(r, k):4.2f})" if k in r else f"{'-':>15}"  # noqa: E731
        lines.append(
            f"{r['config']:>13} {r['mode']:>6} | {r['bytes'] / 1e6:6.1f} | {us('ours'):>15} | {us('FA4'):>15} | "
            f"{us('copy'):>15} | {r.get('FA4', math.nan) / r['ours']:8.3f} | {r['copy'] / r['ours']:7.1%} | "
            f"{r['ours_jax'] * 1e6:8.1f} | {r['jnp_gather'] * 1e6:9.1f} | {r['jnp_gather'] / r['ours_jax']:8.1f}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["sweep"]]
    configs = [c for c, _, _ in CONFIGS]
    fig, axes = plt.subplots(2, len(configs), figsize=(4 * len(configs), 7), sharey=True, squeeze=False)
    for i, mode in enumerate(("dense", "varlen")):
        for j, config in enumerate(configs):
            ax = axes[i, j]
            rs = sorted((r for r in rows if r["mode"] == mode and r["config"] == config), key=lambda r: r["bytes"])
            for impl in IMPLS:
                pts = [(r["bytes"], _tbps(r, impl)) for r in rs if impl in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, label=impl)
            ax.set_xscale("log")
            ax.set_title(f"{config} {mode}", fontsize=9)
            ax.grid(True, alpha=0.3)
            if i == 1:
                ax.set_xlabel("bytes moved per call")
            if j == 0:
                ax.set_ylabel("TB/s")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"dQ postprocess, bf16, {report['gpu']}, {report['date']} ({report['commit']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _commit() -> str:
    try:
        here = Path(__file__).resolve().parents[1]
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
        if c.returncode == 0:
            return c.stdout.strip()
    except OSError:
        pass
    return os.environ.get("JAX_DQPOST_COMMIT", "unknown")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_dqpost.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_results", help="directory for bench.json and bench.png")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and samples")
    parser.add_argument("--samples", type=int, default=None, help="samples per measurement (median)")
    parser.add_argument("--plot", metavar="JSON", help="only redraw the plot of a saved bench.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), out / "bench.png")
        return 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
    import jax
    import torch

    if not torch.cuda.is_available() or jax.default_backend() != "gpu":
        print("python -m jax_dqpost.bench needs a CUDA GPU visible to both torch and JAX", file=sys.stderr)
        return 1
    try:
        from flash_attn.cute.interface import _bwd_postprocess_convert as fa4
    except Exception as e:  # noqa: BLE001
        log(f"FlashAttention-4 not importable ({type(e).__name__}: {e}); its columns stay empty")
        fa4 = None
    samples = args.samples or (9 if args.quick else 25)
    sizes = SIZES[::2] if args.quick else SIZES
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "commit": _commit(), "gpu": torch.cuda.get_device_name(), "jax": jax.__version__,
              "flash_attn": _version("flash-attn-4") or _version("flash_attn"), "samples": samples,
              "method": METHOD, "reference": [], "sweep": []}
    rng = np.random.default_rng(0)
    todo = [(c, m, s) for c in CONFIGS for m in ("dense", "varlen") for s in [None, *sizes]]
    for k, ((name, D, causal), mode, size) in enumerate(todo):
        log(f"[{k + 1}/{len(todo)}] {name} {mode} {'B,H,S=' + str(REFERENCE_SHAPE) if size is None else size}")
        r = measure(Case(name, D, causal, mode, size, rng, torch, fa4), samples)
        report["reference" if size is None else "sweep"].append(r)
    log(f"{MANY_SEQUENCES} short sequences (hd128)")
    report["many_sequences"] = measure(Case(f"hd128-{MANY_SEQUENCES}seq", 128, False, "varlen", None, rng, torch, fa4,
                                            sequences=MANY_SEQUENCES), samples)
    log("chain of 200 tiny calls")
    report["chain"] = chain_cost(samples)
    log("cold and warm start")
    report["start"] = start_costs()
    log("jax path with and without command buffers")
    report["jax_path"] = jax_path_costs()
    (out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out / "bench.png")
    print(f"== {report['gpu']}, {report['date']}, commit {report['commit']}, jax {report['jax']}, "
          f"FlashAttention-4 {report['flash_attn']}; median of {samples} samples")
    print(f"\n== B, H, S = {REFERENCE_SHAPE}, bf16 (varlen: 64 random lengths, same tokens)")
    print(table(report["reference"]))
    dense = {r["config"]: r for r in report["reference"] if r["mode"] == "dense"}
    for r in report["reference"]:
        if r["mode"] == "varlen":
            d = dense[r["config"]]
            print(f"varlen {r['config']}: {d['ours'] / r['ours']:.1%} of our dense throughput "
                  f"(time {d['ours'] * 1e6:.1f} -> {r['ours'] * 1e6:.1f} us for {r['tokens']} tokens)")
    m, d = report["many_sequences"], dense["hd128"]
    print(f"{m['sequences']} random lengths, hd128, {m['tokens']} tokens: ours {m['ours'] * 1e6:.1f} us "
          f"({d['ours'] / m['ours']:.1%} of dense), FlashAttention-4 {m.get('FA4', math.nan) * 1e6:.1f} us; CTAs per "
          f"head launched {m['tiles_launched']}, needed by the sequences {m['tiles_needed']}")
    print("\n== size sweep (bytes moved per call)")
    print(table(sorted(report["sweep"], key=lambda r: (r["config"], r["mode"], r["bytes"]))))
    c = report["chain"]
    print(f"\n== per-call cost in a jitted chain of {c['calls']} tiny calls {tuple(c['shape'])}: ours "
          f"{c['ours'] * 1e6:.2f} us ({c['our_calls_in_program']} calls in the compiled program; whole program "
          f"{c['ours_program_n'] * 1e6:.0f} us vs {c['ours_program_1'] * 1e6:.0f} us for one call); "
          f"{c['ours_outputs_returned'] * 1e6:.2f} us when all {c['calls']} outputs are results of the program; "
          f"XLA elementwise op {c['xla_elementwise'] * 1e6:.2f} us per kernel ({c['xla_kernels_in_program']} "
          f"kernels)")
    for label, key in (("ours", "ours_device"), ("XLA elementwise", "xla_device")):
        dev = c.get(key) or {}
        if "per_call" in dev:
            print(f"   GPU timeline (jax.profiler, one execution): {label} {dev['per_call'] * 1e6:.2f} us per call on the "
                  f"device ({dev['kernels']} kernels, median {dev['median_duration'] * 1e6:.2f} us each, median gap "
                  f"{dev['median_gap'] * 1e6:.2f} us)")
        else:
            print(f"   GPU timeline of {label}: not recorded {dev.get('error', '')}")
    s = report["start"]
    if "error" in s:
        print(f"start probe failed: {s['error']}")
    else:
        for name in ("cold", "warm"):
            cfg = ", ".join(f"hd{c['head_dim']} {c['first_result']:.3f} s (kernel {c['get_kernel']:.3f} s)"
                            for c in s[name]["configs"])
            print(f"== {name} start, first call to first result: {cfg}; import jax {s[name]['import_jax']:.3f} s, "
                  f"import jax_dqpost {s[name]['import_jax_dqpost']:.3f} s")
    for name, r in report["jax_path"].items():
        print(f"== jax.jit(dq_postprocess) hd128 dense {REFERENCE_SHAPE}, XLA command buffers {name}: " + (
            r["error"][-300:] if "error" in r else
            ", ".join(f"{k.replace('_', ' ')} {v * 1e6:.1f} us per call" for k, v in r.items())))
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
