"""Bit-equality of the kernel's bulk-load variants (``kernel.Postprocess(..., bulk_stages=...)``, ``bulk.py``) with
its default, on the GPU machine, from the repository root:

    python -m benchmarks.bulk_check

For FlashAttention-4's Hopper dQ presets (hd64 .. hd256, dense), bf16 and fp16, and shapes with a partial last tile,
more than one sequence and more tiles than the persistent grid has CTAs, every variant of :data:`VARIANTS` writes the
same bits as the default into an output poisoned with NaN first, and nothing outside it (guard regions on both
sides keep their poison). Prints a line per case and variant, then the summary.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax.numpy as jnp  # noqa: E402

from jax_dqpost import AccumLayout  # noqa: E402

from . import internals  # noqa: E402

HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = (jnp.bfloat16, jnp.float16)
SHAPES = ((1, 3, 1000), (3, 5, 333), (2, 16, 4096))  # (B, H, S): 1000 and 333 end in a partial tile of every preset
VARIANTS = ({"bulk_stages": 1}, {"bulk_stages": 2}, {"bulk_stages": 3}, {"bulk_stages": 2, "bulk_ctas": 7})
GUARD = 4096  # poisoned elements on each side of the output


def _run(torch, p, acc, scale, out_shape, dtype, tuning):
    """The output of one launch (``tuning``: ``kernel.Postprocess`` keywords) as int16 bits, and whether the guard
    regions kept their poison."""
    import cuda.bindings.driver as cuda

    numel = out_shape[0] * out_shape[1] * out_shape[2] * out_shape[3]
    flat = torch.full((numel + 2 * GUARD,), float("nan"), dtype=dtype, device="cuda")
    poison = flat[:GUARD].view(torch.int16).clone()
    out = flat[GUARD:GUARD + numel]
    ex = internals.executor(p, **tuning)
    # q_aux: any address (a dense part without seqused reads none)
    args = internals.launch_args(p, [tuple(acc.shape)], dict(dq_accum=acc, q_aux=scale, scales=scale, dq=out))
    ex(*args, cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    bits = flat.view(torch.int16)
    guards = torch.equal(bits[:GUARD], poison) and torch.equal(bits[GUARD + numel:], poison)
    return bits[GUARD:GUARD + numel].clone(), guards


def main(argv):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    cases, failures = 0, []
    for D in HEAD_DIMS:
        layout = AccumLayout.flash_attention(90, D, causal=False, tensor="dq", version="4.0.0b36")
        for dtype in DTYPES:
            t_dtype = {jnp.bfloat16: torch.bfloat16, jnp.float16: torch.float16}[dtype]
            for B, H, S in SHAPES:
                p = internals.plan([internals.dense_part(layout, D, dtype, S)])
                acc_shape = layout.accum_shape(B, H, S, D)
                # magnitudes over 2^-30 .. 2^30: fp16 overflow to inf, subnormals and rounding ties included
                acc = torch.randn(acc_shape, device="cuda", generator=gen) * torch.exp2(
                    torch.randint(-30, 31, acc_shape, device="cuda", generator=gen).float())
                scale = torch.tensor([D ** -0.5], device="cuda", dtype=torch.float32)
                expected, guards = _run(torch, p, acc, scale, (B, S, H, D), t_dtype, {})
                tag = f"hd{D:<3d} {jnp.dtype(dtype).name:8s} B={B} H={H} S={S:<5d}"
                if not guards:
                    failures.append(f"{tag} default: wrote outside the output")
                for tuning in VARIANTS:
                    cases += 1
                    try:
                        bits, guards = _run(torch, p, acc, scale, (B, S, H, D), t_dtype, tuning)
                    except Exception as e:  # noqa: BLE001 - reported with the others
                        failures.append(f"{tag} {tuning}: {type(e).__name__}: {str(e)[:200]}")
                        print(failures[-1], flush=True)
                        continue
                    same = torch.equal(bits, expected)
                    diff = int((bits != expected).sum())
                    print(f"{tag} {str(tuning):40s} {'bit-identical' if same else f'{diff} elements DIFFER'}"
                          f"{'' if guards else ', WROTE OUTSIDE THE OUTPUT'}", flush=True)
                    if not (same and guards):
                        failures.append(f"{tag} {tuning}: {diff} elements differ, guards {'kept' if guards else 'hit'}")
    if failures:
        print(f"bulk_check: {len(failures)} of {cases} cases FAILED:\n  " + "\n  ".join(failures))
        return 1
    print(f"bulk_check: {cases} cases, all bit-identical")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
