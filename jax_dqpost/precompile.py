"""Fill the on-disk kernel cache ahead of time with FlashAttention's preset layouts.

    python -m jax_dqpost.precompile                       # the local GPU's presets, every head dim
    python -m jax_dqpost.precompile --arch sm_90a --presets 90 --dtypes bf16 --tilings dense,varlen
    python -m jax_dqpost.precompile --fused none,f32      # also the dQ + dK + dV kernels, with and without sink

Works without a GPU when ``--arch`` (or ``CUTE_DSL_ARCH``) names the target. Prints what it compiled. Bad
arguments (and bad values of ``CUTE_DSL_ARCH`` or ``JAX_DQPOST_CACHE_DIR``), and requests that select no kernel,
exit with status 2 and a message naming the value; a disk cache that is off or cannot be written, and a missing
CuTe DSL (nvidia-cutlass-dsl), with status 1 and a message saying what to do.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from . import _checks
from .postprocess import arguments as _arguments
from ._kernel import abi, arch as arch_, cache, cute_runtime, tuning
from ._kernel.abi import Tiling
from ._kernel.varlen import SHORT_HEADS
from .layout import AccumLayout
from .layout._presets import FLASH_ATTENTION_ARCHS, FLASH_ATTENTION_RELEASES, GPU_ARCHS, has_postprocess

_DTYPE_SPELLINGS = tuple(_arguments.OUT_DTYPE_SPELLINGS)
_TILING_NAMES = tuple(t.name.lower() for t in Tiling)
_SINK_NAMES = ("none", "f32", "bf16", "f16")


def _presets(presets, head_dims):
    """``((dQ layout, Dr), (dK/dV layout, Dr))`` of FlashAttention-4's presets of these GPU architectures and head
    dims (``head_dim_v = head_dim``), causal or not, of every release the presets know, where its backward has a
    postprocess."""
    for arch, head_dim, causal, version in itertools.product(presets, head_dims, (False, True),
                                                             FLASH_ATTENTION_RELEASES):
        if has_postprocess(arch, head_dim) and (arch // 10, head_dim, causal) not in FLASH_ATTENTION_RELEASES[
                version].cannot_run:
            q, kv = (AccumLayout.flash_attention(arch, head_dim, causal=causal, tensor=t, version=version)
                     for t in ("dq", "dkv"))
            yield (q, q.padded_head_dim(head_dim)), (kv, kv.padded_head_dim(head_dim))


def configurations(presets, head_dims):
    """Distinct (layout, padded head dim) pairs of the dQ presets."""
    return list(dict.fromkeys(q for q, _ in _presets(presets, head_dims)))


def fused_configurations(presets, head_dims):
    """Distinct fused kernels' parts ``((dQ layout, Dr), (dK/dV layout, Dr))`` of the presets."""
    return list(dict.fromkeys(_presets(presets, head_dims)))


