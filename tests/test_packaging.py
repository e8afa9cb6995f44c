"""How the package is built and found: a source checkout uses the installed copy's handler library only if it was
built from the same sources, the library carries the XLA FFI API version it was compiled against (checked against
the running jaxlib's), the wheel is for any Python 3, and the build configuration stays as a user needs it."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import jax
import pytest

import jax_dqpost
from jax_dqpost import _ffi

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _installed() -> metadata.Distribution:
    try:
        return metadata.distribution("jax-dqpost")
    except metadata.PackageNotFoundError:
        pytest.skip("jax-dqpost is not installed")


def test_the_installed_wheel_is_for_any_python3():
    """The library uses no Python C API (ctypes loads it): py3-none-<platform>, not cpXY-cpXY."""
    wheel = _installed().read_text("WHEEL")
    tags = re.findall(r"^Tag: (\S+)$", wheel, re.M)
    assert tags and all(t.startswith("py3-none-") and not t.endswith("-any") for t in tags), wheel


def test_the_installed_metadata_is_the_projects():
    dist = _installed()
    assert dist.version == jax_dqpost.__version__  # the dynamic-metadata provider read jax_dqpost/_version.py
    assert dist.metadata["Summary"] == PYPROJECT["project"]["description"]
    assert "flatbuffers" in " ".join(dist.requires or ())  # jax.export's serialize() needs it


def test_the_build_configuration():
    """No deprecated scikit-build-core metadata table (its build warns), a scikit-build-core that reads the
    standard one, and a wheel for any Python 3."""
    assert "metadata" not in PYPROJECT["tool"]["scikit-build"]
    assert [e["field"] for e in PYPROJECT["tool"]["dynamic-metadata"]] == ["version"]
    assert "scikit-build-core>=1.0" in PYPROJECT["build-system"]["requires"]
    assert PYPROJECT["tool"]["scikit-build"]["wheel"]["py-api"] == "py3"


def test_warnings_do_not_fail_a_users_build():
    """A newer compiler's new warnings must not break a user's install: -Werror only on request (CI asks)."""
    cmake = (ROOT / "ffi" / "CMakeLists.txt").read_text()
    assert re.search(r'option\(JAX_DQPOST_WERROR "[^"]*" OFF\)', cmake)
    guarded = "$<$<BOOL:${JAX_DQPOST_WERROR}>:-Werror>"
    assert re.findall(re.escape(guarded) + "|-Werror", cmake) == [guarded]
    assert "SKBUILD_CMAKE_DEFINE=JAX_DQPOST_WERROR=ON" in (ROOT / ".ci" / "run").read_text()
