"""Compile the CuTe DSL kernel once per binary-changing configuration; cutlass is imported lazily here.

The key (``Plan.kernel_key`` and the target GPU) holds what changes the binary: output dtype, accumulator
layout, padded head dim, tiling and GPU architecture. Batch, heads, sequence lengths, head dim and scale are
run-time arguments of the compiled module, so they never trigger a compile.

Two caches: in memory (per process), and on disk (``$JAX_DQPOST_CACHE_DIR``, default
``$XDG_CACHE_HOME/jax_dqpost`` or ``~/.cache/jax_dqpost``; ``JAX_DQPOST_CACHE_DIR=none`` turns it off). A disk
entry's name hashes the key with the package version, the kernel source and the CuTe DSL version, so a change
to any of them misses; entries are written to a temporary file and renamed into place, so processes sharing the
directory never see a partial file. An entry holds a header and the sha256 of the module before the module
itself, and is verified on every read: a damaged one (truncated, overwritten) is discarded with one warning,
then compiled again and rewritten. A disk hit does not import cutlass. Kernels are written to the default
directory only on a machine with a CUDA GPU (a CPU-only machine that exports for CUDA leaves the user's cache
alone) or when asked to (``python -m jax_dqpost.precompile``); a configured ``JAX_DQPOST_CACHE_DIR`` is always
written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np

from . import arch as arch_
from ._version import __version__
from .layout import AccumLayout
from .plan import OUT_DTYPES, Tiling

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
    """'bf16' or 'f16' for the output dtype (or that name itself), else ValueError."""
    if isinstance(dtype, str) and dtype in OUT_DTYPES.values():
        return dtype
    name = OUT_DTYPES.get(np.dtype(dtype))
    if name is None:
        raise ValueError(f"dtype must be bfloat16 or float16, got {np.dtype(dtype)}")
    return name


def get_kernel(dtype, layout: AccumLayout, padded_head_dim: int, tiling: Tiling = Tiling.DENSE, *,
               arch: str | None = None, persist: bool | None = None) -> CompiledKernel:
    """The compiled module for this configuration (``Plan.kernel_key``), from a cache or compiled now.

    ``arch``: the target GPU (default: :func:`jax_dqpost.arch.target_arch`). ``persist``: write a new module to
    the default on-disk cache even without a local GPU (None: see the module docstring).
    """
    arch = arch_.check_arch(arch, f"arch={arch!r}") if arch else arch_.target_arch()
    return _get((dtype_name(dtype), layout, int(padded_head_dim), Tiling(tiling), arch), persist)


def get_fused_kernel(dtype, parts: tuple, sink: tuple | None = None, *, arch: str | None = None,
                     persist: bool | None = None) -> CompiledKernel:
    """The fused kernel (``kernel_fused.py``) for ``FusedPlan.kernel_key``: ``parts``, a ``(layout, padded head
    dim, tiling)`` per tensor; ``sink``, the names of the sink's and dsink's dtypes (``'f32'``, ``'bf16'``,
    ``'f16'``) or None."""
    arch = arch_.check_arch(arch, f"arch={arch!r}") if arch else arch_.target_arch()
    parts = tuple((layout, int(dr), Tiling(tiling)) for layout, dr, tiling in parts)
    return _get(("fused", dtype_name(dtype), parts, None if sink is None else tuple(sink), arch), persist)


def _get(key: tuple, persist: bool | None) -> CompiledKernel:
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            hit = _load(key)
        if hit is None:
            hit = _compile_fused(*key[1:]) if key[0] == "fused" else _compile(*key)
            _store(key, hit, persist)
        _cache[key] = hit
    return hit


def cache_dir() -> Path | None:
    """The on-disk cache directory, or None when ``JAX_DQPOST_CACHE_DIR=none``."""
    configured = os.environ.get("JAX_DQPOST_CACHE_DIR")
    if configured is not None:
        return None if configured.strip().lower() in ("", "none", "off", "0") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jax_dqpost"


def cache_size() -> int:
    """Modules held in memory (compiled or loaded by this process)."""
    with _lock:
        return len(_cache)


_ENTRY_MAGIC = b"jax_dqpost module v2\n"
"""An on-disk entry: this header, the module's sha256 (32 bytes), the module."""


