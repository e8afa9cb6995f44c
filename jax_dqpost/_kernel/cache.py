"""Compile the CuTe DSL kernel once per binary-changing configuration; cutlass is imported lazily here.

The key (``Plan.kernel``, a :class:`~jax_dqpost._kernel.spec.KernelSpec`, and the target GPU) holds what changes the
binary: output dtype, each part's accumulator layout, padded head dim and tiling, the sink's dtypes, the tuning (shares
and short-tile heads) and the GPU architecture. Batch, heads, sequence lengths, head dims and scales are run-time
arguments of the compiled module, so they never trigger a compile.

Two caches: in memory (per process), and on disk. ``JAX_DQPOST_CACHE_DIR`` names the disk cache's directory, an
absolute path; ``none`` (that spelling only) turns it off; unset or empty, it is ``$XDG_CACHE_HOME/jax_dqpost`` (an
absolute ``XDG_CACHE_HOME``; else ``~/.cache/jax_dqpost``). Any other value (a relative path, ``off``, ``0``) raises
``ValueError`` where the cache is first read. A directory that cannot be made, read or written is reported by one
``RuntimeWarning`` per process, naming it and why; the kernels are then compiled but not kept. A disk entry's name
hashes the key with the package version, the kernel source and the CuTe DSL's version and flavour (cu12 or cu13,
:mod:`.cute_runtime`), so a change to any of them misses; entries are written to a temporary file and renamed into
place, so processes sharing the directory never see a partial file. An entry holds a header and the sha256 of the
module before the module itself, and is verified on every read: a damaged one (truncated, overwritten) is discarded,
compiled again and rewritten, and only then reported by one ``RuntimeWarning`` at the user's call (the first frame
outside jax_dqpost, jax and jaxlib), so that a filter turning warnings into errors cannot stop the heal (the warning
of an unusable directory is issued there too, after the compile). A disk hit does not import cutlass. Kernels are
written to the default directory only on a machine with a CUDA GPU (a CPU-only machine that exports for CUDA leaves
the user's cache alone) or when asked to (``python -m jax_dqpost.precompile``); a configured
``JAX_DQPOST_CACHE_DIR`` is always written.
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

from .. import _checks
from . import abi, arch as arch_, cute_runtime
from .._version import __version__
from .spec import KernelSpec

KERNEL_SOURCES = ("_kernel/kernel.py", "_kernel/spec.py", "_kernel/schedule.py", "_kernel/tile.py",
                  "_kernel/abi.py", "_kernel/varlen.py", "_kernel/arch.py", "layout/__init__.py",
                  "layout/fragments.py", "layout/limits.py", "layout/_presets.py", "_checks.py")
"""The modules the compiled kernel is made from (``kernel.py``, what it imports and the orders whose methods it
calls), by their paths in the package: part of a disk entry's name."""

CACHE_DIR_ENV = "JAX_DQPOST_CACHE_DIR"
"""The variable naming the on-disk cache's directory (the module docstring says what it takes)."""

FUNCTION_PREFIX = "jax_dqpost"
"""Symbol prefix of the compiled entry point; ffi/dqpost_ffi.cc looks the function up by it."""


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    module: bytes  # CuTe object module (dump_to_object), carried in the HLO as an attribute
    fingerprint: str  # sha256 of module: the FFI handler's load-cache key
    arch: str  # e.g. "sm_90a"


_lock = threading.Lock()  # CuTe tracing mutates process-global DSL state: one compile at a time
_cache: dict[tuple, CompiledKernel] = {}
_unusable_reported = False  # the warning of a cache directory that cannot be used: once per process


def get_kernel(spec: KernelSpec, *, arch: str | None = None, persist: bool | None = None) -> CompiledKernel:
    """The compiled module of ``spec`` (``Plan.kernel``), from a cache or compiled now.

    ``arch``: the target GPU (default: :func:`.arch.target_arch`). ``persist``: write a new module to
    the default on-disk cache even without a local GPU (None: see the module docstring).
    """
    key = _key(spec, arch)
    arch = key[-1]
    notes = []  # warnings: a damaged entry, a directory that cannot be used
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            hit, note = _load(key)
            notes.append(note)
        if hit is None:
            module = bytes(compile_executor(*key).dump_to_object(FUNCTION_PREFIX))
            hit = CompiledKernel(module=module, fingerprint=hashlib.sha256(module).hexdigest(), arch=arch)
            notes.append(_store(key, hit, persist))
        _cache[key] = hit
    for note in filter(None, notes):  # only now, healed: a warning filter that raises cannot stop the rewrite
        _checks.warn_at_caller(note, RuntimeWarning)
    return hit


