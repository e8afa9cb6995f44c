"""Run the CUDA kernel on corrupt traced offsets, for compute-sanitizer (memcheck; tests/gpu_check.sh runs it):

    XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python3 tests/sanitize_varlen.py

(the platform allocator gives every buffer its own allocation, so an access past one shows). Each result
is also checked against the oracle's documented clamping of bad offsets.
"""

import jax
import jax.numpy as jnp
import numpy as np

import oracle  # tests/oracle.py: a script's folder is first on its path
from jax_dqpost import AccumLayout, dq_postprocess, flash_attention_postprocess


def main():
    assert jax.default_backend() == "gpu", "needs the CUDA backend"
    rng = np.random.default_rng(0)
    layout = AccumLayout(90, 80, 256, 1, True, 32)
    total_q, heads = 400, 2
    f = jax.jit(lambda a, c, u: dq_postprocess(a, 0.5, head_dim=128, total_q=total_q, cu_seqlens_q=c, seqused_q=u,
                                               layout=layout))
    cases = [
        ([0, 300, 100, 350], [300, 5, 5]),
        ([0, 100, 5000, 200000], [100, 100, 100]),
        ([-50, 30, 60, 90], [10, 1000, -3]),
        ([2**30, 2**31 - 1, 0, 10], [5, 5, 5]),
        ([-2**31, 2**31 - 1, -2**31, 2**31 - 1], [2**31 - 1, -2**31, 7]),
        ([400, 0, 0, 0], [0, 0, 0]),
        ([0], []),  # no sequences: every row is zero
    ]
    for cu, used in cases:
        acc, want = oracle.build_varlen(rng, cu, used, total_q, heads, 128, (80, 256, 1, True), hdim_multiple_of=32,
                                        scale=0.5, dtype=jnp.bfloat16)
        got = np.asarray(f(acc, np.asarray(cu, np.int32), np.asarray(used, np.int32)))
        ok = np.array_equal(np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))) and np.array_equal(
            got.view(np.uint16)[~np.isnan(want.astype(np.float32))],
            want.view(np.uint16)[~np.isnan(want.astype(np.float32))])
        print(f"cu={cu} seqused={used}: {'matches the oracle' if ok else 'MISMATCH'}")
        if not ok:
            raise SystemExit(1)
    dense = AccumLayout(90, 64, 256, 1, False, 32)
    g = jax.jit(lambda a, u: dq_postprocess(a, 1.0, seqlen_q=100, head_dim=64, seqused_q=u, layout=dense))
    g(jnp.zeros(dense.accum_shape(3, 2, 100, 64), jnp.float32), jnp.asarray([-7, 2**31 - 1, 50], jnp.int32))
    print("dense seqused_q [-7, 2**31-1, 50]: ran")
    # The fused kernel (dQ, dK, dV, dsink) on the same corrupt offsets, q side and k side, and a 2-CTA cluster layout.
    kv = AccumLayout(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=2)
    sink = jnp.asarray(rng.standard_normal(heads).astype(np.float32))
    h = jax.jit(lambda a, k, c, u, lse, dp: flash_attention_postprocess(
        a, k, k, 0.5, head_dim=128, dq_layout=layout, dkv_layout=kv, total_q=total_q, total_k=total_q, cu_seqlens_q=c,
        cu_seqlens_k=c, seqused_q=u, seqused_k=u, learnable_sink=sink, lse=lse, dpsum=dp))
    for cu, used in cases:
        acc, want = oracle.build_varlen(rng, cu, used, total_q, heads, 128, (80, 256, 1, True), hdim_multiple_of=32,
                                        scale=0.5, dtype=jnp.bfloat16)
        k_acc = jnp.zeros(kv.varlen_accum_shape(len(cu) - 1, 1, total_q, 128), jnp.float32)
        tp = layout.varlen_accum_shape(len(cu) - 1, heads, total_q, 128)[1] // 128
        dq, *_ = h(acc, k_acc, np.asarray(cu, np.int32), np.asarray(used, np.int32),
                   jnp.zeros((heads, total_q), jnp.float32), jnp.ones((heads, tp), jnp.float32))
        dq = np.asarray(dq)
        nan = np.isnan(want.astype(np.float32))
        if not np.array_equal(dq.view(np.uint16)[~nan], want.view(np.uint16)[~nan]):
            print(f"fused cu={cu} seqused={used}: MISMATCH")
            raise SystemExit(1)
        print(f"fused cu={cu} seqused={used}: dq matches the oracle")
    print("sanitize_varlen: ok")


if __name__ == "__main__":
    main()