def _disk_name(key: tuple) -> str:
    from importlib import metadata

    try:
        dsl = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:  # a DSL on PYTHONPATH, not installed as a distribution
        dsl = "unknown"
    here = Path(__file__).parent
    names = ("kernel.py", "kernel_fused.py", "layout.py", "varlen.py")
    source = b"".join((here / name).read_bytes() for name in names)
    digest = hashlib.sha256(repr((key, __version__, dsl, FUNCTION_PREFIX, _ENTRY_MAGIC)).encode() + source).hexdigest()
    label = "fused" if key[0] == "fused" else f"{key[0]}-{key[3].name.lower()}"
    return f"{label}-{key[-1]}-{digest[:40]}.cute"


def _load(key: tuple) -> CompiledKernel | None:
    """The module of a verified disk entry, or None (no entry, no cache, or a damaged entry, which is removed)."""
    directory = cache_dir()
    if directory is None:
        return None
    path = directory / _disk_name(key)
    try:
        entry = path.read_bytes()
    except OSError:
        return None
    head = len(_ENTRY_MAGIC)
    module, digest = entry[head + 32:], entry[head:head + 32]
    if entry[:head] == _ENTRY_MAGIC and module and hashlib.sha256(module).digest() == digest:
        return CompiledKernel(module=module, fingerprint=digest.hex(), arch=key[-1])
    warnings.warn(f"jax_dqpost: the kernel cache entry {path} is damaged ({len(entry)} bytes that fail their sha256 "
                  "check); compiling the kernel again and rewriting the entry", RuntimeWarning, stacklevel=4)
    with contextlib.suppress(OSError):
        path.unlink()
    return None


def _store(key: tuple, kernel: CompiledKernel, persist: bool | None) -> None:
    directory = cache_dir()
    if directory is None:
        return
    if persist is None:
        persist = "JAX_DQPOST_CACHE_DIR" in os.environ or bool(arch_.cuda_devices())
    if not persist:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(_ENTRY_MAGIC + bytes.fromhex(kernel.fingerprint) + kernel.module)
        os.replace(tmp, directory / _disk_name(key))  # atomic: readers see the old file or the whole new one
    except OSError:  # a read-only or full cache is not an error: the kernel is compiled, just not kept
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)


def _compile(dtype: str, layout: AccumLayout, padded_head_dim: int, tiling: Tiling, arch: str) -> CompiledKernel:
    executor = compile_executor(dtype, layout, padded_head_dim, tiling, arch)
    module = bytes(executor.dump_to_object(FUNCTION_PREFIX))
    return CompiledKernel(module=module, fingerprint=hashlib.sha256(module).hexdigest(), arch=arch)


def cute_dtype(dtype: str):
    """The CuTe numeric type of an output dtype name ('bf16', 'f16')."""
    import cutlass

    return {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}[dtype_name(dtype)]


def executor_args(dtype: str, acc: int, dq: int, scale: int, aux: int, extents) -> tuple:
    """The arguments of the kernel's C ABI (kernel.py ``__call__``) but the stream, as CuTe values: device
    addresses of the fp32 accumulator, dQ (``dtype``), the fp32 scale and the int32 aux operand (seqused_q or
    the work list; any address when unused), then the int32 ``extents`` (``Plan.launch_extents``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    gmem = cute.AddressSpace.gmem
    return (make_ptr(cutlass.Float32, acc, gmem, assumed_align=16),
            make_ptr(cute_dtype(dtype), dq, gmem, assumed_align=16),
            make_ptr(cutlass.Float32, scale, gmem, assumed_align=4),
            make_ptr(cutlass.Int32, aux, gmem, assumed_align=4),
            *(cutlass.Int32(d) for d in extents))


def compile_executor(dtype: str, layout: AccumLayout, padded_head_dim: int, tiling: Tiling, arch: str, **tuning):
    """``cute.compile`` the kernel; returns CuTe's executor, callable from Python with the arguments of the
    C ABI (kernel.py: pointers, int32 extents, stream). Callers serialise through ``_lock`` or accept that
    the DSL's global arch is set here (and restored afterwards). ``tuning``: keyword arguments of
    :class:`~jax_dqpost.kernel.DqPostprocess` for experiments (tools/ncu_kernels.py); the package itself
    always compiles with the defaults, which is why they are not part of the cache key."""
    from .kernel import DqPostprocess

    cute_type = cute_dtype(dtype)
    if not DqPostprocess.can_implement(cute_type, layout, padded_head_dim):
        raise ValueError(f"jax_dqpost: no kernel for dtype={dtype}, {layout}, padded head dim {padded_head_dim}")
    kernel = DqPostprocess(cute_type, layout, padded_head_dim, tiling=Tiling(tiling),
                           target_sm=arch_.sm_version(arch), **tuning)
    # placeholder addresses and extents: the executor takes the real ones at every call
    return _cute_compile(kernel, executor_args(dtype, 16, 16, 16, 16, (1, 1, 1, 8, 1)), arch)


FUSED_SLOTS = ("acc_q", "out_q", "aux_q", "acc_k", "out_k", "acc_v", "out_v", "aux_k", "scales", "sink", "lse",
               "dpsum", "dsink")
"""The fused kernel's pointer arguments, in the order of its C ABI (``kernel_fused.py``, ``__call__``)."""


