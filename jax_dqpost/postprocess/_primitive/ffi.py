"""Find the built FFI library and register its CUDA target with XLA, once (locked, idempotent).

``import jax_dqpost`` registers the target where jax has a CUDA plugin (:func:`register_at_import`), so that a
process that only deserializes and calls a ``jax.export`` artifact finds its handler; registering loads the handler
library (no CUDA library linked) and hands it the path of the CuTe DSL runtime (:mod:`.cute_runtime`, which loads
libcuda only to ask the driver's CUDA version), which the handler opens at the first call that needs it. It does not
import the CuTe DSL, initialize CUDA or start jax's backends (XLA keeps registrations made before then). Where no
runtime can be had (no CuTe DSL, no flavour of it for this driver), the handler returns that cause as the error of
every call; a lowering (:func:`register`) raises it at once. A handler library that cannot be loaded or does not fit
the running jaxlib is reported by one ``RuntimeWarning`` at import, since XLA then has no handler of ours to report
with, and raised by every lowering for CUDA.

The target's handler is command-buffer compatible: XLA records our launch into its command buffers (CUDA graphs)
by stream capture, as it does its own kernels. ``JAX_DQPOST_COMMAND_BUFFERS=0`` (read at registration, once per
process) registers the plain handler instead, which XLA launches itself, between its command buffers
(docs/design.md, "CUDA graphs").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pkgutil
import re
import threading
from pathlib import Path

import jax

from ... import _checks
from ..._kernel import cute_runtime

TARGET_NAME = "jax_dqpost_postprocess_v3"
"""The custom-call target every call lowers to (its compatibility rule: docs/design.md, "Compatibility")."""
DISABLED_CHECKS = (jax.export.DisabledSafetyCheck.custom_call(TARGET_NAME),)
"""``jax.export.export(..., disabled_checks=jax_dqpost.DISABLED_CHECKS)``: our target is not on JAX's list of
custom calls with stable ABIs, so exporting a function that lowers to it for CUDA needs this check disabled."""

COMMAND_BUFFERS_ENV = "JAX_DQPOST_COMMAND_BUFFERS"
"""Set to 0 to keep our launches out of XLA's command buffers (see the module docstring)."""

STATE_TYPE_NAME = "jax_dqpost_loaded_kernel"
"""The FFI type of the handler's per-instance state (the kernel function an instance launches)."""

_LIBRARY_NAME = "libjax_dqpost_ffi.so"
_lock = threading.Lock()
_registered = False
_library: ctypes.CDLL | None = None  # the handler library, once registered
_runtime_loaded = False  # whether the handler has opened the CuTe runtime (register() opened it)


@functools.cache
def command_buffers() -> bool:
    """Whether XLA may capture our launches into its command buffers: yes unless ``JAX_DQPOST_COMMAND_BUFFERS=0``
    (unset, empty or 1: yes; ``ValueError`` for any other value). Read once per process, at import: the
    registration and every lowering agree."""
    return _checks.env_flag(COMMAND_BUFFERS_ENV, "lets XLA capture the kernel into its command buffers, "
                                                 "docs/design.md", default=True)


command_buffers()  # a bad JAX_DQPOST_COMMAND_BUFFERS fails here, at import, on every platform


def call_fingerprint(fingerprint: str) -> str:
    """The custom call's ``fingerprint`` attribute for a module with this sha256: the sha256 itself, and with
    command buffers (the default) a suffix, so that a program compiled for the capturable handler never shares
    a compilation-cache entry (JAX's persistent cache keys on the HLO) with one compiled for the plain ones: XLA
    decides at compile time which calls its command buffers capture. The handler uses the attribute only as the key
    of its loaded modules."""
    return fingerprint + ("+command-buffers" if command_buffers() else "")


