"""How the package is built and found: a source checkout uses the installed copy's handler library only if it was
built from the same sources, the library carries the XLA FFI API version it was compiled against (checked against
the running jaxlib's), the wheel is for any Python 3 and holds the package alone, and the build configuration stays
as a user needs it."""

from __future__ import annotations

import ctypes
import json
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
from jax_dqpost.postprocess._primitive import ffi as _ffi

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _installed() -> metadata.Distribution:
    try:
        return metadata.distribution("jax-dqpost")
    except metadata.PackageNotFoundError:
        pytest.skip("jax-dqpost is not installed")


def test_a_source_checkout_finds_the_installed_library():
    """Python started in the repository root imports the source tree (no built library there): library_path()
    is then the installed distribution's library, built from the same ffi/dqpost_ffi.cc."""
    _installed()
    env = {k: v for k, v in os.environ.items() if k != "JAX_DQPOST_FFI_LIBRARY"}
    code = "import jax_dqpost, jax_dqpost.postprocess._primitive.ffi as f; print(jax_dqpost.__file__); print(f.library_path())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    imported, library = out.stdout.split("\n")[-3:-1]
    assert Path(imported).resolve().parent == ROOT / "jax_dqpost", imported  # the source tree, as from the root
    assert Path(library).is_file(), library


def test_a_stale_or_missing_install_is_refused(tmp_path, monkeypatch):
    _installed()
    monkeypatch.delenv("JAX_DQPOST_FFI_LIBRARY", raising=False)
    source = ROOT / "ffi" / "dqpost_ffi.cc"
    assert _ffi._installed_library(source).is_file()
    changed = tmp_path / "tree" / "ffi" / "dqpost_ffi.cc"
    changed.parent.mkdir(parents=True)
    changed.write_bytes(source.read_bytes() + b"// edited after the install\n")
    with pytest.raises(RuntimeError, match=r"not built from this tree's dqpost_ffi.cc.*pip install"):
        _ffi._installed_library(changed)
    with pytest.raises(RuntimeError, match="jax-dqpost-elsewhere is not installed"):
        _ffi._installed_library(source, distribution="jax-dqpost-elsewhere")
    monkeypatch.setattr(jax_dqpost._version, "__version__", "0.0.0.dev0")
    with pytest.raises(RuntimeError, match=r"installed jax-dqpost is .*, this tree 0\.0\.0\.dev0"):
        _ffi._installed_library(source)


def test_the_library_was_built_for_the_running_jaxlib_ffi_api():
    """The built handler reports the XLA FFI API of the headers it was compiled with; register() refuses it
    unless the running jaxlib's is compatible (here, on CPU, the same comparison without registering)."""
    lib = ctypes.CDLL(str(_ffi.library_path()))
    handler, runtime = _ffi.ffi_api_version(lib), _ffi.runtime_ffi_api_version()
    assert min(handler) >= 0 and min(runtime) >= 0, (handler, runtime)
    _ffi.check_ffi_api_version(handler, runtime, _ffi.library_path())


def test_register_refuses_a_handler_built_for_a_newer_ffi_api(monkeypatch):
    """register() compares before it registers anything (here against a jaxlib one minor version older)."""
    if _ffi._registered:
        pytest.skip("the handler is registered in this process already")
    major, minor = _ffi.ffi_api_version(ctypes.CDLL(str(_ffi.library_path())))
    older = (major, minor - 1) if minor > 0 else (major - 1, 99)
    monkeypatch.setattr(_ffi, "runtime_ffi_api_version", lambda: older)
    with pytest.raises(RuntimeError, match=rf"compiled against XLA FFI API {major}\.{minor}.*Reinstall"):
        _ffi.register()
    assert not _ffi._registered


@pytest.mark.parametrize("handler, runtime, ok", [
    ((0, 3), (0, 3), True), ((0, 1), (0, 3), True),   # XLA runs handlers built for an older minor
    ((0, 4), (0, 3), False),                          # built for a newer minor than this jaxlib's
    ((1, 0), (0, 9), False), ((0, 3), (1, 3), False),  # another major: another ABI
])
def test_ffi_api_compatibility_rule(handler, runtime, ok):
    if ok:
        _ffi.check_ffi_api_version(handler, runtime, "lib.so")
        return
    want = rf"lib\.so was compiled against XLA FFI API {handler[0]}\.{handler[1]}.*implements " \
           rf"{runtime[0]}\.{runtime[1]}\. Reinstall jax-dqpost against the installed jaxlib.*--no-build-isolation"
    with pytest.raises(RuntimeError, match=want):
        _ffi.check_ffi_api_version(handler, runtime, "lib.so")


