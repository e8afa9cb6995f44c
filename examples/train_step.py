"""A jitted training step whose attention backward is finished by jax-dqpost.

The producer of the fp32 accumulators is real where it can run: on a CUDA GPU with fa4-jax installed
(``pip install fa4-jax==0.1.0``, Python >= 3.12, an sm_80 or newer GPU), the attention is ``jax_dqpost.fa4jax.flash_attn``, whose backward
is FlashAttention-4's kernels (fa4-jax) writing dQ (and, with grouped-query attention as here, dK and dV) in fp32,
then one ``flash_attention_postprocess`` launch. Everywhere else a **stand-in producer** takes its place: plain
JAX with a custom VJP that computes the unscaled dQ in float32, stores it in FlashAttention's Hopper accumulator
order (``dq_accum_from_dq`` plays the backward kernel's part) and finishes it with ``dq_postprocess``. Either way
the gradient must match plain autodiff and a few SGD steps on a query projection must reduce the loss.

    python examples/train_step.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dqpost import AccumLayout, dq_accum_from_dq, dq_postprocess

B, S, H, H_KV, D = 2, 96, 4, 2, 64
# the stand-in's order: (128, 256, 2, False, 32), hd 64 on Hopper
LAYOUT = AccumLayout.flash_attention(90, D, causal=False, tensor="dq", version="4.0.0b36")


def _real_producer():
    """``jax_dqpost.fa4jax`` where fa4-jax's kernels can run (a CUDA GPU of sm_80 or newer, and fa4-jax), else None
    (one line why)."""
    if jax.default_backend() != "gpu":
        return None
    capability = float(getattr(jax.devices()[0], "compute_capability", 0) or 0)
    if capability < 8.0:
        print(f"no real producer: fa4-jax's kernels need sm_80 or newer, this GPU is sm_{capability * 10:.0f}")
        return None
    try:
        from jax_dqpost import fa4jax
        fa4jax.register()
        return fa4jax
    except ImportError as e:
        print(f"no real producer: {e}")
        return None


FA4JAX = _real_producer()
PRODUCER = ("fa4-jax (FlashAttention-4's backward kernels)" if FA4JAX
            else "stand-in (jax.numpy in place of a FlashAttention backward)")


# ---- the stand-in producer: plain JAX, dQ through the accumulator and dq_postprocess

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _stand_in(q, k, v, scale):
    p = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q, k).astype(jnp.float32) * scale, axis=-1)
    return jnp.einsum("bhst,bthd->bshd", p.astype(v.dtype), v)


def _stand_in_fwd(q, k, v, scale):
    return _stand_in(q, k, v, scale), (q, k, v)


def _stand_in_bwd(scale, res, do):
    q, k, v = res
    f32 = lambda x: x.astype(jnp.float32)
    p = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", f32(q), f32(k)) * scale, axis=-1)
    dv = jnp.einsum("bhst,bshd->bthd", p, f32(do))
    dp = jnp.einsum("bshd,bthd->bhst", f32(do), f32(v))
    ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))
    dk = jnp.einsum("bhst,bshd->bthd", ds, f32(q)) * scale
    # What a backward kernel would leave: unscaled fp32 dQ, in FlashAttention's accumulator order...
    dq_accum = dq_accum_from_dq(jnp.einsum("bhst,bthd->bshd", ds, f32(k)), 1.0, layout=LAYOUT)
    # ...and the postprocess: scale, round to bf16, natural layout.
    dq = dq_postprocess(dq_accum, scale, seqlen_q=q.shape[1], head_dim=q.shape[3], dtype=q.dtype, layout=LAYOUT)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


_stand_in.defvjp(_stand_in_fwd, _stand_in_bwd)


def attention(q, k, v, scale):
    """Attention of q ``(B, S, H, D)`` over k, v ``(B, S, Hkv, D)`` (``Hkv`` divides ``H``), bf16."""
    if FA4JAX is not None:
        return FA4JAX.flash_attn(q, k, v, scale=scale)
    groups = q.shape[2] // k.shape[2]  # the stand-in repeats k, v per query head; autodiff sums their gradients
    return _stand_in(q, jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2), scale)


def plain_attention(q, k, v, scale):
    """The same attention in float32 jax.numpy, differentiated by plain autodiff: the gradient's reference."""
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), groups, axis=2) for x in (k, v))
    p = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q.astype(jnp.float32), k) * scale, axis=-1)
    return jnp.einsum("bhst,bthd->bshd", p, v)


def loss_fn(w, x, k, v, target, attend=attention):
    q = jnp.einsum("bshd,de->bshe", x, w).astype(jnp.bfloat16)
    out = attend(q, k, v, D ** -0.5)
    return jnp.mean((out.astype(jnp.float32) - target) ** 2)


@jax.jit
def train_step(w, x, k, v, target, lr):
    loss, grad = jax.value_and_grad(loss_fn)(w, x, k, v, target)
    return w - lr * grad, loss


def main():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, S, H_KV, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, S, H_KV, D)), jnp.bfloat16)
    w_true = jnp.asarray(rng.standard_normal((D, D)) / np.sqrt(D), jnp.float32)
    target = attention(jnp.einsum("bshd,de->bshe", x, w_true).astype(jnp.bfloat16), k, v, D ** -0.5)
    target = target.astype(jnp.float32)
    w = jnp.asarray(rng.standard_normal((D, D)) / np.sqrt(D), jnp.float32)
    # The backward through the postprocess agrees with plain autodiff of the same attention.
    g_ours = jax.grad(loss_fn)(w, x, k, v, target)
    g_plain = jax.grad(loss_fn)(w, x, k, v, target, plain_attention)
    rel = float(jnp.linalg.norm(g_ours - g_plain) / jnp.linalg.norm(g_plain))
    losses = []
    for _ in range(50):
        w, loss = train_step(w, x, k, v, target, 50.0)
        losses.append(float(loss))
    print(f"producer: {PRODUCER}; backend: {jax.default_backend()}; gradient vs plain autodiff: relative error "
          f"{rel:.2e}; loss {losses[0]:.5f} -> {losses[-1]:.5f} in {len(losses)} steps")
    if not rel < 3e-2 or not losses[-1] < 0.7 * losses[0]:
        raise SystemExit("wrong gradient or the loss did not go down")


if __name__ == "__main__":
    main()
