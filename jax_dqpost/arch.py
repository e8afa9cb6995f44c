"""Which GPU architecture the CUDA kernel is compiled for, and whether this process has a CUDA device.

Precedence: the innermost :func:`cuda_arch` context (a ``contextvars.ContextVar``: per thread and per asyncio
task), then the ``CUTE_DSL_ARCH`` environment variable, then the first CUDA device JAX sees. Never guesses.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re

_ARCH_PATTERN = re.compile(r"^sm_\d{2,3}[af]?$")
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("jax_dqpost_cuda_arch", default=None)


def check_arch(arch) -> str:
    """``arch`` if it names a GPU architecture (``sm_80``, ``sm_90a``, ``sm_100a``...), else ``ValueError``."""
    if not isinstance(arch, str) or not _ARCH_PATTERN.match(arch):
        raise ValueError(f"GPU architecture must look like 'sm_90a', 'sm_80' or 'sm_100a', got {arch!r}")
    return arch


@contextlib.contextmanager
def cuda_arch(arch: str):
    """Compile the kernel for ``arch`` (e.g. ``"sm_90a"``) while lowering for CUDA inside this block, whatever
    GPU (if any) this machine has: for ``jax.export`` on a machine without a GPU, or for another GPU.

    Precedence: this context, then the ``CUTE_DSL_ARCH`` environment variable, then the first CUDA device.
    """
    token = _override.set(check_arch(arch))
    try:
        yield
    finally:
        _override.reset(token)


@functools.cache
def cuda_devices() -> tuple:
    """The CUDA devices JAX sees (empty without a GPU or without JAX's CUDA plugin)."""
    import jax

    try:
        return tuple(jax.devices("cuda"))
    except RuntimeError:
        return ()


def target_arch() -> str:
    """The GPU architecture to compile for (see the module docstring); ``RuntimeError`` if nothing names one."""
    chosen = _override.get()
    if chosen is not None:
        return chosen
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return check_arch(env)
    devices = cuda_devices()
    if not devices:
        raise RuntimeError(
            "jax_dqpost: lowering for CUDA without a CUDA device; set CUTE_DSL_ARCH (e.g. CUTE_DSL_ARCH=sm_90a) "
            "or use `with jax_dqpost.cuda_arch('sm_90a'):` to choose the GPU architecture to compile the kernel for"
        )
    major, minor = str(devices[0].compute_capability).split(".")
    return f"sm_{major}{minor}{'a' if int(major) >= 9 else ''}"


def sm_version(arch: str) -> int:
    """``"sm_90a"`` -> 90, ``"sm_100a"`` -> 100, ``"sm_80"`` -> 80."""
    return int("".join(ch for ch in check_arch(arch)[3:] if ch.isdigit()))
