"""Overheads the benchmark measures besides the kernel: the per-call cost in a jitted chain of tiny calls, cold
and warm start in fresh processes, and the jax.jit path with and without XLA's command buffers."""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

from . import harness, internals


def chain_cost(samples: int, n: int = 200) -> dict:
    """Per-call cost inside one jitted program of ``n`` tiny calls: (t(n) - t(1)) / (n - 1), where t is the
    median time from dispatch to result of the whole program. Each call has its own scale (no two are
    common subexpressions) and every output is returned (none is dead); the compiled program is checked
    to launch ``n`` of our calls. For comparison, a chain of XLA elementwise ops of the same bytes
    (x -> x * s, each on the previous result), per kernel XLA launched. Both also from the GPU's own timeline
    (jax.profiler): device time per call, kernel duration and idle gap, which the wall clock cannot split."""
    import re

    import jax

    from jax_dqpost import AccumLayout, dq_postprocess

    layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
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

    # Whether XLA may capture our calls into its command buffers (JAX_DQPOST_COMMAND_BUFFERS; the default is yes).
    out = {"shape": [1, S, 1, D], "calls": n, "command_buffers": internals.command_buffers()}
    t1, _ = timed(ours, 1)
    tn, text = timed(ours, n)
    out["ours_device"] = harness.device_per_kernel(jax.jit(ours, static_argnums=1), (acc, n), harness.OUR_KERNEL)
    out["our_calls_in_program"] = len(re.findall(f'custom_call_target="{internals.TARGET_NAME}"', text))
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
    out["xla_device"] = harness.device_per_kernel(jax.jit(elementwise, static_argnums=1), (acc, n), "multiply")
    return out


_START_PROBE = r"""
import os, sys, time, json
t0 = time.perf_counter()
import jax, jax.numpy as jnp
t1 = time.perf_counter()
import jax_dqpost
from jax_dqpost import AccumLayout, dq_postprocess
from benchmarks import internals  # (and jax_dqpost._kernel.cache, which a first lowering imports)
t2 = time.perf_counter()
jnp.zeros(1).block_until_ready()
jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(8)).block_until_ready()  # XLA's compiler warmed up, not ours
res = {"import_jax": t1 - t0, "import_jax_dqpost": t2 - t1, "configs": []}
for D in map(int, sys.argv[1].split(",")):
    layout = AccumLayout.flash_attention(90, D, causal=False, tensor="dq", version="4.0.0b36")
    acc = jnp.ones(layout.accum_shape(1, 2, 256, D), jnp.float32).block_until_ready()
    s = time.perf_counter()
    internals.get_kernel(internals.plan([internals.dense_part(layout, D, jnp.bfloat16, 256)]), [acc.shape])
    k = time.perf_counter()
    jax.jit(lambda a: dq_postprocess(a, 0.1, seqlen_q=256, head_dim=D, layout=layout))(acc).block_until_ready()
    e = time.perf_counter()
    res["configs"].append({"head_dim": D, "get_kernel": k - s, "first_result": e - s})
print(json.dumps(res))
"""


_JAX_PATH_PROBE = r"""
import json, sys
from benchmarks import cases, harness
case = cases.Case("hd128", 128, False, "dense", None, None, None, None)
case.jax_inputs()
res = {}
for name, fn, rotate in (("rotated_inputs", case.ours_jax_fn(), True), ("same_input", case.ours_jax_fn(), False),
                         ("xla_same_bytes_op", case.same_bytes_fn(), True)):
    res[name] = harness.per_call(case.jax_run(fn, rotate=rotate), case.copies, 15, harness.wall_clock,
                                 harness.MIN_WALL_SAMPLE_S)
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
        p = harness.python_child(_JAX_PATH_PROBE, env)
        out[name] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-1500:]}
    return out


def start_costs(head_dims=(64, 128, 256)) -> dict:
    """Fresh processes: cold start (empty on-disk cache: the CuTe DSL compiles), then warm start (cache hit),
    per configuration: time from the first call's start to its first result (kernel lookup, XLA compile of the
    jitted function, module load, run); plus import times."""
    import tempfile

    arg = ",".join(map(str, head_dims))
    out = {}
    with tempfile.TemporaryDirectory(prefix="jax_dqpost_bench_cache_") as cache:
        env = {**os.environ, "JAX_DQPOST_CACHE_DIR": cache, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        for name in ("cold", "warm"):
            p = harness.python_child(_START_PROBE, env, arg)
            if p.returncode:
                return {"error": p.stderr[-2000:]}
            out[name] = json.loads(p.stdout.strip().splitlines()[-1])
    return out
