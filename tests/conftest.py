"""Shared test configuration: the run's random seed, one kernel cache for the run, the platforms to run on, the
accumulator layouts the tests cover, and failure reports written as they happen (``JAX_DQPOST_TEST_FAILURES``).

Random inputs: every test draws from its own stream (the ``rng`` fixture; ``seed`` is its integer seed, for a
subprocess), derived from the run's seed and the test's id, so a test gets the same inputs whatever else runs, in
whatever order, on whichever xdist worker. The run's seed is 0 unless ``JAX_DQPOST_TEST_SEED`` says otherwise; the
report's header names it, and a failing test's report says how to replay it.

Kernel cache: the tests that lower for CUDA compile CuTe kernels (also without a GPU, for ``CUTE_DSL_ARCH``). The run
has one on-disk kernel cache: the first pytest process makes it (the xdist controller, or the only process), its
xdist workers use it too (so a kernel is compiled once per run, not once per worker; the cache is safe for
concurrent writers), and it is removed when that process exits. The workers (pyproject's pytest ``addopts``: one per
core, at most ``GPU_WORKERS`` on a GPU machine) start JAX without taking most of a GPU's memory up front, as they
share it. Float32 matrix products are float32 on every platform (jax's ``default_matmul_precision``).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import sys
import tempfile

SEED_ENV = "JAX_DQPOST_TEST_SEED"
_RUN_CACHE_ENV = "JAX_DQPOST_TEST_RUN_CACHE"  # "<pid of the process that made it>:<directory>"


def _run_kernel_cache() -> str:
    """The run's kernel cache directory: the one the parent process made if this is one of its xdist workers (xdist
    starts them as its children after importing this file), else a new one, removed when this process exits (a
    pytest run inside a test makes its own)."""
    owner, _, inherited = os.environ.get(_RUN_CACHE_ENV, "").partition(":")
    if os.environ.get("PYTEST_XDIST_WORKER") and owner == str(os.getppid()) and os.path.isdir(inherited):
        return inherited
    path = tempfile.mkdtemp(prefix="jax_dqpost_test_cache_")
    os.environ[_RUN_CACHE_ENV] = f"{os.getpid()}:{path}"
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


os.environ["JAX_DQPOST_CACHE_DIR"] = _run_kernel_cache()

# xdist workers share a GPU: none takes JAX's default 75% of its memory at start (set before JAX initialises).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Eight CPU devices for the sharding tests (must be set before JAX initialises its CPU backend).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_dqpost import AccumLayout  # noqa: E402
from jax_dqpost._kernel import arch

sys.path.insert(0, os.path.dirname(__file__))  # tests/oracle.py, tests/support.py

HAS_GPU = bool(arch.cuda_devices())
PLATFORMS = ["cpu", "cuda"] if HAS_GPU else ["cpu"]
if not HAS_GPU:
    # Lowering for CUDA without a GPU (export tests) compiles the kernel for this architecture.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# float32 matrix products in float32 on every platform: XLA's default on NVIDIA GPUs since Ampere rounds their
# operands to TF32 (10 mantissa bits), beyond any bound in float32 roundings the tests set. (The package's 'xla'
# attention keeps jax's default, as jax.nn's does; its docstring says so.)
jax.config.update("jax_default_matmul_precision", "highest")

GPU_WORKERS = 8


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's default): one worker per core, at most ``GPU_WORKERS`` where they share a GPU (each
    XLA client keeps the most GPU memory its tests have used, so that more can run an 80 GB GPU out of memory)."""
    cores = os.cpu_count() or 1
    return min(cores, GPU_WORKERS) if HAS_GPU else cores


# ---- the run's seed

def _read_seed() -> int:
    value = os.environ.get(SEED_ENV, "").strip()
    if not value:
        return 0
    try:
        return int(value, 0)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV} must be an integer, got {value!r}") from None


RUN_SEED = _read_seed()


