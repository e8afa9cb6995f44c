"""Compile the CuTe DSL kernel once per binary-changing configuration; cutlass is imported lazily here.

The key holds what changes the binary: output dtype, accumulator layout, padded head dim, mode and the
target GPU architecture. Batch, heads, sequence lengths, head dim and scale are runtime arguments of the
compiled module, so they never trigger a compile.

Two caches: in memory (per process), and on disk (``$JAX_DQPOST_CACHE_DIR``, default
``$XDG_CACHE_HOME/jax_dqpost`` or ``~/.cache/jax_dqpost``; ``JAX_DQPOST_CACHE_DIR=none`` turns it off). A disk
entry's name hashes the key with the package version, the kernel source and the CuTe DSL version, so a change
to any of them misses; entries are written to a temporary file and renamed into place, so processes sharing the
directory never see a partial file. A disk hit does not import cutlass. ``python -m jax_dqpost.precompile``
fills the cache ahead of time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import tempfile
import threading
from pathlib import Path

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
_arch_override: list[str] = []  # the cuda_arch() context stack
_ARCH_PATTERN = re.compile(r"^sm_\d{2,3}[af]?$")


def _check_arch(arch: str) -> str:
    if not isinstance(arch, str) or not _ARCH_PATTERN.match(arch):
        raise ValueError(f"GPU architecture must look like 'sm_90a', 'sm_80' or 'sm_100a', got {arch!r}")
    return arch


@contextlib.contextmanager
def cuda_arch(arch: str):
    """Compile the kernel for ``arch`` (e.g. ``"sm_90a"``) while lowering for CUDA inside this block, whatever
    GPU (if any) this machine has: for ``jax.export`` on a machine without a GPU, or for another GPU.

    Precedence: this context, then the ``CUTE_DSL_ARCH`` environment variable, then the first CUDA device.
    """
    _arch_override.append(_check_arch(arch))
    try:
        yield
    finally:
        _arch_override.pop()


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
    """The GPU architecture to compile for: the innermost :func:`cuda_arch` context; else ``CUTE_DSL_ARCH``
    (e.g. ``sm_90a``), so lowering for CUDA works on machines without a GPU; else the first CUDA device JAX
    sees. Never guesses."""
    if _arch_override:
        return _arch_override[-1]
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return _check_arch(env)
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
    arch = _check_arch(arch) if arch else target_arch()
    key = (dtype_name(dtype), layout, int(tile_hdim), mode, arch)
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            hit = _load(key)
        if hit is None:
            hit = _compile(*key)
            _store(key, hit)
        _cache[key] = hit
    return hit


def cache_dir() -> Path | None:
    """The on-disk cache directory, or None when ``JAX_DQPOST_CACHE_DIR=none``."""
    configured = os.environ.get("JAX_DQPOST_CACHE_DIR")
    if configured is not None:
        return None if configured.strip().lower() in ("", "none", "off", "0") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jax_dqpost"


def _disk_name(key: tuple) -> str:
    from importlib import metadata

    from . import __version__

    try:
        dsl = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:  # a DSL on PYTHONPATH (e.g. the GPU machine's copy)
        dsl = "unknown"
    source = (Path(__file__).with_name("kernel.py").read_bytes() + Path(__file__).with_name("layout.py").read_bytes())
    digest = hashlib.sha256(repr((key, __version__, dsl, FUNCTION_PREFIX)).encode() + source).hexdigest()
    return f"{key[0]}-{key[3]}-{key[4]}-{digest[:40]}.cute"


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


def _store(key: tuple, kernel: CompiledKernel) -> None:
    directory = cache_dir()
    if directory is None:
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


def cache_size() -> int:
    with _lock:
        return len(_cache)


def _compile(dtype: str, layout: AccumLayout, tile_hdim: int, mode: str, arch: str) -> CompiledKernel:
    module = bytes(compile_executor(dtype, layout, tile_hdim, mode, arch).dump_to_object(FUNCTION_PREFIX))
    return CompiledKernel(module=module, fingerprint=hashlib.sha256(module).hexdigest(), arch=arch)


def executor_args(dtype: str, acc: int, dq: int, scale: int, aux: int, dims) -> tuple:
    """The arguments of the kernel's C ABI (kernel.py ``__call__``) but the stream, as CuTe values: device
    addresses of the fp32 accumulator, dQ (``dtype``), the fp32 scale and the int32 aux buffer (seqused_q or
    the work list; any address when unused), then the int32 extents ``dims = (dim0, heads, rows, head_dim,
    grid_x)``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    gmem = cute.AddressSpace.gmem
    cute_dtype = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}[dtype]
    return (make_ptr(cutlass.Float32, acc, gmem, assumed_align=16),
            make_ptr(cute_dtype, dq, gmem, assumed_align=16),
            make_ptr(cutlass.Float32, scale, gmem, assumed_align=4),
            make_ptr(cutlass.Int32, aux, gmem, assumed_align=4),
            *(cutlass.Int32(d) for d in dims))


def compile_executor(dtype: str, layout: AccumLayout, tile_hdim: int, mode: str, arch: str, **tuning):
    """``cute.compile`` the kernel; returns CuTe's executor, callable from Python with the arguments of the
    C ABI (kernel.py: pointers, int32 extents, stream). Callers serialise through ``_lock`` or accept that
    the DSL's global arch is set here (and restored afterwards). ``tuning``: keyword arguments of
    :class:`~jax_dqpost.kernel.DqPostprocess` for experiments (tools/ncu_kernels.py); the package itself
    always compiles with the defaults, which is why they are not part of the cache key."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    from .kernel import DqPostprocess

    cute_dtype = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}[dtype]
    if not DqPostprocess.can_implement(cute_dtype, layout, tile_hdim):
        raise ValueError(f"jax_dqpost: no kernel for dtype={dtype}, {layout}, padded head dim {tile_hdim}")
    kernel = DqPostprocess(cute_dtype, layout, tile_hdim, mode=mode, target_sm=sm_version(arch), **tuning)
    # Arch-dependent code paths inside the DSL read a process-wide setting: set it for this compile only,
    # so that other users of the DSL in this process (e.g. FlashAttention) keep theirs.
    # (Reading ``envar.arch`` when it is unset probes the GPU through the driver; the raw field is saved
    # instead where this DSL version has it.)
    envar = CuTeDSL._get_dsl().envar
    raw = hasattr(envar, "_arch")
    previous = envar._arch if raw else envar.arch
    envar.arch = arch
    try:  # placeholder addresses and extents: the executor takes the real ones at every call
        return cute.compile(kernel, *executor_args(dtype, 16, 16, 16, 16, (1, 1, 1, 8, 1)), cuda.CUstream(0),
                            options=f"--gpu-arch {arch}")
    finally:
        if raw:
            envar._arch = previous
        else:
            envar.arch = previous
