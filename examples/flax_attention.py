"""A flax (nnx) attention layer on ``jax_dqpost.flax_attention_fn``, trained for a few steps.

``nnx.MultiHeadAttention`` takes an ``attention_fn``; ``jax_dqpost.flax_attention_fn`` has flax's signature and
runs ``jax_dqpost.dot_product_attention``: FlashAttention-4's kernels on a GPU where they run the call (bf16,
fa4-jax installed), jax.numpy elsewhere. The layer is causal (nnx passes ``is_causal`` from its call); its
gradient must match flax's own attention's, and the loss must go down. Needs flax (and the optax it brings):

    python -m pip install ".[examples]" && python examples/flax_attention.py
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

try:
    import optax
    from flax import nnx
except ModuleNotFoundError as missing:
    sys.exit(f"examples/flax_attention.py needs flax ({missing}): python -m pip install \".[examples]\"")

import jax_dqpost

B, S, HEADS, D = 2, 128, 4, 64


def make_layer(attention_fn, seed):
    return nnx.MultiHeadAttention(num_heads=HEADS, in_features=HEADS * D, qkv_features=HEADS * D, decode=False,
                                  dtype=jnp.bfloat16, attention_fn=attention_fn, rngs=nnx.Rngs(seed))


def loss_fn(layer, x, target):
    return jnp.mean((layer(x, is_causal=True).astype(jnp.float32) - target) ** 2)


@nnx.jit
def train_step(layer, optimizer, x, target):
    loss, grads = nnx.value_and_grad(loss_fn)(layer, x, target)
    optimizer.update(layer, grads)
    return loss


def main():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, S, HEADS * D)), jnp.float32)
    ours = functools.partial(jax_dqpost.flax_attention_fn, implementation=None)  # 'fa4' where it runs, else 'xla'
    target = make_layer(ours, 1)(x, is_causal=True).astype(jnp.float32)  # a teacher with other weights
    student, plain = make_layer(ours, 0), make_layer(nnx.dot_product_attention, 0)
    g_ours = nnx.grad(loss_fn)(student, x, target)
    g_plain = nnx.grad(loss_fn)(plain, x, target)
    gq, gq_plain = (jnp.asarray(g["query"]["kernel"][...], jnp.float32) for g in (g_ours, g_plain))
    rel = float(jnp.linalg.norm(gq - gq_plain) / jnp.linalg.norm(gq_plain))
    optimizer = nnx.Optimizer(student, optax.adam(3e-3), wrt=nnx.Param)
    losses = [float(train_step(student, optimizer, x, target)) for _ in range(40)]
    # Which implementation ran: FlashAttention-4's kernels show in the compiled program.
    program = jax.jit(lambda x: ours(x, x, x, is_causal=True)).lower(jnp.zeros((B, S, HEADS, D), jnp.bfloat16))
    implementation = "fa4" if "fa4" in program.as_text() else "xla"
    print(f"implementation: {implementation}; backend: {jax.default_backend()}; query-kernel gradient vs flax's "
          f"attention: relative error {rel:.2e}; loss {losses[0]:.5f} -> {losses[-1]:.5f} in {len(losses)} steps")
    if not rel < 5e-2 or not losses[-1] < 0.7 * losses[0]:
        raise SystemExit("wrong gradient or the loss did not go down")


if __name__ == "__main__":
    main()
