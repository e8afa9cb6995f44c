"""A jitted training step whose attention backward finishes dQ with jax-dqpost.

The attention here is plain JAX with a custom VJP that mimics FlashAttention's backward: it accumulates the
unscaled dQ = dS @ K in float32, in the accumulator order of FlashAttention's Hopper kernel for this head dim
(``dq_accum_from_dq`` plays the producer's part), and ``dq_postprocess`` turns that into scaled bf16 dQ.
A few SGD steps on a query projection must reduce the loss. Runs on CPU by default.

    python examples/train_step.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dqpost import AccumLayout, dq_accum_from_dq, dq_postprocess

B, S, H, D = 2, 96, 2, 64
LAYOUT = AccumLayout.flash_attention(90, D)  # (128, 256, 2, False, 32) for head dim 64 on Hopper


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention(q, k, v, scale):
    p = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q, k).astype(jnp.float32) * scale, axis=-1)
    return jnp.einsum("bhst,bthd->bshd", p.astype(v.dtype), v)


def _fwd(q, k, v, scale):
    return attention(q, k, v, scale), (q, k, v)


def _bwd(scale, res, do):
    q, k, v = res
    f32 = lambda x: x.astype(jnp.float32)
    p = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", f32(q), f32(k)) * scale, axis=-1)
    dv = jnp.einsum("bhst,bshd->bthd", p, f32(do))
    dp = jnp.einsum("bshd,bthd->bhst", f32(do), f32(v))
    ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))
    dk = jnp.einsum("bhst,bshd->bthd", ds, f32(q)) * scale
    # The producer: unscaled fp32 dQ, stored in FlashAttention's accumulator order...
    dq_accum = dq_accum_from_dq(jnp.einsum("bhst,bthd->bshd", ds, f32(k)), 1.0, layout=LAYOUT)
    # ...and the postprocess: scale, round to bf16, natural layout.
    dq = dq_postprocess(dq_accum, scale, seqlen_q=S, head_dim=D, dtype=q.dtype, layout=LAYOUT)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


attention.defvjp(_fwd, _bwd)


def loss_fn(w, x, k, v, target):
    q = jnp.einsum("bshd,de->bshe", x, w).astype(jnp.bfloat16)
    out = attention(q, k, v, D ** -0.5)
    return jnp.mean((out.astype(jnp.float32) - target) ** 2)


@jax.jit
def train_step(w, x, k, v, target, lr):
    loss, grad = jax.value_and_grad(loss_fn)(w, x, k, v, target)
    return w - lr * grad, loss


def main():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
    w_true = jnp.asarray(rng.standard_normal((D, D)) / np.sqrt(D), jnp.float32)
    target = attention(jnp.einsum("bshd,de->bshe", x, w_true).astype(jnp.bfloat16), k, v, D ** -0.5)
    target = target.astype(jnp.float32)
    w = jnp.asarray(rng.standard_normal((D, D)) / np.sqrt(D), jnp.float32)
    # The custom backward (through dq_postprocess) agrees with plain autodiff of the same attention.
    plain = lambda w: jnp.mean((jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(jnp.einsum(
        "bshd,bthd->bhst", jnp.einsum("bshd,de->bshe", x, w).astype(jnp.bfloat16).astype(jnp.float32),
        k.astype(jnp.float32)) * D ** -0.5, axis=-1), v.astype(jnp.float32)) - target) ** 2)
    g_custom, g_plain = jax.grad(loss_fn)(w, x, k, v, target), jax.grad(plain)(w)
    rel = float(jnp.linalg.norm(g_custom - g_plain) / jnp.linalg.norm(g_plain))
    losses = []
    for _ in range(50):
        w, loss = train_step(w, x, k, v, target, 50.0)
        losses.append(float(loss))
    print(f"backend: {jax.default_backend()}, gradient vs plain autodiff: relative error {rel:.2e}; "
          f"loss {losses[0]:.5f} -> {losses[-1]:.5f} in {len(losses)} steps")
    if not rel < 3e-2 or not losses[-1] < 0.7 * losses[0]:
        raise SystemExit("wrong gradient or the loss did not go down")


if __name__ == "__main__":
    main()