def library_path() -> Path:
    """The handler library: ``$JAX_DQPOST_FFI_LIBRARY``, else the one installed with the package, else (when
    ``jax_dqpost`` was imported from a source checkout) the installed distribution's, if built from this tree.

    Python started in the repository root imports the source tree (the working directory is first on the path),
    which has no built library: pip builds it into the installed copy. The tests and the benchmarks, which are not
    installed, run so. Rather than reorder ``sys.path`` (the
    code that runs would not be the tree's) or build into the tree, a checkout uses the library of the installed
    distribution (found with ``importlib.metadata``) when it was built from the same sources: the same package
    version and the same ``ffi/dqpost_ffi.cc`` (its sha256, recorded beside the library at build time). Else it
    raises and says to reinstall: a stale handler is never loaded silently.
    """
    override = os.environ.get("JAX_DQPOST_FFI_LIBRARY")
    path = Path(override) if override else Path(__file__).parents[2] / _LIBRARY_NAME  # the package's folder
    source = Path(__file__).resolve().parents[3] / "ffi" / "dqpost_ffi.cc"
    if not override and not path.is_file() and source.is_file():
        return _installed_library(source)
    if not path.is_file():
        raise RuntimeError(
            f"jax_dqpost: FFI library not found at {path}. Install the package (pip install .) so that "
            "ffi/ is built, or point JAX_DQPOST_FFI_LIBRARY at a built libjax_dqpost_ffi.so."
        )
    return path


_SOURCE_HASH_NAME = "libjax_dqpost_ffi.source-sha256"  # written by ffi/CMakeLists.txt beside the library


def _installed_library(source: Path, distribution: str = "jax-dqpost") -> Path:
    """The installed ``distribution``'s handler library, if built from ``source`` (see ``library_path``)."""
    from importlib import metadata

    from ..._version import __version__

    tree = source.parents[1]
    why = f"jax_dqpost is imported from the source tree {tree}, which has no built FFI library, and"
    again = f"install the package from this tree again (python -m pip install {tree})"
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise RuntimeError(f"{why} {distribution} is not installed: {again}") from None
    if dist.version != __version__:
        raise RuntimeError(f"{why} the installed {distribution} is {dist.version}, this tree {__version__}: {again}")
    lib = next((Path(dist.locate_file(f)) for f in dist.files or () if f.name == _LIBRARY_NAME), None)
    if lib is None or not lib.is_file():
        raise RuntimeError(f"{why} the installed {distribution} has no {_LIBRARY_NAME}: {again}")
    stamp = lib.with_name(_SOURCE_HASH_NAME)
    built_from = stamp.read_text().strip() if stamp.is_file() else None
    if built_from != hashlib.sha256(source.read_bytes()).hexdigest():
        raise RuntimeError(f"{why} the installed {lib} was not built from this tree's {source.name}: {again}")
    return lib