def test_the_runtime_ffi_api_version_comes_from_jaxlibs_headers(tmp_path, monkeypatch):
    header = tmp_path / "xla" / "ffi" / "api" / "c_api.h"
    header.parent.mkdir(parents=True)
    header.write_text("// XLA_FFI_API_MAJOR 9 in a comment\n#define XLA_FFI_API_MAJOR 2\n#define XLA_FFI_API_MINOR 17\n")
    monkeypatch.setattr(jax.ffi, "include_dir", lambda: str(tmp_path))
    assert _ffi.runtime_ffi_api_version() == (2, 17)
    header.write_text("#define XLA_FFI_API_MAJOR 2\n")
    with pytest.raises(RuntimeError, match="cannot read the running jaxlib's XLA FFI API version"):
        _ffi.runtime_ffi_api_version()


def test_the_installed_wheel_is_for_any_python3():
    """The library uses no Python C API (ctypes loads it): py3-none-<platform>, not cpXY-cpXY."""
    wheel = _installed().read_text("WHEEL")
    tags = re.findall(r"^Tag: (\S+)$", wheel, re.M)
    assert tags and all(t.startswith("py3-none-") and not t.endswith("-any") for t in tags), wheel


def _editable(dist: metadata.Distribution) -> bool:
    """Whether ``dist`` is an editable install (``pip install -e``; PEP 660's direct_url.json says so)."""
    direct = dist.read_text("direct_url.json")
    return bool(direct) and json.loads(direct).get("dir_info", {}).get("editable", False)


def test_the_wheel_holds_the_package_alone():
    """The installed files are the package jax_dqpost (its modules and subpackages, the handler library and the stamp
    of its source at its top) and its metadata: nothing of the source tree's benchmarks/, tests/ or docs/. An
    editable install (``pip install -e .``) holds the library, its stamp and scikit-build-core's import hook (a .pth
    file and its module), which finds the modules in the source tree."""
    dist = _installed()
    editable = _editable(dist)
    files = [f for f in dist.files if "__pycache__" not in f.parts]
    tops = {f.parts[0] for f in files}
    info = {t for t in tops if t.endswith(".dist-info")}
    hook = {t for t in tops if editable and re.fullmatch(r"_\w*editable\w*\.(py|pth)", t)}
    assert len(info) == 1 and tops - info - hook == {"jax_dqpost"}, sorted(tops)
    assert {Path(t).suffix for t in hook} == ({".py", ".pth"} if editable else set()), sorted(tops)
    package = [f for f in files if f.parts[0] == "jax_dqpost"]
    names, built = {f.name for f in package if len(f.parts) == 2}, {_ffi._LIBRARY_NAME, _ffi._SOURCE_HASH_NAME}
    if editable:
        assert {str(f) for f in package} == {f"jax_dqpost/{name}" for name in built}, sorted(map(str, package))
    else:  # modules at any depth, every folder a package; the library and its stamp at the top
        assert {"__init__.py", *built} <= names, sorted(names)
        assert all(f.suffix == ".py" for f in package if f.name not in built), [str(f) for f in package]
        folders = {f.parent for f in package}
        assert all(folder / "__init__.py" in set(package) for folder in folders), sorted(map(str, folders))


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


def test_the_test_extra_brings_pytest_xdist():
    """``pip install ".[test]"`` brings what the tests run with: pytest-xdist too, with which ``python -m pytest
    tests`` runs one worker per core (pyproject's ``addopts``) and test_hygiene.py a session on two workers sharing
    one kernel cache, which it does not skip."""
    names = [re.match(r"[\w.-]+", r).group(0).lower() for r in PYPROJECT["project"]["optional-dependencies"]["test"]]
    assert "pytest-xdist" in names, names
    assert PYPROJECT["tool"]["pytest"]["ini_options"]["addopts"].split()[:2] == ["-n", "auto"]
    assert "importorskip" not in (ROOT / "tests" / "test_hygiene.py").read_text()


def test_the_license_is_in_the_tree_and_the_metadata():
    """LICENSE holds the Apache License 2.0 as apache.org publishes it (LICENSE-2.0.txt, by its sha256), and
    pyproject declares it as PEP 639 does (an SPDX expression and the file, which the wheel's and the sdist's
    metadata then carry: .ci/run checks the built wheel's)."""
    import hashlib

    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and PYPROJECT["project"]["license-files"] == ["LICENSE"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "auditwheel repair" in ci and "License-Expression: Apache-2.0" in ci and "licenses/LICENSE" in ci


def test_warnings_do_not_fail_a_users_build():
    """A newer compiler's new warnings must not break a user's install: -Werror only on request (CI asks)."""
    cmake = (ROOT / "ffi" / "CMakeLists.txt").read_text()
    assert re.search(r'option\(JAX_DQPOST_WERROR "[^"]*" OFF\)', cmake)
    guarded = "$<$<BOOL:${JAX_DQPOST_WERROR}>:-Werror>"
    assert re.findall(re.escape(guarded) + "|-Werror", cmake) == [guarded]
    assert "SKBUILD_CMAKE_DEFINE=JAX_DQPOST_WERROR=ON" in (ROOT / ".ci" / "run").read_text()