def on_disk(spec: KernelSpec, *, arch: str | None = None) -> bool:
    """Whether the on-disk cache holds a verified entry for ``spec`` compiled for ``arch``; a damaged entry is not
    one (:func:`get_kernel` heals it, with its warning)."""
    directory, full = cache_dir(), _key(spec, arch)
    try:
        return directory is not None and _read(directory / _disk_name(full), full[-1])[0] is not None
    except OSError:  # a directory that cannot be read holds nothing (get_kernel says why)
        return False


def _key(spec: KernelSpec, arch: str | None) -> tuple[KernelSpec, str]:
    """``(spec, arch)``: a cache key, with the target GPU (default :func:`.arch.target_arch`)."""
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"jax_dqpost: a kernel is a KernelSpec, got {type(spec).__name__}")
    return spec, arch_.check_arch(arch, f"arch={arch!r}") if arch else arch_.target_arch()


def cache_dir() -> Path | None:
    """The on-disk cache directory (see the module docstring), or None when ``JAX_DQPOST_CACHE_DIR=none``;
    ``ValueError`` naming the variable for a value that is neither ``none`` nor an absolute path."""
    configured = os.environ.get(CACHE_DIR_ENV, "")
    if configured == "none":
        return None
    if configured:
        if not os.path.isabs(configured):  # relative to each process's working directory: refused, not guessed
            raise ValueError(f"{CACHE_DIR_ENV} must be an absolute path, or none to turn the on-disk kernel cache "
                             f"off (unset or empty: the default directory), got {configured!r}")
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG base directory specification ignores a relative path
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jax_dqpost"


def _unusable(directory: Path, what: str, error: OSError) -> str | None:
    """The warning that ``directory`` cannot be used as the cache (``what`` failed with ``error``), the first time
    in this process; None after (callers hold ``_lock``)."""
    global _unusable_reported
    if _unusable_reported:
        return None
    _unusable_reported = True
    return (f"jax_dqpost: {_cannot(directory, what, error)}: kernels are compiled but not kept. Set {CACHE_DIR_ENV} "
            "to a directory this process can write, or to none to turn the cache off")


def _cannot(directory: Path, what: str, error: OSError) -> str:
    """``'JAX_DQPOST_CACHE_DIR=... cannot be used as the kernel cache (why)'``: ``what`` failed with ``error``."""
    where = (f"{CACHE_DIR_ENV}={directory}" if os.environ.get(CACHE_DIR_ENV) else
             f"the default kernel cache directory {directory} ({CACHE_DIR_ENV} is unset)")
    is_file = os.path.exists(directory) and not os.path.isdir(directory)
    why = "it is not a directory" if is_file else f"cannot {what}: {error.strerror or error}"
    return f"{where} cannot be used as the kernel cache ({why})"


def cache_size() -> int:
    """Modules held in memory (compiled or loaded by this process)."""
    with _lock:
        return len(_cache)


_ENTRY_MAGIC = b"jax_dqpost module v2\n"
"""An on-disk entry: this header, the module's sha256 (32 bytes), the module."""


def _disk_name(key: tuple) -> str:
    """The entry's file name: the key, the CuTe DSL flavour that compiles it (a cu12 and a cu13 module of one kernel
    differ, and each runs only through its own flavour's runtime) and a hash of everything that changes the module's
    bytes: the key, the package version and kernel sources, the DSL's version and flavour."""
    from importlib import metadata

    flavour = cute_runtime.flavour()
    try:
        dsl = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:  # a DSL on PYTHONPATH, not installed as a distribution
        dsl = "unknown"
    package = Path(__file__).parents[1]
    source = b"".join((package / name).read_bytes() for name in KERNEL_SOURCES)
    ident = (key, __version__, dsl, flavour, FUNCTION_PREFIX, _ENTRY_MAGIC)
    digest = hashlib.sha256(repr(ident).encode() + source).hexdigest()
    spec, arch = key
    return f"{spec.label}-{arch}-cu{flavour}-{digest[:40]}.cute"


def _load(key: tuple) -> tuple[CompiledKernel | None, str | None]:
    """``(module, None)`` for a verified disk entry; ``(None, None)`` for no entry or no cache; ``(None, warning)``
    for a damaged entry, which is removed, or a directory that cannot be read (its warning once per process)."""
    directory = cache_dir()
    if directory is None:
        return None, None
    path = directory / _disk_name(key)
    try:
        kernel, damaged = _read(path, key[-1])
    except OSError as e:
        if not os.path.isdir(directory):  # no directory holds no entry: a miss (the write says why it makes none)
            return None, None
        return None, _unusable(directory, f"read {path.name}", e)
    if damaged is not None:
        with contextlib.suppress(OSError):
            path.unlink()
    return kernel, damaged


