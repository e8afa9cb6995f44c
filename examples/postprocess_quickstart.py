"""The postprocess alone: turn a FlashAttention-style fp32 dQ accumulator into bf16 dQ, under jax.jit.

Runs anywhere: on CPU (the default here) through the jax.numpy reference, on an NVIDIA GPU through
the CuTe DSL kernel and jax-dqpost's XLA FFI target. Same bits either way.

    python examples/postprocess_quickstart.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from jax_dqpost import AccumLayout, dq_postprocess

B, S, H, D = 2, 1000, 4, 128
scale = D ** -0.5

# The order in which FlashAttention-4 (release 4.0.0b36)'s Hopper backward writes dQ at this head dim, non-causal.
layout = AccumLayout.flash_attention(90, D, causal=False, tensor="dq", version="4.0.0b36")

# Build an accumulator the way the producer would have stored a known dQ: tile by tile, each (row, col)
# at the position the layout's index map gives. (FlashAttention's backward writes this buffer for you.)
rng = np.random.default_rng(0)
dq_true = rng.standard_normal((B, S, H, D)).astype(np.float32)
Sr, Dr, Da = layout.padded_seqlen(S), layout.padded_head_dim(D), layout.alloc_head_dim(D)
padded = np.zeros((B, H, Sr, Dr), np.float32)
padded[:, :, :S, :D] = dq_true.transpose(0, 2, 1, 3)
tiles = padded.reshape(B, H, Sr // layout.tile_m, layout.tile_m * Dr)
index = layout.tile_index_map(D).ravel()
tiled = np.empty_like(tiles)
tiled[..., index] = tiles
acc = np.zeros(layout.accum_shape(B, H, S, D), np.float32)  # (B, H, Sr * Da): the tiles fill the first Sr * Dr
acc[..., :Sr * Dr] = tiled.reshape(B, H, Sr * Dr)


@jax.jit
def postprocess(acc, scale):
    return dq_postprocess(acc, scale, seqlen_q=S, head_dim=D, dtype=jnp.bfloat16, layout=layout)


dq = postprocess(acc, scale)
want = (dq_true * np.float32(scale)).astype(jnp.bfloat16)
print(f"backend: {jax.default_backend()}, dq_accum {acc.shape} float32 -> dq {dq.shape} {dq.dtype}")
exact = np.array_equal(np.asarray(dq).view(np.uint16), want.view(np.uint16))
print("bit-exact vs numpy:", exact)
if not exact:
    raise SystemExit(1)
