"""Which CuTe DSL flavour (cu12, cu13) compiles and which runtime the handler loads, the CUDA extras, the cache
keyed by flavour, and the registration at import (all on CPU)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import pytest

from jax_dqpost.postprocess._primitive import ffi as _ffi
from jax_dqpost._kernel import cute_runtime, cache as kernel_cache
from support import export_layout, fake_compile, one_part_kernel

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flavours, driver, chosen", [
    ({12, 13}, 13010, 13), ({12, 13}, 13000, 13), ({12, 13}, 12090, 12), ({12, 13}, 12040, 12),
    ({12}, 13010, 12), ({13}, 13020, 13),
    ({12, 13}, None, 13), ({12}, None, 12),  # no driver (a CPU machine exporting): the newest installed
])
def test_the_flavour_is_the_one_the_dsl_picks_for_the_driver(flavours, driver, chosen):
    assert cute_runtime.choose({n: Path(f"cu{n}") for n in flavours}, driver) == chosen


@pytest.mark.parametrize("flavours, driver, says", [
    ({13}, 12040, ['supports CUDA 12.4', 'nvidia-cutlass-dsl has cu13', 'pip install "jax-dqpost[cuda12]"']),
    ({12, 13}, 11080, ['supports CUDA 11.8', 'has cu12, cu13', 'supports CUDA 12 or newer: update the driver']),
])
def test_no_flavour_for_the_driver_says_so_in_one_error(flavours, driver, says, monkeypatch):
    monkeypatch.setattr(cute_runtime, "jax_cuda_plugins", lambda: "jax-cuda13-plugin 0.11.2")
    with pytest.raises(cute_runtime.NoRuntime) as e:
        cute_runtime.choose({n: Path(f"cu{n}") for n in flavours}, driver)
    message = str(e.value)
    for part in says + ["jax's CUDA plugin: jax-cuda13-plugin 0.11.2"]:
        assert part in message, (part, message)


def _fake_dsl(root: Path, ir: tuple[int, ...], runtimes: tuple[int, ...]) -> Path:
    """A nvidia_cutlass_dsl tree under ``root`` with the compiler modules of ``ir`` and the runtimes of
    ``runtimes``; the path of its ``cutlass/__init__.py``."""
    package = root / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass"
    libs = package / "_mlir" / "_mlir_libs"
    libs.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for n in ir:
        (libs / f"_cutlass_ir.cu{n}.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    for n in runtimes:
        lib = root / "nvidia_cutlass_dsl" / f"cu{n}" / "lib"
        lib.mkdir(parents=True)
        (lib / "libcute_dsl_runtime.so").write_bytes(b"")
    return package / "__init__.py"


@pytest.fixture
def fake_dsl(tmp_path, monkeypatch):
    """Point the flavour lookup at a fake DSL tree (cu12 and cu13 complete, a cu14 without its runtime)."""
    init = _fake_dsl(tmp_path, (12, 13, 14), (12, 13))
    monkeypatch.setattr(cute_runtime.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(origin=str(init)) if name == "cutlass" else None)
    monkeypatch.delitem(sys.modules, cute_runtime._IR_MODULE, raising=False)
    monkeypatch.delenv(cute_runtime.RUNTIME_ENV, raising=False)
    return tmp_path / "nvidia_cutlass_dsl"


def test_the_runtime_is_the_chosen_flavours_and_the_variable_wins(fake_dsl, monkeypatch):
    assert sorted(cute_runtime.installed()) == [12, 13]  # cu14 has no runtime: not a flavour
    for driver, flavour in ((12080, 12), (13000, 13)):
        monkeypatch.setattr(cute_runtime, "driver_cuda_version", lambda driver=driver: driver)
        assert cute_runtime.flavour() == flavour
        assert cute_runtime.runtime_path() == fake_dsl / f"cu{flavour}" / "lib" / "libcute_dsl_runtime.so"
    monkeypatch.setenv(cute_runtime.RUNTIME_ENV, "/opt/my/libcute_dsl_runtime.so")
    assert cute_runtime.runtime_path() == Path("/opt/my/libcute_dsl_runtime.so")


def test_the_flavour_of_a_loaded_dsl_wins(fake_dsl, monkeypatch):
    """Once cutlass has loaded a flavour, that one compiles: the runtime follows it, whatever the driver says."""
    monkeypatch.setattr(cute_runtime, "driver_cuda_version", lambda: 13000)
    loaded = types.ModuleType(cute_runtime._IR_MODULE)
    loaded.__file__ = str(fake_dsl / "dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu12.cpython-312-x.so")
    monkeypatch.setitem(sys.modules, cute_runtime._IR_MODULE, loaded)
    assert cute_runtime.flavour() == 12
    assert cute_runtime.runtime_path().parts[-3] == "cu12"


def test_a_dsl_without_a_complete_flavour_is_reported(tmp_path, monkeypatch):
    init = _fake_dsl(tmp_path, (12,), ())
    monkeypatch.setattr(cute_runtime.importlib.util, "find_spec", lambda name: types.SimpleNamespace(origin=str(init)))
    with pytest.raises(cute_runtime.NoRuntime, match=r"no complete CUDA flavour .*reinstall it: python -m pip"):
        cute_runtime.installed()


def test_the_installed_dsls_flavour_is_the_one_it_loads():
    """On this machine's real DSL: the flavour found without importing cutlass is the one cutlass then loads, and
    its runtime is a file (a fresh process: importing cutlass is process-wide)."""
    code = ("import sys; from jax_dqpost._kernel import cute_runtime as c; before = c.flavour(); "
            "path = c.runtime_path(); "
            "assert 'cutlass' not in sys.modules; import cutlass; print(before, c.flavour(), path.is_file())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != cute_runtime.RUNTIME_ENV})
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, is_file = out.stdout.split()
    assert before == after and is_file == "True", out.stdout


def test_two_flavours_never_share_a_cache_entry(tmp_path, monkeypatch):
    """The same kernel compiled by the cu12 and the cu13 DSL differs: each flavour has its own entries, and one
    never reads the other's."""
    monkeypatch.setenv(kernel_cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(kernel_cache, "compile_executor", fake_compile)
    monkeypatch.setattr(kernel_cache, "_cache", {})
    names, spec = {}, one_part_kernel(jnp.bfloat16, export_layout(), 128)
    for flavour in (12, 13):
        monkeypatch.setattr(cute_runtime, "flavour", lambda flavour=flavour: flavour)
        names[flavour] = kernel_cache._disk_name((spec, "sm_90a"))
        assert not kernel_cache.on_disk(spec, arch="sm_90a"), flavour  # the other flavour's entry is no hit
        kernel_cache.get_kernel(spec, arch="sm_90a")
        assert kernel_cache.on_disk(spec, arch="sm_90a")
        kernel_cache._cache.clear()
    assert "-cu12-" in names[12] and "-cu13-" in names[13], names
    assert sorted(p.name for p in tmp_path.glob("*.cute")) == sorted(names.values())


def test_the_cuda_extras_pick_the_flavour_of_their_driver():
    """pyproject's extras: cuda13 brings jax's CUDA 13 build, the DSL's cu13 flavour and cuda-python; cuda12 jax's
    CUDA 12 build, the DSL's default flavour (cu12) and a cuda-python of CUDA 12 (the DSL refuses bindings 13 under a
    CUDA 12 driver). Read from the installed distribution's metadata, as pip resolves them."""
    from importlib import metadata

    extras: dict[str, list[str]] = {}
    for requirement in metadata.requires("jax-dqpost") or []:
        match = re.search(r';\s*extra\s*==\s*"([^"]+)"', requirement)
        if match:
            extras.setdefault(match.group(1), []).append(requirement.split(";")[0].replace(" ", ""))
    assert sorted(extras["cuda13"]) == ["cuda-python", "jax[cuda13]>=0.10", "nvidia-cutlass-dsl[cu13]>=4.8"], extras
    assert sorted(extras["cuda12"]) == ["cuda-python<13,>=12.8", "jax[cuda12]>=0.10", "nvidia-cutlass-dsl>=4.8"], extras


_IMPORT = """
import json, sys
path = list(sys.path)  # before jax_dqpost and jax import anything
import jax_dqpost, jax
maps = open("/proc/self/maps").read()
print(json.dumps({"library": "libjax_dqpost_ffi" in maps, "registered": jax_dqpost.postprocess._primitive.ffi._registered,
                  "cutlass": "cutlass" in sys.modules, "backends": jax._src.xla_bridge.backends_are_initialized(),
                  "path": path}))
"""


@pytest.mark.parametrize("plugin", [False, True], ids=["no CUDA plugin", "a CUDA plugin"])
def test_import_registers_the_target_only_where_jax_has_a_cuda_plugin(plugin, tmp_path, monkeypatch):
    """``import jax_dqpost`` without jax's CUDA plugin loads no handler library; with one (here a stand-in
    ``jax_plugins.xla_cuda13``, its folder put first on ``PYTHONPATH``) it loads the library and registers the target,
    so that a deserialized artifact finds its handler. Neither imports the CuTe DSL or starts jax's backends. The
    caller's ``PYTHONPATH`` is kept (where the package and the DSL are installed with ``pip --target``, they are
    found through it): a folder of it (``caller``) stays on the child's path, after the stand-in plugin's."""
    if not plugin and _ffi.jax_has_cuda_plugin():
        pytest.skip("jax's CUDA plugin is installed here: the case without one cannot be made")
    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(caller), os.environ.get("PYTHONPATH")])))
    env = dict(os.environ)
    if plugin:
        (tmp_path / "plugin" / "jax_plugins" / "xla_cuda13").mkdir(parents=True)
        (tmp_path / "plugin" / "jax_plugins" / "xla_cuda13" / "__init__.py").write_text("def initialize():\n"
                                                                                          "    pass\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "plugin"), env["PYTHONPATH"]])
    out = subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    path = report.pop("path")
    assert str(caller) in path, path  # the caller's PYTHONPATH is kept
    if plugin:
        assert path.index(str(tmp_path / "plugin")) < path.index(str(caller)), path  # the stand-in's folder first
    assert report == {"library": plugin, "registered": plugin, "cutlass": False, "backends": False}, report


def test_the_handler_opens_the_runtime_at_the_first_need_and_reports_why_not():
    """The handler is given the runtime's path (or why there is none) at registration and opens it when a call
    first needs it; what fails is the error every call returns (here read through the library's own entry, in fresh
    processes: the runtime is process-wide)."""
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); err = ctypes.create_string_buffer(512); "
            "lib.jax_dqpost_set_runtime.argtypes = [ctypes.c_char_p, ctypes.c_char_p]; "
            "lib.jax_dqpost_load_runtime.argtypes = [ctypes.c_char_p, ctypes.c_size_t]; "
            "path = sys.argv[2].encode() or None; lib.jax_dqpost_set_runtime(path, b'no DSL flavour for this driver'); "
            "print(lib.jax_dqpost_load_runtime(err, 512), err.value.decode())")
    library = str(_ffi.library_path())
    for path, says in (("/nonexistent/libcute_dsl_runtime.so", "-1 jax_dqpost: cannot load the CuTe DSL runtime "
                                                               "/nonexistent/libcute_dsl_runtime.so: dlopen failed"),
                       ("", "-1 no DSL flavour for this driver")):
        out = subprocess.run([sys.executable, "-c", code, library, path], capture_output=True, text=True)
        assert out.stdout.startswith(says), (out.stdout, out.stderr)
    lib = ctypes.CDLL(library)
    assert all(hasattr(lib, s) for s in ("jax_dqpost_set_runtime", "jax_dqpost_load_runtime"))


