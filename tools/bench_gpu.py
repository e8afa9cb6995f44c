"""Kernel timing on the GPU, side by side in one run: our CuTe kernel, FlashAttention-4's postprocess
(when importable) and a device-to-device copy of the same bytes (the ceiling). CUDA events, median of
many runs after warm-up. Sizes as in the performance issue: B=2, H=32, S=8192.

    python tools/bench_gpu.py            (needs torch and a CUDA GPU)
"""

from __future__ import annotations

import statistics
import sys

import numpy as np
import torch


def time_ms(fn, iters=30, batch=20, warmup=5):
    """Median over ``iters`` of (events around ``batch`` back-to-back launches) / batch: the host-side
    launch cost of any one call stays hidden behind the previous kernels."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / batch)
    return statistics.median(times)


def time_jax_ms(fn, *args, iters=200, warmup=5):
    """Wall clock of ``iters`` back-to-back calls of a jitted function, per call."""
    import time

    for _ in range(warmup):
        fn(*args).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t0) / iters * 1e3


def main():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    from jax_dqpost import AccumLayout
    from jax_dqpost import compile as compile_
    from jax_dqpost.kernel import DqPostprocess

    # Kernel variants measured side by side (the first is what the package compiles).
    variants = {"default": {}, "no-launch-hint": dict(min_ctas_per_sm=0)}

    try:
        from flash_attn.cute.interface import _bwd_postprocess_convert as fa4
    except Exception as e:  # noqa: BLE001
        print(f"FlashAttention-4 not importable: {e}", file=sys.stderr)
        fa4 = None
    B, H, S = 2, 32, 8192
    configs = [(64, (128, 256, 2, False)), (96, (64, 128, 1, False)), (128, (64, 256, 1, False)),
               (128, (80, 256, 1, True)), (192, (64, 256, 1, False)), (256, (64, 256, 1, False))]
    gmem = cute.AddressSpace.gmem
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    import jax
    import jax.numpy as jnp

    from jax_dqpost import dq_postprocess

    print(f"{'head_dim (tile_m)':>18} | {'ours':>18} | {'FlashAttention-4':>18} | {'same-bytes copy':>18} | ours/FA4"
          f" | ours via jax.jit | variants (us)")
    for D, (tile_m, threads, atom, swap) in configs:
        layout = AccumLayout(90, tile_m, threads, atom, swap, 32)
        Dr = layout.padded_head_dim(D)
        acc = torch.randn(layout.accum_shape(B, H, S, D), device="cuda", dtype=torch.float32)
        out = torch.empty((B, S, H, D), device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor([D ** -0.5], device="cuda", dtype=torch.float32)
        nbytes = acc.numel() * 4 + out.numel() * 2
        ex = compile_.compile_executor("bf16", layout, Dr, "dense", compile_.target_arch())
        args = (make_ptr(cutlass.Float32, acc.data_ptr(), gmem, assumed_align=16),
                make_ptr(cutlass.BFloat16, out.data_ptr(), gmem, assumed_align=16),
                make_ptr(cutlass.Float32, scale.data_ptr(), gmem, assumed_align=4),
                make_ptr(cutlass.Int32, scale.data_ptr(), gmem, assumed_align=4),  # unused when dense
                cutlass.Int32(B), cutlass.Int32(H), cutlass.Int32(S), cutlass.Int32(D),
                cutlass.Int32(-(-S // tile_m)), stream)
        t_ours = time_ms(lambda: ex(*args))
        t_var = {}
        for vname, kw in variants.items():
            CuTeDSL._get_dsl().envar.arch = compile_.target_arch()
            kern = DqPostprocess(cutlass.BFloat16, layout, Dr, **kw)
            vex = cute.compile(kern, *args, options=f"--gpu-arch {compile_.target_arch()}")
            t_var[vname] = time_ms(lambda: vex(*args))
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy = time_ms(lambda: dst.copy_(src))
        t_fa = float("nan")
        if fa4 is not None:
            out2 = torch.empty_like(out)
            t_fa = time_ms(lambda: fa4(acc, out2, D ** -0.5, None, None, 90, cutlass.BFloat16, D, tile_m, threads,
                                       atom, swap, fake_mode=False))
        acc_j = jnp.asarray(np.random.default_rng(0).standard_normal(acc.shape, np.float32))
        f = jax.jit(lambda a: dq_postprocess(a, D ** -0.5, seqlen_q=S, head_dim=D, dtype=jnp.bfloat16, layout=layout))
        t_jax = time_jax_ms(f, acc_j)
        del acc_j
        tb = lambda ms: nbytes / ms / 1e9
        print(f"{D:>9} ({tile_m}{', swap' if swap else ''}) | {t_ours * 1e3:7.1f} us {tb(t_ours):5.2f} TB/s | "
              f"{t_fa * 1e3:7.1f} us {tb(t_fa):5.2f} TB/s | {t_copy * 1e3:7.1f} us {tb(t_copy):5.2f} TB/s | "
              f"{t_fa / t_ours:5.3f} | {t_jax * 1e3:7.1f} us | " + " ".join(f"{k} {v * 1e3:.1f}" for k, v in t_var.items()))


def varlen_row():
    """hd128 (tile_m 80, swap), 64 random lengths with the dense rows' total tokens, static offsets."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from jax_dqpost import AccumLayout, varlen
    from jax_dqpost import compile as compile_

    rng = np.random.default_rng(0)
    H, D, tile_m, total = 32, 128, 80, 2 * 8192
    cuts = np.sort(rng.choice(np.arange(1, total), 63, replace=False))
    cu = np.concatenate([[0], cuts, [total]]).astype(np.int32)
    layout = AccumLayout(90, tile_m, 256, 1, True, 32)
    Tp = varlen.padded_total(total, 64, tile_m)
    acc = torch.randn((H, Tp * 128), device="cuda", dtype=torch.float32)
    out = torch.empty((total, H, D), device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([D ** -0.5], device="cuda", dtype=torch.float32)
    meta, num_tiles = varlen.work_list(np, cu, None, total_q=total, tile_m=tile_m)
    t_meta = torch.from_numpy(meta).cuda()
    ex = compile_.compile_executor("bf16", layout, 128, "varlen", compile_.target_arch())
    gmem = cute.AddressSpace.gmem
    args = (make_ptr(cutlass.Float32, acc.data_ptr(), gmem, assumed_align=16),
            make_ptr(cutlass.BFloat16, out.data_ptr(), gmem, assumed_align=16),
            make_ptr(cutlass.Float32, scale.data_ptr(), gmem, assumed_align=4),
            make_ptr(cutlass.Int32, t_meta.data_ptr(), gmem, assumed_align=4),
            cutlass.Int32(varlen.num_spans(64)), cutlass.Int32(H), cutlass.Int32(total), cutlass.Int32(D),
            cutlass.Int32(num_tiles), cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    t_ours = time_ms(lambda: ex(*args))
    useful = total * H * (128 * 4 + D * 2)
    line = f"varlen hd128 (80, swap), 64 random lengths, {total} tokens: ours {t_ours * 1e3:.1f} us " \
           f"{useful / t_ours / 1e9:.2f} TB/s useful"
    try:
        from flash_attn.cute.interface import _bwd_postprocess_convert as fa4

        t_cu = torch.from_numpy(cu).cuda()
        out2 = torch.empty_like(out)
        t_fa = time_ms(lambda: fa4(acc, out2, D ** -0.5, t_cu, None, 90, cutlass.BFloat16, D, tile_m, 256, 1, True,
                                   fake_mode=False))
        line += f" | FlashAttention-4 {t_fa * 1e3:.1f} us {useful / t_fa / 1e9:.2f} TB/s | ours/FA4 {t_fa / t_ours:.3f}"
    except Exception as e:  # noqa: BLE001
        line += f" | FlashAttention-4 not run: {e}"
    print(line)


if __name__ == "__main__":
    main()
    varlen_row()