def ffi_api_version(lib: ctypes.CDLL) -> tuple[int, int]:
    """The XLA FFI API version (major, minor) of the headers the handler library was compiled against."""
    get = getattr(lib, "jax_dqpost_ffi_api_version", None)
    if get is None:
        raise RuntimeError(f"jax_dqpost: {lib._name} predates the FFI API check: install jax-dqpost again")
    major, minor = ctypes.c_int(-1), ctypes.c_int(-1)
    get.argtypes, get.restype = [ctypes.POINTER(ctypes.c_int)] * 2, None
    get(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def runtime_ffi_api_version() -> tuple[int, int]:
    """The XLA FFI API version of the running jaxlib: ``XLA_FFI_API_MAJOR``/``MINOR`` of the headers it ships
    (``jax.ffi.include_dir()``)."""
    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    text = header.read_text() if header.is_file() else ""
    found = [re.search(rf"^\s*#\s*define\s+XLA_FFI_API_{part}\s+(\d+)\b", text, re.M) for part in ("MAJOR", "MINOR")]
    if None in found:
        raise RuntimeError(f"jax_dqpost: cannot read the running jaxlib's XLA FFI API version from {header}")
    return int(found[0].group(1)), int(found[1].group(1))


def check_ffi_api_version(handler: tuple[int, int], runtime: tuple[int, int], library: object = "") -> None:
    """Raise unless a handler compiled against XLA FFI API ``handler`` runs under ``runtime``: the same major (a
    new major breaks the ABI) and a minor no newer than the runtime's (XLA keeps older minors working, but a
    handler built for a newer one may use what this jaxlib lacks)."""
    if handler[0] == runtime[0] and handler[1] <= runtime[1]:
        return
    import jaxlib

    raise RuntimeError(
        f"jax_dqpost: the FFI handler {library} was compiled against XLA FFI API {handler[0]}.{handler[1]}, but "
        f"the running jaxlib {getattr(jaxlib, '__version__', '')} implements {runtime[0]}.{runtime[1]}. Reinstall "
        "jax-dqpost against the installed jaxlib: python -m pip install \"scikit-build-core>=1.0\" cmake ninja && "
        "python -m pip install --no-build-isolation --no-deps --force-reinstall <jax-dqpost source>"
    )


def jax_has_cuda_plugin() -> bool:
    """Whether jax has a CUDA plugin installed (``jax_plugins.xla_cuda<N>``), found without starting a backend."""
    try:
        import jax_plugins
    except ImportError:
        return False
    return any(re.fullmatch(r"xla_cuda\d+", m.name) for m in pkgutil.iter_modules(getattr(jax_plugins, "__path__", [])))


def register_at_import() -> None:
    """At ``import jax_dqpost``, where jax has a CUDA plugin: :func:`register` without opening the CuTe runtime.
    A failure is reported by one ``RuntimeWarning`` (see the module docstring); each lowering for CUDA tries again
    and raises it."""
    if not jax_has_cuda_plugin():
        return
    try:
        _register_target()
    except Exception as e:  # noqa: BLE001 -- any cause: import goes on, the lowering raises it
        _checks.warn_at_caller(f"jax_dqpost: the CUDA target is not registered, so calls of jax_dqpost on CUDA "
                               f"(also in exported artifacts) cannot run in this process: {e}", RuntimeWarning)


def register() -> None:
    """Register the CUDA target (once) and open the CuTe runtime now, raising what stops either: the lowering's,
    so that a call fails where it is lowered, naming the cause."""
    global _runtime_loaded
    lib = _register_target()
    with _lock:
        if _runtime_loaded:
            return
        # Again, raising what stops it (NoRuntime, ModuleNotFoundError): cutlass may have loaded its flavour, or
        # JAX_DQPOST_CUTE_RUNTIME been set, since the registration.
        lib.jax_dqpost_set_runtime(str(cute_runtime.runtime_path()).encode(), None)
        err = ctypes.create_string_buffer(2048)
        if lib.jax_dqpost_load_runtime(err, len(err)) != 0:
            raise RuntimeError(err.value.decode())
        _runtime_loaded = True


def _give_runtime(lib: ctypes.CDLL) -> None:
    """Hand the handler the runtime's path, or why there is none (the handler ignores it once loaded)."""
    try:
        path, problem = str(cute_runtime.runtime_path()).encode(), None
    except (ModuleNotFoundError, cute_runtime.NoRuntime) as e:
        path, problem = None, str(e).encode()
    lib.jax_dqpost_set_runtime(path, problem)


def _register_target() -> ctypes.CDLL:
    """Load the handler library, give it the CuTe runtime and register the CUDA target (once); the library."""
    global _registered, _library
    with _lock:
        if _registered:
            return _library
        suffix = "Capturable" if command_buffers() else ""  # a bad value fails before anything is loaded
        path = library_path()
        lib = ctypes.CDLL(str(path))
        check_ffi_api_version(ffi_api_version(lib), runtime_ffi_api_version(), path)
        lib.jax_dqpost_set_runtime.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        lib.jax_dqpost_set_runtime.restype = None
        lib.jax_dqpost_load_runtime.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.jax_dqpost_load_runtime.restype = ctypes.c_int
        _give_runtime(lib)
        # The handler's per-instance state (the loaded kernel function), then the target using it.
        for getter in (lib.jax_dqpost_state_type_id, lib.jax_dqpost_state_type_info):
            getter.restype = ctypes.c_void_p
        jax.ffi.register_ffi_type(
            STATE_TYPE_NAME,
            {"type_id": jax.ffi.pycapsule(lib.jax_dqpost_state_type_id()),
             "type_info": jax.ffi.pycapsule(lib.jax_dqpost_state_type_info())},
            platform="CUDA",
        )
        execute = getattr(lib, "JaxDqpostExecute" + suffix)
        jax.ffi.register_ffi_target(
            TARGET_NAME,
            {"instantiate": jax.ffi.pycapsule(lib.JaxDqpostInstantiate), "execute": jax.ffi.pycapsule(execute)},
            platform="CUDA",
        )
        _registered, _library = True, lib
        return lib