def test_a_loaded_flavour_without_its_runtime_is_reported(fake_dsl, monkeypatch):
    """cutlass may load a flavour whose runtime is not where the wheel puts it (an editable DSL): one error that says
    what to set, not a lookup failure."""
    loaded = types.ModuleType(cute_runtime._IR_MODULE)
    loaded.__file__ = str(fake_dsl / "dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu14.cpython-312-x.so")
    monkeypatch.setitem(sys.modules, cute_runtime._IR_MODULE, loaded)
    with pytest.raises(cute_runtime.NoRuntime, match=r"cu14 build, which has no libcute_dsl_runtime\.so .*set "
                                                      r"JAX_DQPOST_CUTE_RUNTIME"):
        cute_runtime.runtime_path()


def test_precompile_without_a_flavour_for_the_driver_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    from jax_dqpost import precompile

    def no_flavour():
        raise cute_runtime.NoRuntime("jax_dqpost: no installed CuTe DSL flavour runs on this machine's CUDA driver")

    monkeypatch.setattr(cute_runtime, "flavour", no_flavour)
    monkeypatch.setenv(kernel_cache.CACHE_DIR_ENV, str(tmp_path))
    assert precompile.main(["--arch", "sm_90a", "--presets", "90", "--head-dims", "64", "--dtypes", "bf16"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m jax_dqpost.precompile: error: jax_dqpost: no installed CuTe DSL flavour runs on this "
                   "machine's CUDA driver"], err
