"""The whole backward postprocess of grouped-query attention with a learnable sink, in one launch.

FlashAttention-4's backward hands its postprocess three fp32 accumulators (dQ for the H query heads, dK and dV
for the H_kv key/value heads, each in its MMA's register order) and, with a learnable sink, the per-row `dpsum`
and `lse`. `flash_attention_postprocess` finishes all of it under jax.jit: on CPU here (the jax.numpy reference),
on an NVIDIA GPU in one kernel launch. This example plays the producer with `dq_accum_from_dq` and checks dq, dk,
dv bit for bit and dsink against float64; without dK/dV accumulators or a sink the call returns the same
`Gradients`, its dk, dv and dsink None.

    python examples/gqa_postprocess.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from jax_dqpost import AccumLayout, dq_accum_from_dq, flash_attention_postprocess

B, S, H, H_KV, D = 2, 700, 8, 2, 128
scale = D ** -0.5
# FlashAttention-4's Hopper layouts for this head dim, without a causal mask
dq_layout = AccumLayout.flash_attention(90, D, causal=False, tensor="dq", version="4.0.0b36")
dkv_layout = AccumLayout.flash_attention(90, D, causal=False, tensor="dkv", version="4.0.0b36")

rng = np.random.default_rng(0)
dq_true, dk_true, dv_true = (jnp.asarray(rng.standard_normal((B, S, h, D)), jnp.bfloat16) for h in (H, H_KV, H_KV))
# The unscaled gradients, as the backward accumulated them (scale 1: exact for bf16 values).
dq_acc = dq_accum_from_dq(np.asarray(dq_true, np.float32) / np.float32(scale), 1.0, layout=dq_layout)
dk_acc = dq_accum_from_dq(np.asarray(dk_true, np.float32) / np.float32(scale), 1.0, layout=dkv_layout)
dv_acc = dq_accum_from_dq(dv_true, 1.0, layout=dkv_layout)
# The sink's inputs: one logit per query head, the forward's lse (which counts the sink) and dpsum = rowsum(dO * O).
sink = rng.standard_normal(H).astype(np.float32)
lse = (sink[None, :, None] + np.abs(rng.standard_normal((B, H, S))) * 2).astype(np.float32)
dpsum = rng.standard_normal((B, H, dq_layout.padded_seqlen(S))).astype(np.float32)


@jax.jit
def postprocess(dq_acc, dk_acc, dv_acc, sink, lse, dpsum):
    return flash_attention_postprocess(dq_acc, dk_acc, dv_acc, scale, head_dim=D, seqlen_q=S, seqlen_k=S,
                                       dq_layout=dq_layout, dkv_layout=dkv_layout,
                                       learnable_sink=sink, lse=lse, dpsum=dpsum)


dq, dk, dv, dsink = postprocess(dq_acc, dk_acc, dv_acc, sink, lse, dpsum)
print(f"backend: {jax.default_backend()}; dq {dq.shape}, dk {dk.shape}, dv {dv.shape}, dsink {dsink.shape}")


def same(a, b):
    return np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


# dq = round(scale * acc): the accumulators hold x / scale, so this is x up to the one fp32 rounding of
# the division; compare against the same arithmetic in numpy.
def expect(x, s):
    unscaled = np.asarray(x, np.float32) / np.float32(s)
    return (unscaled * np.float32(s)).astype(jnp.bfloat16)


exact = same(dq, expect(dq_true, scale)) and same(dk, expect(dk_true, scale)) and same(dv, dv_true)
p = np.exp(sink.astype(np.float64)[None, :, None] - lse)
want = (-p * dpsum[:, :, :S]).sum(axis=(0, 2))
close = np.allclose(np.asarray(dsink, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(p * dpsum[:, :, :S]).sum())
# Without dK/dV accumulators or a sink, the same four members: dk, dv and dsink None.
alone = flash_attention_postprocess(dq_acc, None, None, scale, head_dim=D, seqlen_q=S, dq_layout=dq_layout)
single = alone.dk is None and alone.dv is None and alone.dsink is None and same(alone.dq, dq)
print("dq, dk, dv bit-exact:", exact)
print("dsink vs float64:", close)
print("dQ alone, dk, dv, dsink None:", single)
if not (exact and close and single):
    raise SystemExit(1)
