"""Attention over several devices: what context parallelism costs on paper, and the runs that several GPUs allow.

    python -m benchmarks.context_parallel --paper                 # the table of docs/performance.md (no device)
    python -m benchmarks.context_parallel --devices N [--seqlen T] [--steps K]

``--paper``: per device and per layer, for gpt-oss's attention (64 query heads over 8 key/value heads, head dim 64)
and a llama-like one (64 over 8, head dim 128), causal, bf16, at T = 32k to 1M tokens over n = 2 to 64 devices:
the bytes each device receives in the forward's all-gather of K and V (``2 T K H * 2 (n - 1) / n``: the backward's
reduce-scatter moves as much again), the forward's attention FLOPs each device computes with the zigzag layout
(``2 T^2 N H / n``: a causal mask's half of ``4 T^2 N H``), and the gather's time over the compute's at the rates of
:data:`RATES` (over NVLink within a node of 8, over the network beyond). Where that ratio nears 1, gathering before
computing leaves the devices waiting as long as they compute: a ring, which overlaps the transfer of the next
chunk with the compute of this one, would pay.

``--devices N``: on N local devices (``N`` GPUs; on a CPU, ``--xla_force_host_platform_device_count``), three
wall-clock medians over ``--steps`` steps of ``jax.jit(jax.grad(sum(out * w)))``, each against the same work on one
device: ``'fa4'`` (``'xla'`` where it does not run) with the batch sharded over the devices by ``NamedSharding``
(a batch of N against a batch of 1 on one device: the speed-up of data parallelism, N when nothing is gathered);
at ``--seqlen`` against the whole sequence on one device (``'fa4'`` on GPUs, ``'xla_chunked'`` elsewhere), the
sequence sharded contiguously by ``NamedSharding`` under plain ``jax.jit``, and context parallelism
(``context_axis``, ``'zigzag'``). Prints a table and writes ``context_parallel.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SHAPES = {"gpt-oss": dict(heads=64, heads_kv=8, head_dim=64), "llama-like": dict(heads=64, heads_kv=8, head_dim=128)}
RATES = dict(flops=500e12, nvlink=450e9, network=50e9)
"""Sustained rates on paper: an H100's bf16 attention (FLOP/s, forward, about what FlashAttention reaches), NVLink 4
between the 8 GPUs of a node (bytes/s one way), and a 400 Gb/s network card per GPU beyond it."""
TOKENS = (32 * 1024, 128 * 1024, 512 * 1024, 1024 * 1024)
DEVICES = (2, 8, 16, 64)


def paper(rates=RATES) -> list[dict]:
    """Per device, per layer (module docstring): one row per shape, sequence and device count."""
    rows = []
    for name, shape in SHAPES.items():
        n_q, n_kv, h = shape["heads"], shape["heads_kv"], shape["head_dim"]
        for t in TOKENS:
            for n in DEVICES:
                gathered = 2 * t * n_kv * h * 2 * (n - 1) / n
                flops = 2 * t * t * n_q * h / n
                link = rates["nvlink"] if n <= 8 else rates["network"]
                gather_s, compute_s = gathered / link, flops / rates["flops"]
                rows.append(dict(shape=name, tokens=t, devices=n, gathered_mib=gathered / 2 ** 20,
                                 kv_mib=2 * t * n_kv * h * 2 / 2 ** 20, tflops=flops / 1e12,
                                 gather_ms=1e3 * gather_s, compute_ms=1e3 * compute_s, ratio=gather_s / compute_s))
    return rows


def paper_table(rows) -> str:
    out = ["| shape | T | devices | K and V held (MiB) | received (MiB) | TFLOP a device | gather (ms) | compute "
           "(ms) | gather / compute |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['tokens'] // 1024}k | {r['devices']} | {r['kv_mib']:.0f} | "
                   f"{r['gathered_mib']:.0f} | {r['tflops']:.2f} | {r['gather_ms']:.2f} | {r['compute_ms']:.2f} | "
                   f"{r['ratio']:.3f} |")
    return "\n".join(out)


def _median_s(step, args, n_steps: int) -> float:
    import jax

    jax.block_until_ready(step(*args))
    times = []
    for _ in range(n_steps):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measured(devices: int, seqlen: int, n_steps: int) -> list[dict]:
    """The three runs of ``--devices`` (module docstring), each ``{name, one_s, sharded_s, speedup}``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_dqpost import dot_product_attention, zigzag

    if len(jax.devices()) < devices:
        raise SystemExit(f"--devices {devices}: this machine has {len(jax.devices())} devices")
    mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    shape = SHAPES["gpt-oss"]
    n, n_kv, h = shape["heads"], shape["heads_kv"], shape["head_dim"]
    keys = jax.random.split(jax.random.key(0), 4)

    def inputs(batch, t):
        q = jax.random.normal(keys[0], (batch, t, n, h), dtype)
        k, v = (jax.random.normal(key, (batch, t, n_kv, h), dtype) for key in keys[1:3])
        return q, k, v, jax.random.normal(keys[3], (n,), jnp.float32)

    implementation = "fa4" if on_gpu else "xla"
    long = "fa4" if on_gpu else "xla_chunked"  # a whole sequence on one device: 'xla''s logits would not fit

    def grad(attention):
        def loss(q, k, v, sinks):
            return jnp.sum(attention(q, k, v, sinks).astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

    plain = grad(lambda q, k, v, s: dot_product_attention(q, k, v, is_causal=True, sinks=s,
                                                          implementation=implementation))
    rows = []
    batch_t = min(seqlen, 4096)
    one = _median_s(plain, inputs(1, batch_t), n_steps)
    q, k, v, s = inputs(devices, batch_t)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    sharded = _median_s(plain, (put(q, P("d")), put(k, P("d")), put(v, P("d")), put(s, P())), n_steps)
    rows.append(dict(name=f"batch sharded over {devices}, '{implementation}', T {batch_t}", one_s=one,
                     sharded_s=sharded, speedup=devices * one / sharded))

    q, k, v, s = inputs(1, seqlen)
    causal = grad(lambda q, k, v, s: dot_product_attention(q, k, v, is_causal=True, sinks=s, implementation=long))
    whole = _median_s(causal, (q, k, v, s), n_steps)
    spec = P(None, "d")
    rows_sharded = _median_s(causal, (put(q, spec), put(k, spec), put(v, spec), put(s, P())), n_steps)
    rows.append(dict(name=f"sequence sharded under jax.jit over {devices}, contiguous, '{long}', T {seqlen}",
                     one_s=whole, sharded_s=rows_sharded, speedup=whole / rows_sharded))

    def context(q, k, v, s):
        return dot_product_attention(q, k, v, is_causal=True, sinks=s, implementation=long, context_axis="d",
                                     context_layout="zigzag")

    cp = grad(jax.shard_map(context, mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=spec))
    ordered = [put(zigzag(x, devices), spec) for x in (q, k, v)]
    parallel = _median_s(cp, (*ordered, s), n_steps)
    rows.append(dict(name=f"context parallel over {devices}, zigzag, '{long}', T {seqlen}", one_s=whole,
                     sharded_s=parallel, speedup=whole / parallel))
    return rows


def measured_table(rows) -> str:
    out = ["| run | one device (ms) | sharded (ms) | speed-up |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['name']} | {1e3 * r['one_s']:.2f} | {1e3 * r['sharded_s']:.2f} | {r['speedup']:.2f}x |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel", description=__doc__.splitlines()[0])
    p.add_argument("--paper", action="store_true", help="print the cost on paper (no device)")
    p.add_argument("--devices", type=int, help="time the runs over this many local devices")
    p.add_argument("--seqlen", type=int, default=32 * 1024, help="the context-parallel run's T (default 32k)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--out", default=".", help="folder for context_parallel.json")
    args = p.parse_args(argv)
    if not args.paper and args.devices is None:
        p.error("give --paper or --devices N")
    if args.devices is not None and (args.devices < 2 or args.seqlen % (2 * args.devices)):
        p.error(f"--devices must be at least 2 and divide --seqlen in 2 n chunks, got --devices {args.devices} "
                f"--seqlen {args.seqlen}")
    result = {}
    if args.paper:
        result["paper"] = paper()
        print(paper_table(result["paper"]))
    if args.devices is not None:
        result["measured"] = measured(args.devices, args.seqlen, args.steps)
        print(measured_table(result["measured"]))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "context_parallel.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
