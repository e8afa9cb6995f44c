"""Times attention as JAX users call it, forward and backward: ``jax_dqpost.dot_product_attention`` with
``implementation='fa4'`` with and without sinks, against ``jax.nn.dot_product_attention(implementation='cudnn')``
(cuDNN's has no sinks), ``implementation='xla'`` and ``'xla_chunked'`` with sinks, and ``'xla'`` without sinks beside
``jax.nn.dot_product_attention(implementation='xla')``.

    python -m benchmarks.attention [--out DIR] [--steps N] [--quick]   (a CUDA GPU of sm90/sm100, fa4-jax 0.1.0)

Shapes: gpt-oss's (head dim 64, 64 query heads over 8 key/value heads, causal, with its sliding window,
``local_window_size=(127, 0)``: a query sees itself and the 127 keys before, and without) and a llama-like one (head
dim 128, 32 over 8 heads, causal), B=1, T = S = 4096 and 8192, bf16 (``--quick``: T = 4096). Each step is
``jax.jit`` of ``jax.grad`` of ``sum(out * w)`` in query, key, value (and the sinks): the forward and the backward.
Device time as in :mod:`benchmarks.fa4jax` (the sum of a step's GPU activities on jax.profiler's timeline, median
over the traced steps; the implementations in turn, order reversed every other round). An implementation that cannot
run a shape (cuDNN's refusals) is recorded as skipped with its first line; so is one whose compiled step needs more
memory than the device has free (XLA's ``memory_analysis``: temporaries and outputs), before it runs. Each
implementation's ``memory_mib`` is that compiled need. Prints a table and writes ``attention.json`` into
``--out``.
"""

from __future__ import annotations

import argparse
import sys

from .fa4jax import measure, run_all

METHOD = ("device time of jax.jit(jax.grad(sum(out * w))) in query, key, value (and the sinks): forward and backward; "
          "per step, the sum of the durations of its GPU activities on jax.profiler's timeline; median over the "
          "steps; the implementations in turn in one trace, order reversed every other round")
IMPLEMENTATIONS = ("fa4", "fa4 sinks", "cudnn", "xla sinks", "xla_chunked sinks", "xla", "jax.nn xla")


def shapes(quick: bool):
    gpt_oss = dict(batch=1, heads=64, heads_kv=8, head_dim=64)
    llama = dict(batch=1, heads=32, heads_kv=8, head_dim=128)
    return [dict(shape, name=name, seqlen=t, window=window)
            for t in ((4096,) if quick else (4096, 8192))
            for name, shape, window in (("gpt-oss, window (127, 0)", gpt_oss, 127), ("gpt-oss, causal", gpt_oss, None),
                                        ("llama, causal", llama, None))]


def steps(shape):
    """``{implementation: (step, args)}``: each a jitted gradient of ``sum(out * w)``."""
    import jax
    import jax.numpy as jnp

    from jax_dqpost import dot_product_attention

    b, t, n, n_kv, h, window = (shape[k] for k in ("batch", "seqlen", "heads", "heads_kv", "head_dim", "window"))
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, t, n_kv, h), jnp.bfloat16) for key in keys[1:3])
    sinks = jax.random.normal(keys[3], (n,), jnp.float32)
    w = jax.random.normal(keys[4], (b, t, n, h), jnp.float32)
    kw = dict(is_causal=True, local_window_size=(window, 0) if window else None)

    def grad(attention, with_sinks):
        def loss(q, k, v, sinks, w):
            return jnp.sum(attention(q, k, v, sinks).astype(jnp.float32) * w)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if with_sinks else (0, 1, 2))), (q, k, v, sinks, w)

    return {
        "fa4": grad(lambda q, k, v, s: dot_product_attention(q, k, v, **kw, implementation="fa4"), False),
        "fa4 sinks": grad(lambda q, k, v, s: dot_product_attention(q, k, v, **kw, sinks=s, implementation="fa4"),
                          True),
        "cudnn": grad(lambda q, k, v, s: jax.nn.dot_product_attention(q, k, v, **kw, implementation="cudnn"), False),
        "xla sinks": grad(lambda q, k, v, s: dot_product_attention(q, k, v, **kw, sinks=s, implementation="xla"),
                          True),
        "xla_chunked sinks": grad(lambda q, k, v, s: dot_product_attention(q, k, v, **kw, sinks=s,
                                                                           implementation="xla_chunked"), True),
        "xla": grad(lambda q, k, v, s: dot_product_attention(q, k, v, **kw, implementation="xla"), False),
        "jax.nn xla": grad(lambda q, k, v, s: jax.nn.dot_product_attention(q, k, v, **kw, implementation="xla"),
                           False),
    }


