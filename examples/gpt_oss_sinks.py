"""gpt-oss's attention with learnable sinks, trained under ``jax.jit``: FlashAttention-4's kernels forward and
backward, the sinks' gradient in jax-dqpost's one postprocess launch.

Two attention layers as gpt-oss has them: head dim 64, 64 query heads over 8 key/value heads, causal, a sliding
window of 128 keys on every other layer, and one learnable sink per head (a logit in every softmax row that attends
to nothing). On a CUDA GPU (sm90 or sm100) with fa4-jax (``pip install ".[cuda13,fa4-jax]"``, Python >= 3.12) the
attention is ``jax_dqpost.fa4jax.flash_attn(..., learnable_sink=...)``; elsewhere the plain jax.numpy attention
below stands in. A student learns a teacher's outputs; the gradients at the start must match plain autodiff of the
jax.numpy attention with a sink column (float32), and the loss must fall.

    python examples/gpt_oss_sinks.py
"""

import jax
import jax.numpy as jnp
import numpy as np

B, S, MODEL, H, H_KV, D, WINDOW, LAYERS = 2, 256, 256, 64, 8, 64, 128, 2


def _fa4jax():
    """``jax_dqpost.fa4jax`` where its kernels run with a sink (a CUDA GPU of sm90 or sm100/110, and fa4-jax), else
    None (one line why)."""
    if jax.default_backend() != "gpu":
        return None
    major = int(float(getattr(jax.devices()[0], "compute_capability", 0) or 0))
    if major not in (9, 10, 11):
        print(f"plain attention: FlashAttention-4's forward takes a sink on sm90 and sm100 only, this GPU is {major}.x")
        return None
    try:
        from jax_dqpost import fa4jax
        fa4jax.register()
        return fa4jax
    except ImportError as e:
        print(f"plain attention: {e}")
        return None


FA4JAX = _fa4jax()
ATTENTION = ("fa4-jax's FlashAttention-4 kernels, dsink by jax-dqpost" if FA4JAX
             else "plain jax.numpy (no GPU with fa4-jax)")


def plain_attention(q, k, v, sink, window):
    """Causal attention with a sink column in float32: q ``(B, S, H, D)``, k, v ``(B, S, Hkv, D)``, sink ``(H,)``;
    ``window``: keys at most that far behind (None: all)."""
    k, v = (jnp.repeat(x.astype(jnp.float32), H // H_KV, axis=2) for x in (k, v))
    s = jnp.einsum("bshd,bthd->bhst", q.astype(jnp.float32), k) * D ** -0.5
    i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    s = jnp.where((j <= i) & ((i - j <= window) if window else True), s, -jnp.inf)
    column = jnp.broadcast_to(sink.astype(jnp.float32)[None, :, None, None], (*s.shape[:3], 1))
    p = jax.nn.softmax(jnp.concatenate([s, column], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhst,bthd->bshd", p, v)


def attention(q, k, v, sink, window, plain=False):
    if FA4JAX is None or plain:
        return plain_attention(q, k, v, sink, window)
    return FA4JAX.flash_attn(q, k, v, learnable_sink=sink, causal=True,
                             window_size=(window, 0) if window else None)


def init(key):
    """Per layer: the projections and the sinks (gpt-oss starts them at 0)."""
    layers = []
    for key in jax.random.split(key, LAYERS):
        kq, kk, kv, ko = jax.random.split(key, 4)
        layers.append(dict(wq=jax.random.normal(kq, (MODEL, H * D)) * MODEL ** -0.5,
                           wk=jax.random.normal(kk, (MODEL, H_KV * D)) * MODEL ** -0.5,
                           wv=jax.random.normal(kv, (MODEL, H_KV * D)) * MODEL ** -0.5,
                           wo=jax.random.normal(ko, (H * D, MODEL)) * (H * D) ** -0.5,
                           sinks=jnp.zeros((H,), jnp.float32)))
    return layers


def model(params, x, plain=False):
    for i, p in enumerate(params):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        q, k, v = ((h @ p[w]).astype(jnp.bfloat16).reshape(B, S, -1, D) for w in ("wq", "wk", "wv"))
        out = attention(q, k, v, p["sinks"], WINDOW if i % 2 == 0 else None, plain)
        x = x + out.astype(jnp.float32).reshape(B, S, H * D) @ p["wo"]
    return x


def loss_fn(params, x, target, plain=False):
    return jnp.mean((model(params, x, plain) - target) ** 2)


LEARNING_RATES = dict(wq=0.5, wk=0.5, wv=0.5, wo=0.5, sinks=20.0)  # a sink's gradient is a sum of small terms


@jax.jit
def train_step(params, x, target):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
    return [{name: p[name] - LEARNING_RATES[name] * g[name] for name in p} for p, g in zip(params, grads)], loss


def main():
    key_x, key_teacher, key_student = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (B, S, MODEL))
    teacher = init(key_teacher)
    for layer, sinks in zip(teacher, (jnp.linspace(-2, 3, H), jnp.linspace(3, -2, H))):
        layer["sinks"] = sinks
    target = jax.jit(model)(teacher, x)
    params = init(key_student)
    # The gradients at the start, ours against plain autodiff of the float32 attention with a sink column.
    ours = jax.jit(jax.grad(loss_fn))(params, x, target)
    plain = jax.jit(jax.grad(lambda *a: loss_fn(*a, plain=True)))(params, x, target)
    rel = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(jax.tree.leaves(ours),
                                                                                   jax.tree.leaves(plain)))
    losses = []
    for _ in range(20):
        params, loss = train_step(params, x, target)
        losses.append(float(loss))
    sinks = np.asarray(params[0]["sinks"])
    print(f"attention: {ATTENTION}; backend: {jax.default_backend()}; gradients vs plain attention with a sink "
          f"column: relative error {rel:.2e}; loss {losses[0]:.5f} -> {losses[-1]:.5f} in {len(losses)} steps; "
          f"layer 0's sinks learned {sinks.min():+.3f}..{sinks.max():+.3f}")
    if not rel < 3e-2 or not losses[-1] < 0.7 * losses[0]:
        raise SystemExit("wrong gradients or the loss did not go down")


if __name__ == "__main__":
    main()
