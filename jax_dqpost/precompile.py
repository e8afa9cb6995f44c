"""Fill the on-disk kernel cache ahead of time with FlashAttention's preset layouts.

    python -m jax_dqpost.precompile                       # the local GPU's presets, every head dim
    python -m jax_dqpost.precompile --arch sm_90a --presets 90 --dtypes bf16 --modes dense,varlen

Works without a GPU when ``--arch`` (or ``CUTE_DSL_ARCH``) names the target. Prints what it compiled.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax.numpy as jnp

from . import compile as compile_
from .layout import AccumLayout

_DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
_MODES = ("dense", "dense_seqused", "varlen")


def configurations(presets, head_dims):
    """Distinct (layout, padded head dim) pairs of the presets of these GPU architectures."""
    seen = {}
    for arch in presets:
        for head_dim in head_dims:
            for causal in (False, True):
                try:
                    layout = AccumLayout.flash_attention(arch, head_dim, causal=causal)
                except ValueError:
                    continue  # no postprocess for this architecture and head dim
                seen[(layout, layout.padded_head_dim(head_dim))] = None
    return list(seen)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_dqpost.precompile", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", help="target GPU, e.g. sm_90a (default: CUTE_DSL_ARCH, else the local GPU)")
    parser.add_argument("--presets", default=None,
                        help="comma-separated GPU architectures whose FlashAttention presets to compile "
                             "(default: the target's, e.g. 90 for sm_90a)")
    parser.add_argument("--head-dims", default=",".join(str(d) for d in range(8, 257, 8)))
    parser.add_argument("--dtypes", default="bf16,f16")
    parser.add_argument("--modes", default=",".join(_MODES))
    args = parser.parse_args(argv)
    arch = args.arch or compile_.target_arch()
    presets = [int(x) for x in args.presets.split(",")] if args.presets else [compile_.sm_version(arch)]
    head_dims = [int(x) for x in args.head_dims.split(",")]
    dtypes = [_DTYPES[x] for x in args.dtypes.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in _MODES:
            parser.error(f"--modes: unknown mode {m!r}; choose from {_MODES}")
    if compile_.cache_dir() is None:
        print("the on-disk cache is off (JAX_DQPOST_CACHE_DIR=none): nothing would be kept", file=sys.stderr)
        return 1
    configs = configurations(presets, head_dims)
    start, n = time.perf_counter(), 0
    for layout, tile_hdim in configs:
        for dtype in dtypes:
            for mode in modes:
                compile_.get_kernel(dtype, layout, tile_hdim, mode, arch=arch)
                n += 1
    print(f"{n} kernels for {arch} ({len(configs)} layouts x {len(dtypes)} dtypes x {len(modes)} modes) in "
          f"{time.perf_counter() - start:.1f} s, cached in {compile_.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