def compiled_bytes(step, args) -> int:
    """What XLA's compiled ``step`` needs beyond its arguments: temporaries and outputs (``memory_analysis``)."""
    stats = step.lower(*args).compile().memory_analysis()
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)


def free_bytes() -> int | None:
    """The default device's memory XLA's allocator can still hand out (None where it does not say)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def run_shape(shape, n_steps: int) -> dict:
    """The shape's implementations that run it, timed side by side; the others skipped with their error."""
    import jax

    runs, skipped, memory = {}, {}, {}
    for name, (step, args) in steps(shape).items():
        try:
            memory[name] = compiled_bytes(step, args) / 2 ** 20
            free = free_bytes()
            if free is not None and memory[name] > free / 2 ** 20:
                skipped[name] = (f"needs {memory[name] / 1024:.1f} GiB (XLA's memory_analysis), the device has "
                                 f"{free / 2 ** 30:.1f} GiB free")
                continue
            jax.block_until_ready(step(*args))
            runs[name] = (step, args)
        except Exception as e:  # noqa: BLE001 - a refusal or running out of memory is a result
            skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    result = dict(shape, **measure(runs, n_steps), skipped=skipped)
    for name, mib in memory.items():
        result.setdefault(name, {})["memory_mib"] = mib
    return result


def table(results) -> str:
    rows = ["| shape | T | 'fa4' (us) | 'fa4' with sinks (us) | the sinks' cost | cuDNN, no sinks (us) | 'fa4' over "
            "cuDNN | 'xla' with sinks (us) | 'fa4' over 'xla', sinks | 'xla_chunked' with sinks (us) | memory, "
            "'xla' / 'xla_chunked' (MiB) | 'xla' (us) | jax.nn's 'xla' (us) | 'xla' over jax.nn's |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def us(r, name):
        return r.get(name, {}).get("step_us")

    for r in results:
        f, s, c, x, xc, ours, theirs = (us(r, n) for n in IMPLEMENTATIONS)
        fmt = lambda v: "skipped" if v is None else f"{v:.1f}"  # noqa: E731
        ratio = lambda a, b: "n/a" if a is None or b is None else f"{b / a:.2f}x"  # noqa: E731
        cost = "n/a" if f is None or s is None else f"{100 * (s / f - 1):+.1f}%"
        mib = " / ".join("n/a" if r.get(n, {}).get("memory_mib") is None else f"{r[n]['memory_mib']:.0f}"
                         for n in ("xla sinks", "xla_chunked sinks"))
        rows.append(f"| {r['name']} | {r['seqlen']} | {fmt(f)} | {fmt(s)} | {cost} | {fmt(c)} | {ratio(f, c)} | "
                    f"{fmt(x)} | {ratio(s, x)} | {fmt(xc)} | {mib} | {fmt(ours)} | {fmt(theirs)} | "
                    f"{ratio(ours, theirs)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="folder for attention.json")
    p.add_argument("--steps", type=int, default=20, help="traced steps per implementation and shape")
    p.add_argument("--quick", action="store_true", help="T = 4096 only")
    args = p.parse_args(argv)
    return run_all(p.prog, args.out, "attention.json", METHOD, shapes(args.quick),
                   lambda shape: run_shape(shape, args.steps), table)


if __name__ == "__main__":
    sys.exit(main())
