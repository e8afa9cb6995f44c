"""jax.profiler around our calls, run as its own process (a fresh XLA runtime, and a crash must not take pytest
down):

    python3 tests/profiler_main.py SEED [attention]

Both ops (``dq_postprocess`` and ``flash_attention_postprocess`` with dK/dV), with static and traced varlen offsets,
at the size of a reported crash: FlashAttention-4's hd128 presets, 32 query heads (8 key/value heads), 16384 tokens
in sequences of 1..3 rows; and a ``lax.scan`` over layers, each calling ``dq_postprocess`` dense and with traced
varlen offsets. Each program runs once before, once inside and twice after a ``jax.profiler.trace`` (the second
execution is where XLA first records a command buffer when the first was its warm-up), and every result must equal,
bit for bit, the same op on the CPU (the jax.numpy reference). With ``attention`` (fa4-jax installed), instead: a
jitted ``jax.grad`` of ``dot_product_attention(implementation='fa4')`` with sinks under grouped heads, run the same
four times, each run's gradients within a bf16 rounding of the first's (FlashAttention-4's backward adds dQ with
atomics: its bits may differ from run to run). Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jax_dqpost import AccumLayout, dq_postprocess, flash_attention_postprocess
from jax_dqpost.layout import padded_total
from support import cu_seqlens  # tests/support.py: a script's folder is first on its path

H, H_KV, D, T, CALLS = 32, 8, 128, 16384, 4
LAYERS = 4  # of the lax.scan


def around_a_trace(f, args, check) -> list[bool]:
    """``check(outputs)`` of ``f(*args)`` run once before, once inside and twice after a ``jax.profiler.trace``."""
    results = []
    for step in ("before", "inside", "after", "after"):
        if step == "inside":
            with jax.profiler.trace(tempfile.mkdtemp()):
                outs = jax.block_until_ready(f(*args))
        else:
            outs = jax.block_until_ready(f(*args))
        results.append(bool(check(outs)))
    return results


def same_bits(got, want) -> bool:
    return all(np.array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16)) for g, w in zip(got, want))


def scan_over_layers(rng) -> dict:
    """``lax.scan`` over :data:`LAYERS` layers, each finishing its own accumulator dense and one with traced varlen
    offsets (64 sequences): ``{"scan": [bool] * 4}``."""
    layout = AccumLayout.flash_attention(90, D, causal=False, tensor="dq", version="4.0.0b36")
    B, S, tokens, sequences = 2, 1024, 4096, 64
    cu = cu_seqlens(np.diff(np.sort(np.r_[0, rng.choice(np.arange(1, tokens), sequences - 1, replace=False), tokens])))
    dense = rng.standard_normal((LAYERS,) + layout.accum_shape(B, H, S, D), np.float32)
    packed = rng.standard_normal((LAYERS,) + layout.varlen_accum_shape(sequences, H, tokens, D), np.float32)
    scale = np.float32(rng.uniform(0.05, 0.2))

    def layer(c, accs):
        d, p = accs
        return c, (dq_postprocess(d, scale, seqlen_q=S, head_dim=D, layout=layout),
                   dq_postprocess(p, scale, head_dim=D, total_q=tokens, cu_seqlens_q=c, layout=layout))

    f = jax.jit(lambda c, d, p: jax.lax.scan(layer, c, (d, p))[1])
    cpu = jax.devices("cpu")[0]
    want = [np.asarray(w) for w in f(*(jax.device_put(a, cpu) for a in (cu, dense, packed)))]
    args = tuple(jnp.asarray(a) for a in (cu, dense, packed))
    return {"scan": around_a_trace(f, args, lambda outs: same_bits(outs, want))}


def attention_step(rng) -> dict:
    """``jax.grad`` of the 'fa4' attention with sinks (module docstring): ``{"attention": [bool] * 4}``."""
    from jax_dqpost import dot_product_attention

    b, t, n, n_kv, h = 2, 1024, 8, 2, 64
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, t, n_kv, h)), jnp.bfloat16) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(n), jnp.float32)

    def loss(q, k, v, sinks):
        out = dot_product_attention(q, k, v, is_causal=True, sinks=sinks, implementation="fa4")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    first = []  # the run before the trace: the reference (its second execution, inside the trace, records graphs)

    def close(outs):
        got = [np.asarray(g, np.float64) for g in outs]
        if not first:
            first.extend(got)
        return all(np.isfinite(g).all() and np.abs(g - w).max() <= 2 ** -7 * np.abs(w).max()
                   for g, w in zip(got, first))

    return {"attention": around_a_trace(f, (q, k, v, sinks), close)}


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
            exact = around_a_trace(f, args, lambda outs: all(same_bits(call, want) for call in outs))
            report[f"{name}_{offsets}"] = exact
    report.update(scan_over_layers(rng))
    return report


if __name__ == "__main__":
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if sys.argv[2:] == ["attention"]:
        print(json.dumps(attention_step(np.random.default_rng(seed))))
    else:
        print(json.dumps(main(seed)))