def seed_of(nodeid: str) -> int:
    """The seed of test ``nodeid``'s random stream: from the run's seed and the test's id alone."""
    digest = hashlib.sha256(f"{RUN_SEED}\0{nodeid}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


@pytest.fixture
def seed(request) -> int:
    """This test's seed (``rng`` is ``np.random.default_rng(seed)``): pass it to a subprocess that draws inputs."""
    return seed_of(request.node.nodeid)


@pytest.fixture
def rng(seed):
    """This test's random stream: the same inputs on every run with the same ``JAX_DQPOST_TEST_SEED``."""
    return np.random.default_rng(seed)


def pytest_report_header(config):
    how = f"from {SEED_ENV}" if os.environ.get(SEED_ENV, "").strip() else f"the default; {SEED_ENV} sets another"
    return f"jax_dqpost: random inputs from run seed {RUN_SEED} ({how}), one stream per test id"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        report.sections.append((
            "random inputs", f"run seed {RUN_SEED}, this test's seed {seed_of(item.nodeid)} (from the run seed and "
                             f"its id); replay with: cd {item.config.rootpath} && {SEED_ENV}={RUN_SEED} pytest "
                             f"'{item.nodeid}'"))
    return report


FAILURES_ENV = "JAX_DQPOST_TEST_FAILURES"


def pytest_runtest_logreport(report):
    """With ``JAX_DQPOST_TEST_FAILURES`` naming a file (tests/gpu_check.sh sets it), each failure's report is added
    to it as the test ends, so a run stopped by a time limit before pytest's summary still says why a test failed.
    The process that reports (the xdist controller, or the only one) writes it, once."""
    path = os.environ.get(FAILURES_ENV)
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            inputs = "".join(f"\n{text}" for name, text in report.sections if name == "random inputs")
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}{inputs}\n\n")


# ---- what the tests run on

DTYPES = [jnp.bfloat16, jnp.float16]
"""The output dtypes (parameter ids: ``ids=["bf16", "f16"]``)."""

# FlashAttention's Hopper dQ configurations: (tile_m, num_threads, atom_layout, swap_ab, hdim_multiple_of)
# FlashAttention-4's CuTe DSL backward (flash_attn/cute/interface.py) and C++ FA3's
# (hopper/flash_bwd_launch_template.h), as docs/design.md lists them.
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

# Accumulator orders other than Hopper's, with the head dims each is run with.
OTHER_ORDERS = {
    "sm120": (AccumLayout(80, 64, 128, 4, False, 32), (64, 128, 96, 256)),
    "sm80-swap": (AccumLayout(80, 64, 256, 2, True, 32), (128, 256)),
    "sm80-cxx-hd64": (AccumLayout(80, 128, 256, 4, False, 64), (64, 40)),
    "sm100-1cta": (AccumLayout(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=1), (64, 96, 120)),
    "sm100-2cta": (AccumLayout(100, 128, 128, 1, False, 32, two_cta=True, cluster_size=1), (128, 192, 160)),
    "row-major": (AccumLayout(None, 64, 256, 1, False, 32), (40, 128, 256)),
}

# FlashAttention-4's (dQ, dK/dV) preset pairs the tests run: name -> (GPU arch, causal, head dims). The pair is the
# one AccumLayout.flash_attention picks at the first head dim; the tests run it at each head dim of the tuple, and a
# name ending in -dvN runs dV at head dim N.
FA4_PAIRS = {
    "sm90-hd64": (90, False, (64,)),
    "sm90-hd96": (90, False, (96,)),
    "sm90-hd128": (90, False, (128,)),
    "sm90-hd128-causal": (90, True, (128,)),
    "sm90-hd192-dv128": (90, False, (192, 128)),
    "sm90-hd256": (90, False, (256,)),
    **{name: (arch, False, OTHER_ORDERS[name][1]) for name, arch in (("sm100-1cta", 100), ("sm100-2cta", 100),
                                                                        ("sm120", 120))},
}


def fa4_layouts(arch: int, head_dim: int, causal: bool = False) -> tuple[AccumLayout, AccumLayout]:
    """FlashAttention-4's preset pair on GPU ``arch`` at ``head_dim``: (dQ layout, dK/dV layout)."""
    return tuple(AccumLayout.flash_attention(arch, head_dim, causal=causal, tensor=t, version="4.0.0b36")
                 for t in ("dq", "dkv"))


def fa4_pair(name: str):
    """``FA4_PAIRS[name]`` as (dQ layout, dK/dV layout, head_dim, head_dim_v): its first head dim, and dV's (the
    name's -dvN, else the same)."""
    arch, causal, head_dims = FA4_PAIRS[name]
    head_dim_v = int(name.rsplit("-dv", 1)[1]) if "-dv" in name else head_dims[0]
    return (*fa4_layouts(arch, head_dims[0], causal), head_dims[0], head_dim_v)


def fa_cute_hopper_config(head_dim: int, causal: bool = False):
    """The layout FlashAttention's CuTe DSL backward uses for dQ on Hopper, as a (tile_m, threads, atom,
    swap, mult) tuple, from the package's preset (itself checked against the table in test_layout.py)."""
    p = AccumLayout.flash_attention(90, head_dim, causal=causal, tensor="dq", version="4.0.0b36")
    return (p.tile_m, p.num_threads, p.atom_layout, p.swap_ab, p.hdim_multiple_of)
