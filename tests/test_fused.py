"""flash_attention_postprocess (dQ, dK, dV and dsink in one launch) lowered for CUDA: one custom call.

Its results against the oracle: tests/test_postprocess.py; its errors: tests/test_errors.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dqpost import DISABLED_CHECKS, AccumLayout, flash_attention_postprocess

# (dQ layout, dK/dV layout, head_dim, head_dim_v): FlashAttention-4's presets.
PAIRS = {"sm90-hd192-dv128": (90, 192, 128, False)}
H, H_KV = 4, 2


def _layouts(name):
    arch, d, dv, causal = PAIRS[name]
    return (AccumLayout.flash_attention(arch, d, causal=causal, tensor="dq"),
            AccumLayout.flash_attention(arch, d, causal=causal, tensor="dkv"),
            d, dv)


@pytest.mark.parametrize("packing", ["dense", "varlen"])
def test_export_for_cuda_emits_one_fused_custom_call(packing):
    """Lowered for CUDA (also without a GPU): one custom call carrying one module (dQ, dK, dV and dsink), with the
    buffers in abi.py's order (their sizes checked by the handler) and the extents of each part; and it
    serialises."""
    from jax_dqpost import _ffi

    dq_layout, dkv_layout, d, dv = _layouts("sm90-hd192-dv128")
    batch, s_q, s_k = 2, 300, 200
    sk = dict(learnable_sink=jax.ShapeDtypeStruct((H,), jnp.float32))
    if packing == "dense":
        kw = dict(seqlen_q=s_q, seqlen_k=s_k)
        shapes = (dq_layout.accum_shape(batch, H, s_q, d), dkv_layout.accum_shape(batch, H_KV, s_k, d),
                  dkv_layout.accum_shape(batch, H_KV, s_k, dv))
        rows = ((batch, H, s_q), (batch, H, dq_layout.padded_seqlen(s_q)))
    else:
        cu_q, cu_k = jnp.asarray([0, 100, 300], jnp.int32), jnp.asarray([0, 50, 200], jnp.int32)
        kw = dict(total_q=s_q, total_k=s_k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        shapes = (dq_layout.varlen_accum_shape(batch, H, s_q, d), dkv_layout.varlen_accum_shape(batch, H_KV, s_k, d),
                  dkv_layout.varlen_accum_shape(batch, H_KV, s_k, dv))
        tp = shapes[0][1] // dq_layout.padded_head_dim(d)
        rows = ((H, s_q), (H, tp))

    def f(q, k, v, sink, lse, dpsum):
        return flash_attention_postprocess(q, k, v, 0.1, head_dim=d, head_dim_v=dv, dq_layout=dq_layout,
                                           dkv_layout=dkv_layout, learnable_sink=sink, lse=lse, dpsum=dpsum, **kw)

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes] + [sk["learnable_sink"]] + [
        jax.ShapeDtypeStruct(r, jnp.float32) for r in rows]
    exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(*args)
    text = exp.mlir_module()
    assert text.count("@jax_dqpost") == 1 and text.count(f"@{_ffi.TARGET_NAME}") == 1, "expected one launch"
    outs = [(batch, s_q, H, d) if packing == "dense" else (s_q, H, d),
            (batch, s_k, H_KV, d) if packing == "dense" else (s_k, H_KV, d),
            (batch, s_k, H_KV, dv) if packing == "dense" else (s_k, H_KV, dv)]
    aux = (0, 0)  # dense: no seqused; varlen: the work lists of traced offsets (varlen.WorkList, its bound of tiles)
    if packing == "varlen":
        from jax_dqpost.varlen import WorkList, sections

        aux = tuple(sections(batch + 2)[1] + WorkList.max_tiles(total, batch, layout)
                    for total, layout in ((s_q, dq_layout), (s_k, dkv_layout)))
    sizes = [4 * int(np.prod(x)) for x in shapes]
    sizes += [4 * a for a in aux] + [4 * 3, 4 * H] + [4 * int(np.prod(r)) for r in rows]
    sizes += [2 * int(np.prod(o)) for o in outs] + [4 * H]
    assert "bytes = dense<[" + ", ".join(map(str, sizes)) + "]>" in text, "buffers in abi.py's order"
    assert [o.shape for o in exp.out_avals] == [(batch, s_q, H, d) if packing == "dense" else (s_q, H, d),
                                                (batch, s_k, H_KV, d) if packing == "dense" else (s_k, H_KV, d),
                                                (batch, s_k, H_KV, dv) if packing == "dense" else (s_k, H_KV, dv),
                                                (H,)]
    assert jax.export.deserialize(exp.serialize()).out_avals == exp.out_avals
