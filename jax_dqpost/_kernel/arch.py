"""Which GPU architecture the CUDA kernel is compiled for, and whether this process has a CUDA device.

Precedence: the innermost :func:`cuda_arch` context (a ``contextvars.ContextVar``: per thread and per asyncio
task), then the ``CUTE_DSL_ARCH`` environment variable, then the first CUDA device JAX sees. Never guesses.
Every name is checked against :data:`SUPPORTED_ARCHS` up front (a ``ValueError`` naming it and listing them), not
deep inside the CuTe DSL's compile.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

from .._checks import describe

SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90a") + tuple(
    f"sm_{sm}{suffix}" for sm in (100, 101, 103, 110, 120, 121) for suffix in ("", "a", "f"))
"""The GPU architectures the kernel compiles for: the CuTe DSL's (``cutlass.base_dsl.Arch``) from sm_80 on, but
``sm_90`` (the kernel places Hopper fragments with WGMMA atoms, which only ``sm_90a`` code has: ``sm_90`` is taken
to mean ``sm_90a``, which every Hopper GPU runs) and ``sm_107*`` (the DSL's CUDA 12.9 toolkit refuses them). What
a device gives (:func:`target_arch`: ``sm_80``..``sm_89``, then ``sm_90a``, ``sm_100a``...) is among them for every
GPU the kernel supports. ``tests/test_cache.py`` compiles for each one."""
_ALIASES = {"sm_90": "sm_90a"}
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("jax_dqpost_cuda_arch", default=None)


def check_arch(arch, what: str | None = None) -> str:
    """``arch`` if the kernel compiles for it (:data:`SUPPORTED_ARCHS`; ``"sm_90"`` gives ``"sm_90a"``), else
    ``ValueError`` (``TypeError`` for a non-string) naming it as ``what`` says (default: its repr)."""
    what = repr(arch) if what is None else what
    if not isinstance(arch, str):
        raise TypeError(f"{what}: a GPU architecture is a string such as 'sm_90a', got {describe(arch)}")
    arch = _ALIASES.get(arch, arch)
    if arch not in SUPPORTED_ARCHS:
        aliases = ", ".join(f"{k!r} means {v!r}" for k, v in _ALIASES.items())
        raise ValueError(f"{what} is not a GPU architecture the kernel compiles for; the accepted names are "
                         f"{', '.join(SUPPORTED_ARCHS)} ({aliases})")
    return arch


@contextlib.contextmanager
def cuda_arch(arch: str):
    """Compile the kernel for ``arch`` (e.g. ``"sm_90a"``) while lowering for CUDA inside this block, whatever
    GPU (if any) this machine has: for ``jax.export`` on a machine without a GPU, or for another GPU.

    Precedence: this context, then the ``CUTE_DSL_ARCH`` environment variable, then the first CUDA device.
    ``arch`` must be a name the kernel compiles for: ``"sm_80"``, ``"sm_86"``..., ``"sm_90a"`` (``"sm_90"`` means
    it), ``"sm_100a"``...; ``ValueError`` otherwise, listing every one.
    """
    token = _override.set(check_arch(arch, f"arch={arch!r}"))
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


def gpu_family() -> int:
    """The compute capability's major of the first CUDA device JAX sees (9: Hopper), 0 without one."""
    devices = cuda_devices()
    return int(str(devices[0].compute_capability).split(".")[0]) if devices else 0


def target_arch() -> str:
    """The GPU architecture to compile for (see the module docstring); ``RuntimeError`` if nothing names one,
    ``ValueError`` if what names it is not in :data:`SUPPORTED_ARCHS`."""
    chosen = _override.get()
    if chosen is not None:
        return chosen
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return check_arch(env, f"CUTE_DSL_ARCH={env!r}")
    devices = cuda_devices()
    if not devices:
        raise RuntimeError(
            "jax_dqpost: lowering for CUDA without a CUDA device; set CUTE_DSL_ARCH (e.g. CUTE_DSL_ARCH=sm_90a) "
            "or use `with jax_dqpost.cuda_arch('sm_90a'):` to choose the GPU architecture to compile the kernel for"
        )
    major, minor = str(devices[0].compute_capability).split(".")
    derived = f"sm_{major}{minor}{'a' if int(major) >= 9 else ''}"
    return check_arch(derived, f"{derived!r}, the architecture of the first CUDA device ({devices[0].device_kind}),")


def sm_version(arch: str) -> int:
    """``"sm_90a"`` -> 90, ``"sm_100a"`` -> 100, ``"sm_80"`` -> 80."""
    return int("".join(ch for ch in check_arch(arch)[3:] if ch.isdigit()))
