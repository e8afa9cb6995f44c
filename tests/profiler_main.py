"""jax.profiler around our calls, run as its own process (a fresh XLA runtime, and a crash must not take pytest
down):

    python3 tests/profiler_main.py SEED

Both ops (``dq_postprocess`` and ``flash_attention_postprocess`` with dK/dV), with static and traced varlen offsets,
at the size of a reported crash: FlashAttention-4's hd128 presets, 32 query heads (8 key/value heads), 16384 tokens
in sequences of 1..3 rows. Each program runs once before, once inside and twice after a ``jax.profiler.trace``
(the second execution is where XLA first records a command buffer when the first was its warm-up), and every
result must equal, bit for bit, the same op on the CPU (the jax.numpy reference). Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jax_dqpost import AccumLayout, dq_postprocess, flash_attention_postprocess
from jax_dqpost._kernel.varlen import padded_total
from support import cu_seqlens  # tests/support.py: a script's folder is first on its path

H, H_KV, D, T, CALLS = 32, 8, 128, 16384, 4


def main(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < T:
        lengths.append(int(rng.integers(1, 4)))
    lengths[-1] -= sum(lengths) - T
    cu = cu_seqlens(lengths)
    batch = len(lengths)
    q_layout = AccumLayout.flash_attention(90, D, causal=False, tensor="dq", version="4.0.0b36")
    kv_layout = AccumLayout.flash_attention(90, D, causal=False, tensor="dkv", version="4.0.0b36")
    rows = lambda layout: padded_total(T, batch, layout.pad_rows) * layout.padded_head_dim(D)  # noqa: E731
    dq_acc = rng.standard_normal((H, rows(q_layout)), np.float32)
    dk_acc = rng.standard_normal((H_KV, rows(kv_layout)), np.float32)
    dv_acc = rng.standard_normal((H_KV, rows(kv_layout)), np.float32)
    scale = np.float32(rng.uniform(0.05, 0.2))

    def dq_op(c):
        return lambda dq: (dq_postprocess(dq, scale, head_dim=D, total_q=T, cu_seqlens_q=c, layout=q_layout),)

    def fused_op(c):
        return lambda dq, dk, dv: flash_attention_postprocess(
            dq, dk, dv, scale, head_dim=D, dq_layout=q_layout, dkv_layout=kv_layout, total_q=T, total_k=T,
            cu_seqlens_q=c, cu_seqlens_k=c)[:3]  # dq, dk, dv (dsink None)

    report = {"device": str(jax.devices()[0]), "sequences": batch}
    for name, make, accs in (("dq", dq_op, (dq_acc,)), ("fused", fused_op, (dq_acc, dk_acc, dv_acc))):
        cpu = jax.devices("cpu")[0]
        want = [np.asarray(w) for w in jax.jit(make(cu))(*(jax.device_put(a, cpu) for a in accs))]
        for offsets in ("static", "traced"):
            if offsets == "static":
                f = jax.jit(lambda *xs, op=make(cu): [op(*xs) for _ in range(CALLS)])
                args = tuple(jnp.asarray(a) for a in accs)
            else:
                f = jax.jit(lambda c, *xs: [make(c)(*xs) for _ in range(CALLS)])
                args = (jnp.asarray(cu),) + tuple(jnp.asarray(a) for a in accs)
            exact = []
            for step in ("before", "inside", "after", "after"):
                if step == "inside":
                    with jax.profiler.trace(tempfile.mkdtemp()):
                        outs = jax.block_until_ready(f(*args))
                else:
                    outs = jax.block_until_ready(f(*args))
                exact.append(all(np.array_equal(np.asarray(o).view(np.uint16), w.view(np.uint16))
                                 for call in outs for o, w in zip(call, want)))
            report[f"{name}_{offsets}"] = exact
    return report


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)))
