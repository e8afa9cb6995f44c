"""The CUDA lowering: a custom call to our FFI target (``_ffi.TARGET_NAME``) that carries the call's compiled CuTe
module and launches it with the buffers in the order of ``abi.py``.

Attributes of the call (``ffi/dqpost_ffi.cc``, ``Execute``): ``module`` (the object module) and ``fingerprint`` (its
sha256, the handler's load-cache key), ``bytes`` (each buffer's size, checked by the handler with its element type
and rank, so a buffer never disagrees with the extents the kernel indexes it by), ``extents`` (``Plan.launch``) and
``ctas`` (the launch's CTAs; 0: nothing to do).
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from . import _ffi, arch
from .plan import Plan


def cuda_lowering(ctx, *args, plan: Plan):
    from . import kernel_cache  # imports cutlass lazily, at the first CUDA lowering (if the disk cache misses)

    if ctx.module_context.lowering_parameters.for_export:
        _check_export_allows_target()
    accs = plan.split(ctx.avals_in).acc
    extents, ctas = plan.launch([a.shape for a in accs])  # CUDA's grid limits, checked before any compile
    kernel = kernel_cache.get_kernel(plan.kernel)
    if arch.cuda_devices():  # lowering for export on a machine without a GPU needs no registration
        _ffi.register()
    sizes = [int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in list(ctx.avals_in) + list(ctx.avals_out)]
    return jax.ffi.ffi_lowering(_ffi.TARGET_NAME)(
        ctx, *args, module=kernel.module, fingerprint=_ffi.call_fingerprint(kernel.fingerprint),
        bytes=np.asarray(sizes, np.int64), extents=np.asarray(extents, np.int64), ctas=np.int64(ctas))


def _check_export_allows_target() -> None:
    """In ``jax.export.export``: raise a short ``ValueError`` saying what to pass unless its ``disabled_checks``
    allow our target. jax's own refusal, raised after the lowering, prints the whole custom call with the kernel it
    carries (tens of thousands of characters) and names neither the package nor :data:`~jax_dqpost.DISABLED_CHECKS`.
    The checks are the exporting call's (its ``do_export`` frame, found on the stack); where none is found (another
    caller, another jax), jax decides as it does."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "do_export"
                                     and frame.f_globals.get("__name__") == "jax._src.export._export"):
        frame = frame.f_back
    checks = None if frame is None else frame.f_locals.get("disabled_checks")
    if checks is None:
        return
    allowed = {check.is_custom_call() for check in checks}
    if _ffi.TARGET_NAME not in allowed and "ALL" not in allowed:
        raise ValueError(f"jax.export.export of a call of jax_dqpost for CUDA needs "
                         f"disabled_checks=jax_dqpost.DISABLED_CHECKS: its custom call {_ffi.TARGET_NAME!r} is not on "
                         "jax's list of targets with a compatibility guarantee (jax_dqpost keeps its own: "
                         "docs/design.md, Compatibility)")
