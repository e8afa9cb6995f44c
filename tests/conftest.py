"""Shared test fixtures: platforms to run on, fresh random generators, FlashAttention configurations."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

# A fresh on-disk kernel cache per test process (every compile test compiles; test_cache.py tests the cache),
# removed when the process exits.
_CACHE = tempfile.mkdtemp(prefix="jax_dqpost_test_cache_")
os.environ["JAX_DQPOST_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# Eight CPU devices for the sharding tests (must be set before JAX initialises its CPU backend).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_dqpost import arch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # tests/oracle.py

HAS_GPU = bool(arch.cuda_devices())
PLATFORMS = ["cpu", "cuda"] if HAS_GPU else ["cpu"]
if not HAS_GPU:
    # Lowering for CUDA without a GPU (export tests) compiles the kernel for this architecture.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# FlashAttention's Hopper dQ configurations: (tile_m, num_threads, atom_layout, swap_ab, hdim_multiple_of)
# FlashAttention-4's CuTe DSL backward (flash_attn/cute/interface.py) and C++ FA3's (hopper/flash_bwd_launch_template.h),
# as docs/design.md lists them.
FA_HOPPER_CONFIGS = {
    "cute-hd64": (128, 256, 2, False, 32),
    "cute-hd96-single-wg": (64, 128, 1, False, 32),
    "cute-hd128-causal": (64, 256, 1, False, 32),
    "cute-hd128": (80, 256, 1, True, 32),
    "cute-hd192": (64, 256, 1, False, 64),
    "cute-hd256": (64, 256, 1, False, 64),
    "cxx-hd64-softcap": (96, 256, 2, True, 64),
    "cxx-hd96": (64, 256, 1, False, 32),
    "cxx-hd192-3wg": (64, 384, 1, False, 64),
    "cxx-hd256-swap": (64, 256, 1, True, 64),
}
FA_HOPPER_HEAD_DIM = {"cute-hd64": 64, "cute-hd96-single-wg": 96, "cute-hd128-causal": 128, "cute-hd128": 128,
                      "cute-hd192": 192, "cute-hd256": 256, "cxx-hd64-softcap": 64, "cxx-hd96": 96,
                      "cxx-hd192-3wg": 192, "cxx-hd256-swap": 256}


def fa_cute_hopper_config(head_dim: int, causal: bool = False):
    """The layout FlashAttention's CuTe DSL backward uses for dQ on Hopper, as a (tile_m, threads, atom,
    swap, mult) tuple, from the package's preset (itself checked against the table in test_layout.py)."""
    from jax_dqpost import AccumLayout

    p = AccumLayout.flash_attention(90, head_dim, causal=causal)
    return (p.tile_m, p.num_threads, p.atom_layout, p.swap_ab, p.hdim_multiple_of)


@pytest.fixture
def rng(request):
    """A fresh generator per test; the seed is printed on failure for reproduction."""
    seed = int.from_bytes(os.urandom(8), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
