"""Find the built FFI library and register its CUDA targets with XLA, once (locked, idempotent).

By default the targets' handlers are not command-buffer compatible: XLA launches our kernel itself, between its
command buffers (CUDA graphs), never by stream capture. ``JAX_DQPOST_COMMAND_BUFFERS=1`` (read at registration,
once per process) registers the command-buffer compatible handlers instead, which XLA records into its graphs;
a graph first recorded while a ``jax.profiler`` session is active then fails with ``CUDA_ERROR_LAUNCH_FAILED``
when it is replayed after the session (docs/design.md, "CUDA graphs and the profiler").
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from pathlib import Path

import jax

TARGET_NAME = "jax_dqpost_postprocess_v1"
"""The custom-call target name of ``dq_postprocess``'s lowering (versioned: a new ABI gets a new name)."""
FUSED_TARGET_NAME = "jax_dqpost_postprocess_v2"
"""The target of the fused kernel (``flash_attention_postprocess``; ``dq_postprocess`` with a sink or a
clustered layout)."""
DISABLED_CHECKS = tuple(jax.export.DisabledSafetyCheck.custom_call(name) for name in (TARGET_NAME, FUSED_TARGET_NAME))
"""``jax.export.export(..., disabled_checks=jax_dqpost.DISABLED_CHECKS)``: our targets are not on JAX's list of
custom calls with stable ABIs, so exporting a function that lowers to them for CUDA needs these checks disabled;
one for every target the package emits."""

COMMAND_BUFFERS_ENV = "JAX_DQPOST_COMMAND_BUFFERS"
"""Set to 1 to let XLA capture our launches into its command buffers (see the module docstring)."""

STATE_TYPE_NAME = "jax_dqpost_loaded_kernel"
"""The FFI type of the handlers' per-instance state (the kernel function an instance launches)."""

_LIBRARY_NAME = "libjax_dqpost_ffi.so"
_lock = threading.Lock()
_registered = False


def command_buffers() -> bool:
    """Whether ``JAX_DQPOST_COMMAND_BUFFERS`` asks for the command-buffer compatible handlers (``ValueError`` for
    a value other than 0/1, true/false, yes/no, on/off, or empty)."""
    value = os.environ.get(COMMAND_BUFFERS_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{COMMAND_BUFFERS_ENV} must be 0 or 1, got {os.environ[COMMAND_BUFFERS_ENV]!r}")


def library_path() -> Path:
    """The handler library: ``$JAX_DQPOST_FFI_LIBRARY``, else the one installed with the package."""
    override = os.environ.get("JAX_DQPOST_FFI_LIBRARY")
    path = Path(override) if override else Path(__file__).with_name(_LIBRARY_NAME)
    if not path.is_file():
        raise RuntimeError(
            f"jax_dqpost: FFI library not found at {path}. Install the package (pip install .) so that "
            "ffi/ is built, or point JAX_DQPOST_FFI_LIBRARY at a built libjax_dqpost_ffi.so."
        )
    return path


def cute_runtime_path() -> Path:
    """``libcute_dsl_runtime.so`` of the installed nvidia-cutlass-dsl (``$JAX_DQPOST_CUTE_RUNTIME`` wins)."""
    override = os.environ.get("JAX_DQPOST_CUTE_RUNTIME")
    if override:
        return Path(override)
    # Found, not imported: importing cutlass costs seconds, and a warm start (kernels from the on-disk
    # cache) needs none of it. .../nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py -> .../cu*/lib/
    spec = importlib.util.find_spec("cutlass")
    if spec is None or not spec.origin:
        raise RuntimeError("jax_dqpost: the CUDA path needs nvidia-cutlass-dsl (package `cutlass` not found)")
    root = Path(spec.origin).resolve().parents[2]
    found = sorted(root.glob("cu*/lib/libcute_dsl_runtime.so"), reverse=True)  # prefer cu13 over cu12
    if not found:
        raise RuntimeError(f"jax_dqpost: libcute_dsl_runtime.so not found under {root}/cu*/lib")
    return found[0]


def register() -> None:
    """Load the handler library, point it at the CuTe runtime and register the CUDA target."""
    global _registered
    with _lock:
        if _registered:
            return
        lib = ctypes.CDLL(str(library_path()))
        err = ctypes.create_string_buffer(1024)
        lib.jax_dqpost_load_runtime.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.jax_dqpost_load_runtime.restype = ctypes.c_int
        if lib.jax_dqpost_load_runtime(str(cute_runtime_path()).encode(), err, len(err)) != 0:
            raise RuntimeError(f"jax_dqpost: cannot load the CuTe DSL runtime: {err.value.decode()}")
        # The handlers' per-instance state (the loaded kernel function), then the targets using it.
        for getter in (lib.jax_dqpost_state_type_id, lib.jax_dqpost_state_type_info):
            getter.restype = ctypes.c_void_p
        jax.ffi.register_ffi_type(
            STATE_TYPE_NAME,
            {"type_id": jax.ffi.pycapsule(lib.jax_dqpost_state_type_id()),
             "type_info": jax.ffi.pycapsule(lib.jax_dqpost_state_type_info())},
            platform="CUDA",
        )
        suffix = "Capturable" if command_buffers() else ""
        for name, execute in ((TARGET_NAME, getattr(lib, "JaxDqpostExecute" + suffix)),
                              (FUSED_TARGET_NAME, getattr(lib, "JaxDqpostExecuteFused" + suffix))):
            jax.ffi.register_ffi_target(
                name,
                {"instantiate": jax.ffi.pycapsule(lib.JaxDqpostInstantiate), "execute": jax.ffi.pycapsule(execute)},
                platform="CUDA",
            )
        _registered = True
