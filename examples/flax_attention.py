"""A flax (nnx) attention layer whose backward is finished by jax-dqpost, trained for a few steps.

``nnx.MultiHeadAttention`` takes an ``attention_fn``; ours is ``train_step.attention``: on a CUDA GPU with fa4-jax,
FlashAttention-4's backward kernels (fa4-jax) finished by one jax-dqpost launch; elsewhere the stand-in producer
(jax.numpy storing dQ in FlashAttention's accumulator order, then ``dq_postprocess``). The gradient must match
flax's default attention, and the loss must go down. Needs flax (and the optax it brings):

    python -m pip install ".[examples]" && python examples/flax_attention.py
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

try:
    import optax
    from flax import nnx
except ModuleNotFoundError as missing:
    sys.exit(f"examples/flax_attention.py needs flax ({missing}): python -m pip install \".[examples]\"")

from train_step import PRODUCER, attention  # examples/ is on sys.path when run as a script

B, S, H, D = 2, 96, 2, 64


def our_attention_fn(query, key, value, *args, **kwargs):
    """flax's attention_fn signature; (batch, length, heads, head_dim) in and out."""
    del args, kwargs  # no mask, no dropout in this example
    dtype = query.dtype
    out = attention(query.astype(jnp.bfloat16), key.astype(jnp.bfloat16), value.astype(jnp.bfloat16),
                    query.shape[-1] ** -0.5)
    return out.astype(dtype)


def make_layer(attention_fn, seed):
    return nnx.MultiHeadAttention(num_heads=H, in_features=H * D, qkv_features=H * D, decode=False,
                                  attention_fn=attention_fn, rngs=nnx.Rngs(seed))


def loss_fn(layer, x, target):
    return jnp.mean((layer(x) - target) ** 2)


@nnx.jit
def train_step(layer, optimizer, x, target):
    loss, grads = nnx.value_and_grad(loss_fn)(layer, x, target)
    optimizer.update(layer, grads)
    return loss


def main():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, S, H * D)), jnp.float32)
    target = make_layer(our_attention_fn, 1)(x)  # a teacher with other weights
    ours, plain = make_layer(our_attention_fn, 0), make_layer(nnx.dot_product_attention, 0)
    g_ours = nnx.grad(loss_fn)(ours, x, target)
    g_plain = nnx.grad(loss_fn)(plain, x, target)
    gq, gq_plain = g_ours["query"]["kernel"][...], g_plain["query"]["kernel"][...]
    rel = float(jnp.linalg.norm(gq - gq_plain) / jnp.linalg.norm(gq_plain))
    optimizer = nnx.Optimizer(ours, optax.adam(3e-3), wrt=nnx.Param)
    losses = [float(train_step(ours, optimizer, x, target)) for _ in range(40)]
    print(f"producer: {PRODUCER}; backend: {jax.default_backend()}; query-kernel gradient vs flax's attention: "
          f"relative error {rel:.2e}; loss {losses[0]:.5f} -> {losses[-1]:.5f} in {len(losses)} steps")
    if not rel < 5e-2 or not losses[-1] < 0.7 * losses[0]:
        raise SystemExit("wrong gradient or the loss did not go down")


if __name__ == "__main__":
    main()