def _read(path: Path, arch: str) -> tuple[CompiledKernel | None, str | None]:
    """The entry at ``path``, verified against its sha256: ``(module, None)``, ``(None, None)`` if there is none,
    ``(None, warning)`` if it is damaged; ``OSError`` if it cannot be read."""
    try:
        entry = path.read_bytes()
    except FileNotFoundError:
        return None, None
    head = len(_ENTRY_MAGIC)
    module, digest = entry[head + 32:], entry[head:head + 32]
    if entry[:head] == _ENTRY_MAGIC and module and hashlib.sha256(module).digest() == digest:
        return CompiledKernel(module=module, fingerprint=digest.hex(), arch=arch), None
    return None, (f"jax_dqpost: the kernel cache entry {path} was damaged ({len(entry)} bytes that fail their sha256 "
                  "check); the kernel was compiled again and the entry rewritten")


def _store(key: tuple, kernel: CompiledKernel, persist: bool | None) -> str | None:
    """Write ``kernel``'s entry (where the module docstring says); the warning of a directory that cannot be used,
    once per process, or None."""
    directory = cache_dir()
    if directory is None:
        return None
    if persist is None:
        persist = bool(os.environ.get(CACHE_DIR_ENV)) or bool(arch_.cuda_devices())
    if not persist:
        return None
    what, tmp = "create it", None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        what = "write a file in it"
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(_ENTRY_MAGIC + bytes.fromhex(kernel.fingerprint) + kernel.module)
        os.replace(tmp, directory / _disk_name(key))  # atomic: readers see the old file or the whole new one
    except OSError as e:  # a read-only or full cache is no error: the kernel is compiled, not kept, and we say so
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return _unusable(directory, what, e)
    return None


def unusable(directory: Path) -> str | None:
    """None if ``directory`` can hold the cache (made if missing; a file is written in it and removed), else a
    sentence saying why not (``python -m jax_dqpost.precompile`` asks before it compiles)."""
    what = "create it"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        what = "write a file in it"
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".tmp-"):
            pass
    except OSError as e:
        return _cannot(directory, what, e)
    return None


def compile_executor(spec: KernelSpec, arch: str):
    """``cute.compile`` the kernel of ``spec`` for ``arch``; CuTe's executor, callable from Python with
    ``kernel.entry_args`` and a stream. Callers serialise through ``_lock`` or accept that the DSL's global arch is
    set here (and restored afterwards)."""
    try:
        from .kernel import Postprocess, entry_args
    except ModuleNotFoundError as e:
        raise cute_runtime.dsl_missing(e.name) or e from None

    kernel = Postprocess(spec, target_sm=arch_.sm_version(arch))
    # placeholder addresses and extents: the executor takes the real ones at every call
    n, sink = len(spec.tensors), spec.sink
    args = entry_args(spec.dtype, n, sink, [16] * len(abi.pointers(n, sink is not None)), [1, 1, 1, 8, 1] * n)
    return _cute_compile(kernel, args, arch)


def _cute_compile(kernel, args: tuple, arch: str, options: str = ""):
    """``cute.compile`` for ``arch``, with the DSL's compile ``options`` beside ``--gpu-arch`` (e.g. ``--keep-ptx``:
    the executor's ``__ptx__``)."""
    try:
        import cuda.bindings.driver as cuda
        import cutlass.cute as cute
        from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning
        from cutlass.cutlass_dsl.cutlass import CuTeDSL
    except ModuleNotFoundError as e:
        raise cute_runtime.dsl_missing(e.name) or e from None

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
            return cute.compile(kernel, *args, cuda.CUstream(0), options=f"--gpu-arch {arch} {options}".strip())
    finally:
        if raw:
            envar._arch = previous
        else:
            envar.arch = previous


def compile_missing(keys, arch: str) -> int:
    """Compile each kernel of ``keys`` that the disk cache does not hold for ``arch`` and keep it there; how many were
    compiled. Raises what a compile raises (``ModuleNotFoundError`` without the CuTe DSL,
    ``cute_runtime.NoRuntime`` without a build of it for this driver)."""
    compiled = 0
    for key in keys:
        if on_disk(key, arch=arch):
            continue
        get_kernel(key, arch=arch, persist=True)
        compiled += 1
    return compiled