def _list_of(parse):
    """An argparse type: a comma-separated list, each item through ``parse`` (ValueError/TypeError -> usage)."""
    def convert(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        out = []
        for item in items:
            try:
                out.append(parse(item))
            except (TypeError, ValueError) as e:
                raise argparse.ArgumentTypeError(f"{item!r}: {e}") from None
        return list(dict.fromkeys(out))  # once each, whichever spelling named it
    return convert


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("not an integer") from None


def _preset_arch(text: str) -> int:
    """A GPU architecture FlashAttention-4's backward runs on, as a number (90, 100, 120...)."""
    value = _int(text)
    if value not in GPU_ARCHS:
        raise ValueError(f"not a GPU architecture; the known ones are {', '.join(map(str, GPU_ARCHS))}")
    if value not in FLASH_ATTENTION_ARCHS:
        raise ValueError(f"FlashAttention-4's backward does not run on sm{value}; it runs on "
                         f"{', '.join(map(str, FLASH_ATTENTION_ARCHS))}")
    return value


def _head_dim(text: str) -> int:
    return _checks.head_dim(_int(text))


def _arch(text: str) -> str:
    try:
        return arch_.check_arch(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype(text: str) -> str:
    """A dQ type, by a name the API takes (``_arguments.OUT_DTYPE_SPELLINGS``), as its short name."""
    try:
        return abi.DTYPE_NAMES[_arguments.out_dtype(text)]
    except (TypeError, ValueError):
        raise ValueError(f"choose from {', '.join(_DTYPE_SPELLINGS)}") from None


def _choice(names):
    def parse(text: str) -> str:
        if text not in names:
            raise ValueError(f"choose from {', '.join(names)}")
        return text
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_dqpost.precompile", description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=_arch,
                   help="target GPU, e.g. sm_90a, sm_80, sm_100a; sm_90 means sm_90a (default: CUTE_DSL_ARCH, else "
                        "the local GPU)")
    p.add_argument("--presets", type=_list_of(_preset_arch), default=None,
                   help="comma-separated GPU architectures whose FlashAttention presets to compile, e.g. 90,100,120 "
                        "(default: the target's, e.g. 90 for sm_90a)")
    p.add_argument("--head-dims", type=_list_of(_head_dim), default=list(range(8, 257, 8)),
                   help="comma-separated head dimensions (multiples of 8, at most 256; default: all of them)")
    p.add_argument("--dtypes", type=_list_of(_dtype), default=list(abi.OUT_DTYPE_NAMES),
                   help=f"comma-separated dQ types, from {', '.join(_DTYPE_SPELLINGS)} (default: both)")
    p.add_argument("--tilings", type=_list_of(_choice(_TILING_NAMES)), default=list(_TILING_NAMES),
                   help=f"comma-separated kernel tilings, from {', '.join(_TILING_NAMES)} (default: all)")
    p.add_argument("--fused", type=_list_of(_choice(_SINK_NAMES)), default=None,
                   help="also compile flash_attention_postprocess's fused dQ + dK + dV kernels (the same tiling on "
                        "the q and k sides), one per learnable-sink type listed, from "
                        f"{', '.join(_SINK_NAMES)} (none: without a sink; default: no fused kernels)")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        arch = args.arch or arch_.target_arch()
    except RuntimeError:
        parser.error("no CUDA GPU here: pass --arch (e.g. --arch sm_90a) or set CUTE_DSL_ARCH to choose the target")
    except ValueError as e:  # CUTE_DSL_ARCH, or the local GPU, names an architecture the kernel does not compile for
        parser.error(str(e))
    presets = args.presets or [arch_.sm_version(arch)]
    configs = configurations(presets, args.head_dims)
    if not configs:
        fa4 = (f"FlashAttention-4's backward has a dQ postprocess on {', '.join(map(str, FLASH_ATTENTION_ARCHS))} "
               "(head dims up to 192 on sm100/sm110)")
        if args.presets is None and presets[0] not in FLASH_ATTENTION_ARCHS:
            parser.error(f"--arch {arch} has no FlashAttention-4 presets of its own: {fa4}. Name the GPUs whose "
                         f"orders to compile for {arch} with --presets (e.g. --presets 120: the mma.sync order)")
        which = f"--presets {','.join(map(str, presets))}" if args.presets else f"--arch {arch} (its presets)"
        parser.error(f"{which} with --head-dims {','.join(map(str, args.head_dims))} selects no kernel: {fa4}")
    try:
        directory = cache.cache_dir()
    except ValueError as e:  # JAX_DQPOST_CACHE_DIR names no directory
        parser.error(str(e))
    if directory is None:
        print("the on-disk cache is off (JAX_DQPOST_CACHE_DIR=none): nothing would be kept", file=sys.stderr)
        return 1
    unusable = cache.unusable(directory)
    if unusable:
        print(f"{parser.prog}: error: {unusable}: nothing would be kept", file=sys.stderr)
        return 1
    tilings = [Tiling[name.upper()] for name in args.tilings]
    singles = tuning.single_part_kernels(configs, tilings, args.dtypes)
    one_head = any(key.tuning.short_heads != SHORT_HEADS for key in singles)
    short = f", short tiles of {SHORT_HEADS} heads or 1" if one_head else ""
    kinds = [("kernels", singles, f"{len(configs)} layouts x {len(args.dtypes)} dtypes x {len(tilings)} tilings, "
              f"whole or split tiles{short}")]
    if args.fused:
        fused = fused_configurations(presets, args.head_dims)
        sinks = [None if sink == "none" else (sink, sink) for sink in args.fused]
        kinds.append(("fused kernels", tuning.fused_kernels(fused, tilings, args.dtypes, sinks),
                      f"{len(fused)} layout pairs x {len(args.dtypes)} dtypes x {len(tilings)} tilings x "
                      f"{len(sinks)} sinks"))
    for what, keys, shape in kinds:
        start = time.perf_counter()
        try:
            compiled = cache.compile_missing(keys, arch)
        except ModuleNotFoundError as e:  # the CuTe DSL is not installed: say which distribution, no traceback
            if cute_runtime.dsl_missing(e.name) is None:
                raise
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return 1
        except cute_runtime.NoRuntime as e:  # no build of the DSL for this driver: what to install, no traceback
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return 1
        if compiled:
            print(f"{len(keys)} {what} for {arch} ({shape}): {compiled} compiled in {time.perf_counter() - start:.1f} "
                  f"s, {len(keys) - compiled} already cached; in {directory}")
        else:
            print(f"{len(keys)} {what} for {arch} ({shape}): all already cached in {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
