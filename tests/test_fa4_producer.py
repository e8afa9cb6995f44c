"""A real producer (GPU with flash-attn 4 only): FlashAttention-4's own backward on real attention inputs hands
its fp32 accumulators (and, with a learnable sink, ``dpsum`` and ``lse``) to its postprocess; our fused op
finishes the same accumulators in JAX, and dq, dk, dv and dsink must be bit-identical to FlashAttention-4's.

Every postprocess call of the backward is captured (``fa4_peer.backward_calls``). The configuration each call was
made with must also be what our presets (``AccumLayout.flash_attention(..., tensor=..., version=...)``) give. These
head dims are where its postprocess is right; ``test_gradients.py`` measures every head dim against the mathematics.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HAS_GPU
from jax_dqpost import AccumLayout, flash_attention_postprocess
from fa4_peer import backward_calls as _backward_calls, fa4 as _fa4, to_numpy as _np
from support import bits, cu_seqlens

pytestmark = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")

B, H, H_KV = 2, 32, 8
SEQLEN_Q, SEQLEN_K = 1000, 777  # not multiples of any tile


def _run_fa4_backward(torch, interface, rng, head_dim, causal, varlen, sink_dtype):
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    dt = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dt).requires_grad_()

    sink = None
    if sink_dtype is not None:
        sink = (torch.randn(H, generator=gen, device="cuda") * 2).to(sink_dtype).requires_grad_()
    if varlen:
        lens_q = rng.integers(1, 400, size=B)
        lens_k = rng.integers(1, 400, size=B)
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
        used_q = np.array([rng.integers(0, n + 1) for n in lens_q], np.int32)
        used_k = np.array([rng.integers(1, n + 1) for n in lens_k], np.int32)
        q, k, v = randn(int(cu_q[-1]), H, head_dim), randn(int(cu_k[-1]), H_KV, head_dim), randn(int(cu_k[-1]), H_KV,
                                                                                                   head_dim)
        t = {name: torch.from_numpy(x).cuda() for name, x in
             (("cu_q", cu_q), ("cu_k", cu_k), ("used_q", used_q), ("used_k", used_k))}
        packed = dict(cu_seqlens_q=t["cu_q"], cu_seqlens_k=t["cu_k"], max_seqlen_q=int(lens_q.max()),
                      max_seqlen_k=int(lens_k.max()), seqused_q=t["used_q"], seqused_k=t["used_k"])
    else:
        q, k, v = randn(B, SEQLEN_Q, H, head_dim), randn(B, SEQLEN_K, H_KV, head_dim), randn(B, SEQLEN_K, H_KV,
                                                                                             head_dim)
        packed = {}
    d_out = torch.randn(q.shape, generator=gen, device="cuda", dtype=dt)  # the output's shape: Dv is head_dim
    return _backward_calls(torch, interface, q, k, v, d_out, causal=causal, sink=sink, **packed)


CASES = [(hd, causal, varlen, sink) for hd in (64, 96, 128, 192, 256)
         for causal, varlen, sink in ((False, False, "float32"), (True, False, None), (False, True, "bfloat16"),
                                      (True, True, None))]


@pytest.mark.parametrize("head_dim,causal,varlen,sink", CASES,
                         ids=[f"hd{c[0]}-{'causal' if c[1] else 'full'}-{'varlen' if c[2] else 'dense'}-"
                              f"{c[3] or 'nosink'}" for c in CASES])
def test_fused_postprocess_of_flash_attention_4_backward(rng, head_dim, causal, varlen, sink):
    torch, interface = _fa4()
    calls = _run_fa4_backward(torch, interface, rng, head_dim, causal, varlen,
                              None if sink is None else getattr(torch, sink))
    assert len(calls) == 3, f"FlashAttention-4 made {len(calls)} postprocess calls, expected dQ, dK, dV"
    cq, ck, cv = calls
    dq_layout = AccumLayout.flash_attention(90, head_dim, causal=causal, tensor="dq", version="4.0.0b36")
    dkv_layout = AccumLayout.flash_attention(90, head_dim, causal=causal, tensor="dkv", version="4.0.0b36")
    for call, layout, what in ((cq, dq_layout, "dQ"), (ck, dkv_layout, "dK"), (cv, dkv_layout, "dV")):
        want = (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab, layout.hdim_multiple_of,
                layout.cluster_size)
        assert call["config"] == want, f"{what}: FlashAttention-4 used {call['config']}, our preset gives {want}"
    kw = dict(head_dim=head_dim, dq_layout=dq_layout, dkv_layout=dkv_layout, dk_scale=ck["scale"])
    if varlen:
        kw.update(total_q=cq["output"].shape[0], total_k=ck["output"].shape[0],
                  cu_seqlens_q=jnp.asarray(_np(cq["cu"])), cu_seqlens_k=jnp.asarray(_np(ck["cu"])),
                  seqused_q=jnp.asarray(_np(cq["seqused"])), seqused_k=jnp.asarray(_np(ck["seqused"])))
    else:
        kw.update(seqlen_q=SEQLEN_Q, seqlen_k=SEQLEN_K)
    if sink is not None:
        kw.update(learnable_sink=jnp.asarray(_np(cq["sink"])), lse=jnp.asarray(_np(cq["lse"])),
                  dpsum=jnp.asarray(_np(cq["dpsum"])))
    assert cv["scale"] == 1.0
    outs = flash_attention_postprocess(jnp.asarray(_np(cq["accum"])), jnp.asarray(_np(ck["accum"])),
                                       jnp.asarray(_np(cv["accum"])), cq["scale"], **kw)
    for got, call, what in zip(outs, (cq, ck, cv), ("dq", "dk", "dv")):
        want = _np(call["output"])
        assert got.shape == want.shape, what
        got = np.asarray(got)
        if varlen:
            # FlashAttention-4 writes the rows of each sequence below seqused and leaves the rest of its output
            # as it was; ours are zeros there.
            cu, used = _np(call["cu"]), _np(call["seqused"])
            written = np.zeros(want.shape[0], bool)
            for b in range(len(used)):
                written[cu[b]:cu[b] + used[b]] = True
            assert not bits(got[~written]).any(), f"{what}: rows past seqused must be zeros"
            got, want = got[written], want[written]
        diff = np.flatnonzero(bits(got) != bits(want))
        assert diff.size == 0, f"{what}: {diff.size} of {want.size} elements differ from FlashAttention-4's"
    if sink is not None:
        got, want = np.asarray(outs.dsink), _np(cq["dsink"])
        assert got.dtype == want.dtype
        assert (bits(got) == bits(want)).all(), f"dsink {got} differs from FlashAttention-4's {want}"
