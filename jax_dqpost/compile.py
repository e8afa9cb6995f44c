"""Compile the CuTe DSL kernel once per binary-changing configuration; cutlass is imported lazily here.

The key holds what changes the binary: output dtype, accumulator layout, padded head dim and the
target GPU architecture. Batch, heads, sequence length, head dim and scale are runtime arguments of
the compiled module, so they never trigger a compile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading

import numpy as np

from .layout import AccumLayout

FUNCTION_PREFIX = "jax_dqpost"
"""Symbol prefix of the compiled entry point; ffi/dqpost_ffi.cc looks the function up by it."""

@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    module: bytes  # CuTe object module (dump_to_object), carried in the HLO as an attribute
    fingerprint: str  # sha256 of module: the FFI handler's load-cache key
    arch: str  # e.g. "sm_90a"


_lock = threading.Lock()  # CuTe tracing mutates process-global DSL state: one compile at a time
_cache: dict[tuple, CompiledKernel] = {}


def dtype_name(dtype) -> str:
    """'bf16' or 'f16' (the FFI attribute), else ValueError."""
    import ml_dtypes

    dtype = np.dtype(dtype)
    if dtype == np.dtype(ml_dtypes.bfloat16):
        return "bf16"
    if dtype == np.dtype(np.float16):
        return "f16"
    raise ValueError(f"dtype must be bfloat16 or float16, got {dtype}")


def target_arch() -> str:
    """The GPU architecture to compile for.

    ``CUTE_DSL_ARCH`` (e.g. ``sm_90a``) when set, so lowering for CUDA works on machines without a GPU;
    else the first CUDA device JAX sees. Never guesses.
    """
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return env
    import jax

    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        devices = []
    if not devices:
        raise RuntimeError(
            "jax_dqpost: lowering for CUDA without a CUDA device; set CUTE_DSL_ARCH (e.g. CUTE_DSL_ARCH=sm_90a) "
            "to choose the GPU architecture to compile the kernel for"
        )
    major, minor = str(devices[0].compute_capability).split(".")
    return f"sm_{major}{minor}{'a' if int(major) >= 9 else ''}"


def sm_version(arch: str) -> int:
    """``"sm_90a"`` -> 90, ``"sm_100a"`` -> 100, ``"sm_80"`` -> 80."""
    digits = "".join(ch for ch in arch[3:] if ch.isdigit())
    if not arch.startswith("sm_") or not digits:
        raise ValueError(f"GPU architecture must look like sm_90a, got {arch!r}")
    return int(digits)


def get_kernel(dtype, layout: AccumLayout, tile_hdim: int, mode: str = "dense",
               arch: str | None = None) -> CompiledKernel:
    """The compiled module for this configuration, from the in-memory cache or compiled now.

    ``mode``: ``"dense"``, ``"dense_seqused"`` or ``"varlen"`` (how tiles are found, see primitive.py).
    """
    arch = arch or target_arch()
    key = (dtype_name(dtype), layout, int(tile_hdim), mode, arch)
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            hit = _cache[key] = _compile(*key)
    return hit


def cache_size() -> int:
    with _lock:
        return len(_cache)


def _compile(dtype: str, layout: AccumLayout, tile_hdim: int, mode: str, arch: str) -> CompiledKernel:
    module = bytes(compile_executor(dtype, layout, tile_hdim, mode, arch).dump_to_object(FUNCTION_PREFIX))
    return CompiledKernel(module=module, fingerprint=hashlib.sha256(module).hexdigest(), arch=arch)


def compile_executor(dtype: str, layout: AccumLayout, tile_hdim: int, mode: str, arch: str):
    """``cute.compile`` the kernel; returns CuTe's executor, callable from Python with the arguments of the
    C ABI (kernel.py: pointers, int32 extents, stream). Callers serialise through ``_lock`` or accept that
    the DSL's global arch is set here."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    from .kernel import DqPostprocess

    cute_dtype = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}[dtype]
    if not DqPostprocess.can_implement(cute_dtype, layout, tile_hdim):
        raise ValueError(f"jax_dqpost: no kernel for dtype={dtype}, {layout}, padded head dim {tile_hdim}")
    kernel = DqPostprocess(cute_dtype, layout, tile_hdim, mode=mode, target_sm=sm_version(arch))
    CuTeDSL._get_dsl().envar.arch = arch  # arch-dependent code paths inside the DSL read this global
    gmem = cute.AddressSpace.gmem
    return cute.compile(
        kernel,
        make_ptr(cutlass.Float32, 16, gmem, assumed_align=16),  # dq_accum
        make_ptr(cute_dtype, 16, gmem, assumed_align=16),  # dq
        make_ptr(cutlass.Float32, 16, gmem, assumed_align=4),  # scale
        make_ptr(cutlass.Int32, 16, gmem, assumed_align=4),  # seqused_q / work list (unused when dense)
        cutlass.Int32(1),  # batch, or spans (varlen)
        cutlass.Int32(1),  # heads
        cutlass.Int32(1),  # seqlen, or total_q (varlen)
        cutlass.Int32(8),  # head_dim
        cutlass.Int32(1),  # CTAs per head along x
        cuda.CUstream(0),
        options=f"--gpu-arch {arch}",
    )
