"""Every JAX transformation of dq_postprocess, each checked against the plain call:

    python examples/transformations.py

jit, vmap (folded into one call), grad (the transpose is dq_accum_from_dq), jax.export (multi-platform,
serialized; and lowering for CUDA without a GPU through cuda_arch), sharding over 8 devices (CPU devices are
forced here; on a multi-GPU machine the same code shards over the GPUs) and a jitted lax.fori_loop (on a GPU,
XLA records the loop body, our call included, in a CUDA graph).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_dqpost  # noqa: E402
from jax_dqpost import AccumLayout, dq_accum_from_dq, dq_postprocess  # noqa: E402

B, S, H, D = 4, 300, 8, 128
# FlashAttention-4's Hopper dQ layout for head_dim 128, without a causal mask
layout = AccumLayout.flash_attention(90, D, causal=False, tensor="dq", version="4.0.0b36")
rng = np.random.default_rng(0)
dq_true = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
acc = dq_accum_from_dq(dq_true, 1.0, layout=layout)  # the accumulator a producer would have written


def f(acc, scale):
    return dq_postprocess(acc, scale, seqlen_q=S, head_dim=D, layout=layout)


def same(a, b):
    return bool(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)))


# jit: one kernel launch on CUDA, the jax.numpy reference elsewhere
dq = jax.jit(f)(acc, 1.0)
print("jit: inverts dq_accum_from_dq:", same(dq, dq_true))

# vmap over a stack of accumulators (folded into the kernel's batch: one call), with per-element scales
accs, scales = jnp.stack([acc, 2 * acc]), jnp.asarray([0.5, 0.25], jnp.float32)
batched = jax.jit(jax.vmap(f))(accs, scales)
print("vmap: equals a Python loop:", all(same(batched[i], f(accs[i], scales[i])) for i in range(2)))

# grad: the op is linear in dq_accum; its transpose scatters the cotangent back into accumulator order
loss = lambda a: (f(a, 0.125).astype(jnp.float32) * dq_true.astype(jnp.float32)).sum()  # noqa: E731
g = jax.jit(jax.grad(loss))(acc)
print("grad: equals dq_accum_from_dq of the cotangent:",
      same(g, dq_accum_from_dq(dq_true.astype(jnp.float32), 0.125, layout=layout)))

# jax.export: our custom calls are not on JAX's list of stable targets; jax_dqpost.DISABLED_CHECKS disables
# that check for them
specs = (jax.ShapeDtypeStruct(acc.shape, jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))
with jax_dqpost.cuda_arch("sm_90a"):  # the GPU the CUDA lowering compiles for (no GPU needed here)
    exported = jax.export.export(jax.jit(f), platforms=["cpu", "cuda"],
                                 disabled_checks=jax_dqpost.DISABLED_CHECKS)(*specs)
restored = jax.export.deserialize(exported.serialize())
print("export:", restored.platforms, "round trip equal:", same(restored.call(acc, np.float32(1.0)), dq_true))

# sharding: batch and heads shard with no collective (each device converts its own tiles)
devices = jax.devices() if len(jax.devices()) >= 2 else jax.devices("cpu")  # GPUs when there are several
n = min(8, len(devices)) // 2 * 2
mesh = Mesh(np.array(devices[:n]).reshape(2, n // 2), ("b", "h"))
sharded_acc = jax.device_put(acc, NamedSharding(mesh, P("b", "h", None)))  # (B, H, Sr * Dr)
sharded = jax.jit(f)(sharded_acc, 1.0)
print("sharding:", sharded.sharding.spec, "on", len(sharded.sharding.device_set), "devices, equal:",
      same(sharded, dq_true))

# a jitted device-side loop (on a GPU XLA captures its body, our call included, in a command buffer)
looped = jax.jit(lambda a, s: jax.lax.fori_loop(
    0, 3, lambda i, o: o.at[i].set(f(a, s[i])), jnp.zeros((3, B, S, H, D), jnp.bfloat16)))
out = looped(acc, jnp.asarray([1.0, 0.5, 0.25], jnp.float32))
print("fori_loop: equals three calls:", all(same(out[i], f(acc, s)) for i, s in enumerate([1.0, 0.5, 0.25])))
