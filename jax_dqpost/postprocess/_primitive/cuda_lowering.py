"""The CUDA lowering: a custom call to our FFI target (``ffi.TARGET_NAME``) that carries the call's compiled CuTe
module and launches it with the buffers in the order of ``_kernel/abi.py``.

Attributes of the call (``ffi/dqpost_ffi.cc``, ``Execute``): ``module`` (the object module) and ``fingerprint`` (its
sha256, the handler's load-cache key), ``bytes`` (each buffer's size, checked by the handler with its element type
and rank, so a buffer never disagrees with the extents the kernel indexes it by), ``extents`` (``Plan.launch``) and
``ctas`` (the launch's CTAs; 0: nothing to do).

``jax.export`` of a program holding the call needs ``disabled_checks=jax_dqpost.DISABLED_CHECKS`` (``ffi.py``):
without it jax refuses the target after this lowering, printing the call with the module it carries; jax tells a
lowering nothing of the export's checks, so this lowering cannot word that refusal itself.
"""

from __future__ import annotations

import jax
import numpy as np

from . import ffi
from ..._kernel import arch
from .plan import Plan


def lower(ctx, *args, plan: Plan):
    from ..._kernel import cache  # imports cutlass lazily, at the first CUDA lowering (if the disk cache misses)

    accs = plan.group(ctx.avals_in).acc
    extents, ctas = plan.launch([a.shape for a in accs])  # CUDA's grid limits, checked before any compile
    kernel = cache.get_kernel(plan.kernel([a.shape for a in accs]))
    if arch.cuda_devices():  # lowering for export on a machine without a GPU needs no registration
        ffi.register()
    sizes = [int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in list(ctx.avals_in) + list(ctx.avals_out)]
    return jax.ffi.ffi_lowering(ffi.TARGET_NAME)(
        ctx, *args, module=kernel.module, fingerprint=ffi.call_fingerprint(kernel.fingerprint),
        bytes=np.asarray(sizes, np.int64), extents=np.asarray(extents, np.int64), ctas=np.int64(ctas))
