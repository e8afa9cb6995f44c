"""gpt-oss's attention with learnable sinks, an nnx model trained under ``nnx.jit``.

Two attention layers as gpt-oss has them: head dim 64, 64 query heads over 8 key/value heads, causal, a sliding
window of 128 keys on every other layer (``local_window_size=(127, 0)``: gpt-oss masks keys 128 or more positions
back, so a query sees itself and the 127 before), and one learnable sink per query head (``nnx.Param``; a logit in
every softmax row that attends to nothing). The attention is ``jax_dqpost.dot_product_attention(..., sinks=...)``:
FlashAttention-4's kernels on a GPU that runs them with sinks (sm90, sm100; fa4-jax installed,
``pip install ".[cuda13,fa4-jax]"``, Python >= 3.12), the sinks' gradient in jax-dqpost's one postprocess launch;
jax.numpy on every other machine. The first layer's attention gradients are checked against float64 formulas
written here in numpy (no autodiff), then a student learns a teacher's outputs and the loss must fall. Needs flax
(and the optax it brings):

    python -m pip install ".[examples]" && python examples/gpt_oss_sinks.py
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

try:
    import optax
    from flax import nnx
except ModuleNotFoundError as missing:
    sys.exit(f"examples/gpt_oss_sinks.py needs flax ({missing}): python -m pip install \".[examples]\"")

import jax_dqpost

B, S, MODEL, H, H_KV, D, LAYERS = 2, 256, 256, 64, 8, 64, 2
SLIDING_WINDOW = 128  # gpt-oss's: it masks key j for query i where i - j >= 128
WINDOW = (127, 0)  # the same as jax.nn's local_window_size: query i sees keys i - 127 .. i


class Attention(nnx.Module):
    """gpt-oss's attention block: projections, grouped heads, a causal mask (``window``, jax.nn's
    ``local_window_size``, or all keys), and one learnable sink per query head."""

    def __init__(self, window, rngs):
        self.window = window
        self.q = nnx.Linear(MODEL, H * D, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(MODEL, H_KV * D, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(MODEL, H_KV * D, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(H * D, MODEL, use_bias=False, rngs=rngs)
        self.sinks = nnx.Param(jnp.zeros((H,), jnp.float32))  # gpt-oss starts them at 0

    def qkv(self, x):
        return [p(x).astype(jnp.bfloat16).reshape(B, S, -1, D) for p in (self.q, self.k, self.v)]

    def __call__(self, x):
        q, k, v = self.qkv(x)
        out = jax_dqpost.dot_product_attention(q, k, v, is_causal=True, sinks=self.sinks[...],
                                               local_window_size=self.window)
        return self.o(out.astype(jnp.float32).reshape(B, S, H * D))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([Attention(WINDOW if i % 2 == 0 else None, rngs) for i in range(LAYERS)])

    def __call__(self, x):
        for layer in self.layers:
            x = x + layer(x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6))
        return x


def float64_attention_gradients(q, k, v, sinks, sliding_window, d_out):
    """The gradients of ``sum(out * d_out)`` in q, k, v and the sinks, in float64 by their formulas: with
    ``P = softmax([scale q k^T masked, sink])`` over the keys and the sink, ``dP = dO v^T``, ``D_i = sum(dO_i
    out_i)``, ``dS = P (dP - D)``, ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = P^T dO``, ``dsink = -sum_i
    P_sink,i D_i``; masked as gpt-oss masks: key ``j`` for query ``i`` where ``j > i`` or, with a
    ``sliding_window``, ``i - j >= sliding_window``."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    k, v = (np.repeat(x, H // H_KV, axis=2) for x in (k, v))
    scale = D ** -0.5
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    seen = (j <= i) & ((i - j < sliding_window) if sliding_window else True)
    logits = np.where(seen, np.einsum("bshd,bthd->bhst", q, k) * scale, -np.inf)
    logits = np.concatenate([logits, np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                                                     (*logits.shape[:3], 1))], axis=-1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p, p_sink = p[..., :-1], p[..., -1]
    out = np.einsum("bhst,bthd->bshd", p, v)
    rows = np.einsum("bshd,bshd->bhs", d_out, out)
    ds = p * (np.einsum("bshd,bthd->bhst", d_out, v) - rows[..., None])
    dq = scale * np.einsum("bhst,bthd->bshd", ds, k)
    dk = (scale * np.einsum("bhst,bshd->bthd", ds, q)).reshape(B, S, H_KV, H // H_KV, D).sum(3)
    dv = np.einsum("bhst,bshd->bthd", p, d_out).reshape(B, S, H_KV, H // H_KV, D).sum(3)
    return dq, dk, dv, -(p_sink * rows).sum(axis=(0, 2))


def check_gradients(layer, x):
    """The attention's gradients in the first layer, ours against the float64 formulas: the largest relative
    error (bf16 inputs and outputs: about 1e-2)."""
    q, k, v = layer.qkv(x)
    sinks = layer.sinks[...]
    d_out = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)

    def loss(q, k, v, sinks):
        out = jax_dqpost.dot_product_attention(q, k, v, is_causal=True, sinks=sinks,
                                               local_window_size=layer.window)
        return jnp.sum(out.astype(jnp.float32) * d_out)

    ours = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    want = float64_attention_gradients(q, k, v, sinks, SLIDING_WINDOW if layer.window else None, d_out)
    return max(float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)) for a, b in zip(ours, want))


def loss_fn(model, x, target):
    return jnp.mean((model(x) - target) ** 2)


@nnx.jit
def train_step(model, optimizer, x, target):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, target)
    optimizer.update(model, grads)
    return loss


def implementation(x):
    """``'fa4'`` if FlashAttention-4's kernels run the attention here (they show in its compiled program), else
    ``'xla'``."""
    q = jnp.zeros((B, S, H, D), jnp.bfloat16)
    kv = jnp.zeros((B, S, H_KV, D), jnp.bfloat16)
    program = jax.jit(lambda s: jax_dqpost.dot_product_attention(q, kv, kv, is_causal=True, sinks=s)).lower(
        jnp.zeros(H, jnp.float32))
    return "fa4" if "fa4" in program.as_text() else "xla"


def main():
    x = jax.random.normal(jax.random.key(0), (B, S, MODEL))
    teacher = Model(nnx.Rngs(1))
    for layer, sinks in zip(teacher.layers, (jnp.linspace(-2, 3, H), jnp.linspace(3, -2, H))):
        layer.sinks[...] = sinks
    target = nnx.jit(lambda m, x: m(x))(teacher, x)
    student = Model(nnx.Rngs(0))
    rel = check_gradients(student.layers[0], x)
    optimizer = nnx.Optimizer(student, optax.adam(2e-3), wrt=nnx.Param)
    losses = [float(train_step(student, optimizer, x, target)) for _ in range(25)]
    sinks = np.asarray(student.layers[0].sinks[...])
    print(f"implementation: {implementation(x)}; backend: {jax.default_backend()}; attention gradients vs float64 "
          f"formulas: relative error {rel:.2e}; loss {losses[0]:.5f} -> {losses[-1]:.5f} in {len(losses)} steps; "
          f"layer 0's sinks learned {sinks.min():+.3f}..{sinks.max():+.3f}")
    if not rel < 3e-2 or not losses[-1] < 0.7 * losses[0]:
        raise SystemExit("wrong gradients or the loss did not go down")


if __name__ == "__main__":
    main()
