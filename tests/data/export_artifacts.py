"""Export jax-dqpost programs for CUDA on a machine without a GPU, for tests/test_gpu_runtime.py to run on one:

    JAX_PLATFORMS=cpu python tests/data/export_artifacts.py        (writes exported_*.bin + manifest beside it)

The kernel is compiled for sm_90a through the explicit target option `jax_dqpost.cuda_arch`. Each artifact
is shape-specialised; the manifest records its shapes and configuration so the GPU test can build inputs.
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import jax
import jax.numpy as jnp

import jax_dqpost
from jax_dqpost import DISABLED_CHECKS, AccumLayout, dq_postprocess

DATA = Path(__file__).resolve().parent

CASES = {
    # dense, bf16, FlashAttention's hd128 Hopper configuration (tile_m 80, swapAB); scale traced
    "dense": dict(packing="dense", dtype="bfloat16", head_dim=128, batch=2, seqlen=1000, heads=4,
                  layout=AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")),
    # varlen with traced cu_seqlens_q and seqused_q, fp16, hd64 (tile_m 128, 2 warpgroups); scale static
    "varlen": dict(packing="varlen", dtype="float16", head_dim=64, batch=5, total_q=700, heads=3, scale=0.125,
                   layout=AccumLayout.flash_attention(90, 64, causal=False, tensor="dq", version="4.0.0b36")),
}


def export(case: dict) -> jax.export.Exported:
    layout, D, dtype = case["layout"], case["head_dim"], jnp.dtype(case["dtype"])
    if case["packing"] == "dense":
        B, S, H = case["batch"], case["seqlen"], case["heads"]
        f = jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=S, head_dim=D, dtype=dtype, layout=layout))
        args = (jax.ShapeDtypeStruct(layout.accum_shape(B, H, S, D), jnp.float32),
                jax.ShapeDtypeStruct((), jnp.float32))
    else:
        B, T, H = case["batch"], case["total_q"], case["heads"]
        f = jax.jit(lambda a, cu, used: dq_postprocess(a, case["scale"], head_dim=D, total_q=T, cu_seqlens_q=cu,
                                                       seqused_q=used, dtype=dtype, layout=layout))
        args = (jax.ShapeDtypeStruct(layout.varlen_accum_shape(B, H, T, D), jnp.float32),
                jax.ShapeDtypeStruct((B + 1,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    with jax_dqpost.cuda_arch("sm_90a"):
        return jax.export.export(f, platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(*args)


def main():
    DATA.mkdir(parents=True, exist_ok=True)
    manifest = {"exported_on": f"{platform.node()} ({platform.machine()}, devices {jax.devices()})",
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "jax": jax.__version__, "target": "sm_90a", "cases": {}}
    for name, case in CASES.items():
        blob = export(case).serialize()
        (DATA / f"exported_{name}.bin").write_bytes(blob)
        layout = case["layout"]
        manifest["cases"][name] = {**{k: v for k, v in case.items() if k != "layout"},
                                   "layout": [layout.arch, layout.tile_m, layout.num_threads, layout.atom_layout,
                                              layout.swap_ab, layout.hdim_multiple_of],
                                   "file": f"exported_{name}.bin", "bytes": len(blob)}
        print(f"{name}: {len(blob)} bytes")
    (DATA / "exported_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
