"""Compile the CuTe DSL kernel once per binary-changing configuration; cutlass is imported lazily here.

The key (``Plan.kernel_key`` and the target GPU) holds what changes the binary: output dtype, accumulator
layout, padded head dim, tiling and GPU architecture. Batch, heads, sequence lengths, head dim and scale are
run-time arguments of the compiled module, so they never trigger a compile.

Two caches: in memory (per process), and on disk (``$JAX_DQPOST_CACHE_DIR``, default
``$XDG_CACHE_HOME/jax_dqpost`` or ``~/.cache/jax_dqpost``; ``JAX_DQPOST_CACHE_DIR=none`` turns it off). A disk
entry's name hashes the key with the package version, the kernel source and the CuTe DSL version, so a change
to any of them misses; entries are written to a temporary file and renamed into place, so processes sharing the
directory never see a partial file. A disk hit does not import cutlass. Kernels are written to the default
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
    arch = arch_.check_arch(arch) if arch else arch_.target_arch()
    key = (dtype_name(dtype), layout, int(padded_head_dim), Tiling(tiling), arch)
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            hit = _load(key)
        if hit is None:
            hit = _compile(*key)
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


def _disk_name(key: tuple) -> str:
    from importlib import metadata

    try:
        dsl = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:  # a DSL on PYTHONPATH, not installed as a distribution
        dsl = "unknown"
    here = Path(__file__).parent
    source = b"".join((here / name).read_bytes() for name in ("kernel.py", "layout.py", "varlen.py"))
    digest = hashlib.sha256(repr((key, __version__, dsl, FUNCTION_PREFIX)).encode() + source).hexdigest()
    return f"{key[0]}-{key[3].name.lower()}-{key[4]}-{digest[:40]}.cute"


def _load(key: tuple) -> CompiledKernel | None:
    directory = cache_dir()
    if directory is None:
        return None
    try:
        module = (directory / _disk_name(key)).read_bytes()
    except OSError:
        return None
    if module[:4] != b"\x7fELF":  # not ours or damaged: recompile and overwrite
        return None
    return CompiledKernel(module=module, fingerprint=hashlib.sha256(module).hexdigest(), arch=key[4])


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
            f.write(kernel.module)
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
    import warnings

    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    from .kernel import DqPostprocess

    cute_type = cute_dtype(dtype)
    if not DqPostprocess.can_implement(cute_type, layout, padded_head_dim):
        raise ValueError(f"jax_dqpost: no kernel for dtype={dtype}, {layout}, padded head dim {padded_head_dim}")
    kernel = DqPostprocess(cute_type, layout, padded_head_dim, tiling=Tiling(tiling),
                           target_sm=arch_.sm_version(arch), **tuning)
    # Arch-dependent code paths inside the DSL read a process-wide setting: set it for this compile only,
    # so that other users of the DSL in this process (e.g. FlashAttention) keep theirs.
    # (Reading ``envar.arch`` when it is unset probes the GPU through the driver; the raw field is saved
    # instead where this DSL version has it.)
    envar = CuTeDSL._get_dsl().envar
    raw = hasattr(envar, "_arch")
    previous = envar._arch if raw else envar.arch
    envar.arch = arch
    try:  # placeholder addresses and extents: the executor takes the real ones at every call
        with warnings.catch_warnings():
            # The kernel unrolls its per-thread loops statically on purpose: register fragments must be indexed
            # with compile-time constants (a run-time index would move them to local memory). The DSL warns
            # about such loops from 64 iterations on; their compile time is measured in the tests.
            warnings.filterwarnings("ignore", category=DSLOptimizationWarning)
            return cute.compile(kernel, *executor_args(dtype, 16, 16, 16, 16, (1, 1, 1, 8, 1)), cuda.CUstream(0),
                                options=f"--gpu-arch {arch}")
    finally:
        if raw:
            envar._arch = previous
        else:
            envar.arch = previous
