"""``--devices N``: the reference shape (hd128, FlashAttention-4's Hopper dQ preset, B, H, S = 2, 32, 8192, bf16)
on one GPU and sharded over N GPUs of the host, over batch and over heads, in device time.

Each configuration is one jitted program over rotated accumulators (>= 256 MiB in all, per device); its device time
per call is the span of our kernels on a GPU's timeline (jax.profiler), over the calls, the slowest GPU's for a
sharded program. Throughput against one GPU is the ratio of the two. The compiled sharded program is checked for
collectives (all-gather, all-reduce, all-to-all, collective-permute, reduce-scatter): batch and heads shard with
none. Every sharded result is compared bit for bit with the one-GPU result of the same inputs.
"""

from __future__ import annotations

import re

import numpy as np

from . import cases, harness

COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(")
METHOD = ("device time per call: span of our kernels on each GPU's jax.profiler timeline in one jitted program over "
          "rotated buffers, the slowest GPU's, over the calls; median of samples; speedup = one GPU / N GPUs")


def collectives(hlo_text: str) -> list[str]:
    """The collective ops in a compiled program's text (none expected when batch or heads are sharded)."""
    return sorted({m.group(1) for m in COLLECTIVES.finditer(hlo_text)})


def program(layout, head_dim: int, seqlen: int):
    """The jitted-program body: our op on every accumulator of a list."""
    import jax.numpy as jnp

    from jax_dqpost import dq_postprocess

    def f(accs):
        return [dq_postprocess(a, head_dim ** -0.5, seqlen_q=seqlen, head_dim=head_dim, dtype=jnp.bfloat16,
                               layout=layout) for a in accs]
    return f


def measure(n: int, samples: int) -> dict:
    """One GPU against ``n`` GPUs sharded over batch and over heads (``jax.devices()[:n]``)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    gpus = jax.devices()
    if len(gpus) < n:
        return {"error": f"--devices {n}: this machine has {len(gpus)} GPU(s) visible to JAX"}
    B, H, S = cases.REFERENCE_SHAPE
    D = 128
    layout = cases.AccumLayout.flash_attention(90, D, causal=False, tensor="dq", version="4.0.0b36")
    shape = layout.accum_shape(B, H, S, D)
    per_call = int(np.prod(shape)) * 4 + B * S * H * D * 2
    copies = max(2, -(-cases.ROTATE_BYTES // (per_call // n)))
    keys = jax.random.split(jax.random.PRNGKey(3), copies)
    host = [np.asarray(jax.random.normal(k, shape, np.float32)) for k in keys]
    body = program(layout, D, S)
    out = {"shape": [B, H, S, D], "layout": repr(layout), "devices": n, "gpu": gpus[0].device_kind, "calls": copies,
           "bytes": B * S * H * (layout.padded_head_dim(D) * 4 + D * 2), "method": METHOD}

    def timed(f, args):
        return harness.device_time_per_call(f, (args,), harness.OUR_KERNEL, copies, max(3, samples // 5))

    one = [jax.device_put(a, gpus[0]) for a in host]
    f1 = jax.jit(body)
    out["one_gpu"] = timed(f1, one)
    want = [np.asarray(x) for x in f1(one[:1])]
    del one  # free the single-GPU copies before the sharded ones are placed
    for axis, spec in (("batch", P("d", None, None)), ("heads", P(None, "d", None))):
        mesh = Mesh(np.array(gpus[:n]), ("d",))
        sharding = NamedSharding(mesh, spec)
        placed = [jax.device_put(a, sharding) for a in host]
        fn = jax.jit(body, in_shardings=([sharding] * copies,))
        text = fn.lower(placed).compile().as_text()
        t = timed(fn, placed)
        got = [np.asarray(x) for x in jax.jit(body, in_shardings=([sharding],))(placed[:1])]
        same = all(np.array_equal(g.view(np.uint16), w.view(np.uint16)) for g, w in zip(got, want))
        out[axis] = {"device_time": t, "speedup": (out["one_gpu"] / t) if t and out["one_gpu"] else None,
                     "collectives": collectives(text), "same_bits_as_one_gpu": same}
        del placed
    return out


def table(r: dict) -> str:
    if "error" in r:
        return r["error"]
    if not r.get("one_gpu"):
        return f"--devices {r['devices']}: the profiler recorded no kernel of ours on the GPU timeline"
    lines = [f"hd128 {tuple(r['shape'])} bf16 on {r['devices']} x {r['gpu']}: one GPU "
             f"{r['one_gpu'] * 1e6:.1f} us per call (device time)"]
    for axis in ("batch", "heads"):
        a = r.get(axis) or {}
        if a.get("device_time"):
            lines.append(f"  sharded over {axis}: {a['device_time'] * 1e6:.1f} us per call on the slowest GPU, "
                         f"{a['speedup']:.2f}x one GPU's throughput (goal >= {0.95 * r['devices']:.2f}x); "
                         f"collectives in the compiled program: {a['collectives'] or 'none'}; same bits as one GPU: "
                         f"{a['same_bits_as_one_gpu']}")
    return "\n".join(lines)
