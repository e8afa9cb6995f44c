"""Which build of NVIDIA's CuTe DSL compiles our kernels, and the runtime library that must launch them.

nvidia-cutlass-dsl ships one build per CUDA major version, a *flavour*: ``cu12`` always (its default), ``cu13`` with
its ``[cu13]`` extra. Each flavour is a compiler extension module, ``cutlass/_mlir/_mlir_libs/_cutlass_ir.cu{N}.*.so``,
and a runtime library, ``nvidia_cutlass_dsl/cu{N}/lib/libcute_dsl_runtime.so``. When cutlass is imported the DSL
loads the newest flavour whose CUDA major the driver supports (``cuDriverGetVersion``), or the newest installed where
no driver answers (its ``_mlir_libs/__init__.py``, ``_select_and_load_cutlass_ir_toolkit``). A module compiled by one
flavour is launched through that flavour's runtime: the bytes differ (the kernel cache keys them apart), and a
CUDA 13 runtime does not run on a CUDA 12 driver.

:func:`flavour` follows the DSL: the flavour already loaded in this process if cutlass is imported, else the one
the DSL's rule picks, found without importing cutlass (an import costs seconds, and a warm start from the disk
cache needs none). :func:`runtime_path` is that flavour's runtime, unless ``JAX_DQPOST_CUTE_RUNTIME`` names
another file. Where no installed flavour runs on this driver, :class:`NoRuntime` says so, naming the driver's CUDA
version, the flavours installed, jax's CUDA plugin and the pip line.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
import sys
from pathlib import Path

RUNTIME_ENV = "JAX_DQPOST_CUTE_RUNTIME"
"""A path to ``libcute_dsl_runtime.so`` that the handler loads instead of the flavour's own."""

_IR_MODULE = "cutlass._mlir._mlir_libs._cutlass_ir"  # the flavour's compiler module, once the DSL has loaded one
_IR_FILE = re.compile(r"^_cutlass_ir\.cu(\d+)\..*\.so$")
_RUNTIME = "libcute_dsl_runtime.so"


DSL_MODULES = {"cutlass": "nvidia-cutlass-dsl", "cuda.bindings": "cuda-python"}
"""The modules a compile imports (lazily: a CPU-only user needs neither) and the distribution that installs each;
jax-dqpost's ``[cuda12]`` and ``[cuda13]`` extras bring both (its base install neither)."""


class NoRuntime(RuntimeError):
    """No installed flavour of the CuTe DSL runs on this machine's CUDA driver (or none is installed)."""


def flavour() -> int:
    """The CUDA major version of the DSL flavour that compiles in this process (12 or 13): the loaded one, else the
    DSL's choice for this driver; :class:`NoRuntime` if none fits, ``ModuleNotFoundError`` without the DSL."""
    loaded = sys.modules.get(_IR_MODULE)
    match = _IR_FILE.match(Path(getattr(loaded, "__file__", "") or "").name)
    if match:
        return int(match.group(1))
    return choose(installed(), driver_cuda_version())


def runtime_path() -> Path:
    """``libcute_dsl_runtime.so`` of :func:`flavour` (``$JAX_DQPOST_CUTE_RUNTIME`` wins)."""
    override = os.environ.get(RUNTIME_ENV)
    if override:
        return Path(override)
    found, chosen = installed(), flavour()
    if chosen not in found:  # loaded by cutlass from a layout without cu<N>/lib/ (an editable DSL): no runtime here
        raise NoRuntime(f"jax_dqpost: the CuTe DSL compiles with its cu{chosen} build, which has no {_RUNTIME} under "
                        f"{next(iter(found.values())).parents[2]}/cu{chosen}/lib: set {RUNTIME_ENV} to its path")
    return found[chosen]