def fused_executor_args(dtype: str, sink, addresses, extents) -> tuple:
    """The fused kernel's C ABI but the stream, as CuTe values: one device address per :data:`FUSED_SLOTS`
    entry (any address for an absent operand), then its 15 int32 extents (``FusedPlan.launch_extents``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    f32, i32, out = cutlass.Float32, cutlass.Int32, cute_dtype(dtype)
    sink_type, dsink_type = (f32, f32) if sink is None else (_sink_type(sink[0]), _sink_type(sink[1]))
    types = (f32, out, i32, f32, out, f32, out, i32, f32, sink_type, f32, f32, dsink_type)
    vectors = {"acc_q", "out_q", "acc_k", "out_k", "acc_v", "out_v"}  # 16-byte aligned (checked by the handler)
    ptrs = tuple(make_ptr(t, a, cute.AddressSpace.gmem, assumed_align=16 if name in vectors else t.width // 8)
                 for name, t, a in zip(FUSED_SLOTS, types, addresses))
    return ptrs + tuple(cutlass.Int32(e) for e in extents)


def _sink_type(name: str):
    import cutlass

    return {"f32": cutlass.Float32, "bf16": cutlass.BFloat16, "f16": cutlass.Float16}[name]


def compile_fused_executor(dtype: str, parts: tuple, sink, arch: str):
    """``cute.compile`` the fused kernel (``get_fused_kernel``'s arguments); CuTe's executor."""
    from .kernel import DqPostprocess
    from .kernel_fused import FusedPostprocess, PartSpec

    cute_type = cute_dtype(dtype)
    for layout, dr, _ in parts:
        if not DqPostprocess.can_implement(cute_type, layout, dr):
            raise ValueError(f"jax_dqpost: no kernel for dtype={dtype}, {layout}, padded head dim {dr}")
    kernel = FusedPostprocess(cute_type, tuple(PartSpec(*p) for p in parts),
                              None if sink is None else (_sink_type(sink[0]), _sink_type(sink[1])),
                              target_sm=arch_.sm_version(arch))
    extents = [1, 1, 1, 8, 1] * len(parts) + [0] * 5 * (3 - len(parts))
    return _cute_compile(kernel, fused_executor_args(dtype, sink, [16] * len(FUSED_SLOTS), extents), arch)


def _compile_fused(dtype: str, parts: tuple, sink, arch: str) -> CompiledKernel:
    module = bytes(compile_fused_executor(dtype, parts, sink, arch).dump_to_object(FUNCTION_PREFIX))
    return CompiledKernel(module=module, fingerprint=hashlib.sha256(module).hexdigest(), arch=arch)


def _cute_compile(kernel, args: tuple, arch: str):
    import warnings

    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    # Arch-dependent code paths inside the DSL read a process-wide setting: set it for this compile only,
    # so that other users of the DSL in this process (e.g. FlashAttention) keep theirs.
    # (Reading ``envar.arch`` when it is unset probes the GPU through the driver; the raw field is saved
    # instead where this DSL version has it.)
    envar = CuTeDSL._get_dsl().envar
    raw = hasattr(envar, "_arch")
    previous = envar._arch if raw else envar.arch
    envar.arch = arch
    try:
        with warnings.catch_warnings():
            # The kernel unrolls its per-thread loops statically on purpose: register fragments must be indexed
            # with compile-time constants (a run-time index would move them to local memory). The DSL warns
            # about such loops from 64 iterations on; their compile time is measured in the tests.
            warnings.filterwarnings("ignore", category=DSLOptimizationWarning)
            return cute.compile(kernel, *args, cuda.CUstream(0), options=f"--gpu-arch {arch}")
    finally:
        if raw:
            envar._arch = previous
        else:
            envar.arch = previous
