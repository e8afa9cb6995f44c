"""Times attention with learnable sinks, forward and backward: ``jax_dqpost.fa4jax`` with and without the sink,
against the same attention with a sink column in jax.numpy under ``jax.jit``.

    python -m benchmarks.sinks [--out DIR] [--steps N]     (needs a CUDA GPU of sm90/sm100 and fa4-jax 0.1.0)

Shapes: gpt-oss's (head dim 64, 64 query heads over 8 key/value heads, causal, with its sliding window of 128 keys
and without) and one at head dim 128 (32 over 8 heads, causal); B=1, S=4096, bf16. Each step is ``jax.jit`` of
``jax.grad`` of ``sum(out * w)`` in q, k, v (and the sink): the forward and the backward. Device time as in
:mod:`benchmarks.fa4jax` (the sum of a step's GPU activities on jax.profiler's timeline, median over the traced
steps; the implementations in turn, order reversed every other round). Prints a table and writes ``sinks.json``
into ``--out``.
"""

from __future__ import annotations

import argparse
import sys

from .fa4jax import measure, run_all

METHOD = ("device time of jax.jit(jax.grad(sum(out * w))) in q, k, v (and the sink): forward and backward; per step, "
          "the sum of the durations of its GPU activities on jax.profiler's timeline; median over the steps; the "
          "implementations in turn in one trace, order reversed every other round")


def shapes():
    gpt_oss = dict(batch=1, seqlen=4096, heads=64, heads_kv=8, head_dim=64)
    return [dict(gpt_oss, name="gpt-oss, window 128", window=128), dict(gpt_oss, name="gpt-oss, causal", window=None),
            dict(batch=1, seqlen=4096, heads=32, heads_kv=8, head_dim=128, name="hd 128, causal", window=None)]


def plain_attention(q, k, v, sink, window):
    """Causal attention with a sink column, float32 softmax, as one writes it in jax.numpy."""
    import jax
    import jax.numpy as jnp

    s_len, group = q.shape[1], q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = jnp.einsum("bshd,bthd->bhst", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    i, j = jnp.arange(s_len)[:, None], jnp.arange(s_len)[None, :]
    s = jnp.where((j <= i) & ((i - j <= window) if window else True), s, -jnp.inf)
    column = jnp.broadcast_to(sink.astype(jnp.float32)[None, :, None, None], (*s.shape[:3], 1))
    p = jax.nn.softmax(jnp.concatenate([s, column], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhst,bthd->bshd", p.astype(v.dtype), v)


def steps(shape):
    """``{name: (step, args)}`` for ``fa4jax`` without the sink, ``sink`` and ``jnp``."""
    import jax
    import jax.numpy as jnp

    from jax_dqpost import fa4jax

    b, s, h, hkv, d, window = (shape[k] for k in ("batch", "seqlen", "heads", "heads_kv", "head_dim", "window"))
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, s, hkv, d), jnp.bfloat16) for key in keys[1:3])
    sink = jax.random.normal(keys[3], (h,), jnp.float32)
    w = jax.random.normal(keys[4], (b, s, h, d), jnp.float32)
    kw = dict(causal=True, window_size=(window, 0) if window else None)

    def grad(attention, with_sink):
        def loss(q, k, v, sink, w):
            return jnp.sum(attention(q, k, v, sink).astype(jnp.float32) * w)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if with_sink else (0, 1, 2))), (q, k, v, sink, w)

    return {"fa4jax": grad(lambda q, k, v, sink: fa4jax.flash_attn(q, k, v, **kw), False),
            "sink": grad(lambda q, k, v, sink: fa4jax.flash_attn(q, k, v, learnable_sink=sink, **kw), True),
            "jnp": grad(lambda q, k, v, sink: plain_attention(q, k, v, sink, window), True)}


def table(results) -> str:
    rows = ["| shape | fa4-jax, no sink (us) | with the sink (us) | the sink's cost | jax.numpy with the sink (us) | "
            "speedup over jax.numpy |", "|---|---|---|---|---|---|"]
    for r in results:
        f, o, j = (r[n]["step_us"] for n in ("fa4jax", "sink", "jnp"))
        rows.append(f"| {r['name']} | {f:.1f} | {o:.1f} | {100 * (o / f - 1):+.1f}% | {j:.1f} | {j / o:.1f}x |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sinks", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="folder for sinks.json")
    p.add_argument("--steps", type=int, default=20, help="traced steps per implementation and shape")
    args = p.parse_args(argv)
    return run_all(p.prog, args.out, "sinks.json", METHOD, shapes(),
                   lambda shape: dict(shape, **measure(steps(shape), args.steps)), table)


if __name__ == "__main__":
    sys.exit(main())