def installed() -> dict[int, Path]:
    """The DSL's installed flavours: CUDA major -> its runtime library (``ModuleNotFoundError`` naming the
    distributions to install where the DSL is missing; :class:`NoRuntime` where it has no complete flavour)."""
    try:
        spec = importlib.util.find_spec("cutlass")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise dsl_missing("cutlass")
    package = Path(spec.origin).resolve().parent  # .../nvidia_cutlass_dsl/dsl_packages/cutlass
    root = package.parents[1]  # .../nvidia_cutlass_dsl
    found = {}
    for entry in (package / "_mlir" / "_mlir_libs").glob("_cutlass_ir.cu*.so"):
        match = _IR_FILE.match(entry.name)
        runtime = root / f"cu{match.group(1)}" / "lib" / _RUNTIME if match else None
        if runtime is not None and runtime.is_file():
            found[int(match.group(1))] = runtime
    if not found:
        raise NoRuntime(f"jax_dqpost: the CuTe DSL at {root} has no complete CUDA flavour (a _cutlass_ir.cu<N> "
                        f"module with cu<N>/lib/{_RUNTIME}): reinstall it: {_pip_line(None)}")
    return found


@functools.cache
def driver_cuda_version() -> int | None:
    """The CUDA version the driver supports (``cuDriverGetVersion``: 12040 is CUDA 12.4), None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        return version.value if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 else None
    except (OSError, AttributeError):
        return None


def choose(flavours: dict[int, Path], driver: int | None) -> int:
    """The DSL's rule: the newest of ``flavours`` whose CUDA major ``driver`` supports (the newest of all without
    a driver); :class:`NoRuntime` naming the driver, the flavours, jax's CUDA plugin and the pip line if none."""
    fitting = sorted((n for n in flavours if driver is None or driver // 1000 >= n), reverse=True)
    if fitting:
        return fitting[0]
    cuda = f"{driver // 1000}.{driver % 1000 // 10}"
    have = ", ".join(f"cu{n}" for n in sorted(flavours))
    raise NoRuntime(
        f"jax_dqpost: no installed CuTe DSL flavour runs on this machine's CUDA driver, which supports CUDA {cuda}: "
        f"nvidia-cutlass-dsl has {have}; jax's CUDA plugin: {jax_cuda_plugins() or 'none'}. "
        + (f"Install the build for this driver: {_pip_line(driver // 1000)}" if driver // 1000 >= 12 else
           "The CuTe DSL needs a driver that supports CUDA 12 or newer: update the driver"))


def jax_cuda_plugins() -> str:
    """The installed jax CUDA plugins with their versions, e.g. ``'jax-cuda13-plugin 0.11.2'`` ('' if none)."""
    from importlib import metadata

    names = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if re.fullmatch(r"jax-cuda\d+-plugin", name):
            names[name] = dist.version
    return ", ".join(f"{name} {version}" for name, version in sorted(names.items()))


def _pip_line(major: int | None) -> str:
    """The install line of jax-dqpost's extra for a driver of CUDA ``major`` (None: the DSL's default, CUDA 12)."""
    return f'python -m pip install "jax-dqpost[{"cuda13" if major and major >= 13 else "cuda12"}]"'


def dsl_missing(module: str | None) -> ModuleNotFoundError | None:
    """The error to raise where importing ``module`` failed, if it is (in) one of ``DSL_MODULES``: one line naming
    its distribution and every other of theirs that is missing, and the pip line of jax-dqpost's CUDA extra that
    installs them (``_extra_line``). None for any other module."""

    def within(name: str) -> bool:  # the module, one inside it, or a missing parent package of it
        return bool(module) and (module == name or module.startswith(name + ".") or name.startswith(module + "."))

    def findable(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module set to None in sys.modules
            return False

    if not any(map(within, DSL_MODULES)):
        return None
    missing = [d for m, d in DSL_MODULES.items() if within(m) or not findable(m)]
    return ModuleNotFoundError(
        f"jax_dqpost compiles its CUDA kernels with {' and '.join(missing)}, not installed here (no module named "
        f"{module!r}): install jax-dqpost's CUDA extra: {_extra_line(driver_cuda_version())}", name=module)


def _extra_line(driver: int | None) -> str:
    """The pip line of jax-dqpost's CUDA extra for ``driver`` (``cuDriverGetVersion``'s number); without a driver
    (a CPU machine exporting for CUDA), ``[cuda13]``'s, naming ``[cuda12]`` for a GPU whose driver runs CUDA 12."""
    if driver is None:
        return f'{_pip_line(13)} ("jax-dqpost[cuda12]" where the GPU\'s driver runs CUDA 12, before 580)'
    return _pip_line(driver // 1000)
