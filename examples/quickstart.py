"""Quickstart: ``jax_dqpost.dot_product_attention`` in place of ``jax.nn.dot_product_attention``, with gpt-oss's
learnable sinks and sliding window, forward and backward under jax.jit.

On an NVIDIA Hopper or Blackwell GPU with fa4-jax installed it runs FlashAttention-4's kernels (the sinks' gradient
in jax-dqpost's postprocess launch); everywhere else (CPU by default here) the same attention in jax.numpy. It
checks itself: without sinks it is jax.nn's attention; a sink takes a share of every row's softmax.

    python examples/quickstart.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_dqpost

B, T, N, K, H = 2, 256, 8, 2, 64  # batch, sequence, query heads, key/value heads, head dim
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16) for _ in range(2))
sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)  # one learnable logit per query head


# The only change from jax.nn: the import, and the sinks. gpt-oss's window is (127, 0): it masks keys 128 or more
# positions back, so a query sees itself and the 127 before.
@jax.jit
def loss_and_grads(q, k, v, sinks):
    def loss(q, k, v, sinks):
        out = jax_dqpost.dot_product_attention(q, k, v, is_causal=True, local_window_size=(127, 0), sinks=sinks)
        return jnp.mean(out.astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)


value, (dq, dk, dv, dsinks) = loss_and_grads(q, k, v, sinks)
print(f"backend: {jax.default_backend()}; loss {float(value):.5f}; dq {dq.shape} {dq.dtype}, dsinks {dsinks.shape}")

# Without sinks its jax.numpy implementation is jax.nn's attention (in float32 here, to the rounding of a sum's
# order) ...
x32 = [x.astype(jnp.float32) for x in (q, k, v)]
ours = jax_dqpost.dot_product_attention(*x32, is_causal=True, local_window_size=(127, 0), implementation="xla")
theirs = jax.nn.dot_product_attention(*x32, is_causal=True, local_window_size=(127, 0))
same = bool(jnp.max(jnp.abs(ours - theirs)) <= 1e-6 * jnp.max(jnp.abs(theirs)))
# ... and a sink of +inf would take every row's whole softmax: a large one leaves little to the values.
damped = jax_dqpost.dot_product_attention(*x32, is_causal=True, sinks=jnp.full(N, 30.0), implementation="xla")
print("jax.nn's attention without sinks:", same, "| a large sink takes the softmax:",
      bool(jnp.max(jnp.abs(damped)) < 1e-6))
if not same or not jnp.max(jnp.abs(damped)) < 1e-6 or not np.isfinite(np.asarray(dsinks)).all():
    raise SystemExit(1)
