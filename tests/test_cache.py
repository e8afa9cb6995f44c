"""The target-architecture option, the kernel cache (one compiled kernel for every scale, value and shape of a
configuration) and its on-disk entries (compiles for sm_90a without a GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jax_dqpost import DISABLED_CHECKS, AccumLayout, cuda_arch, dq_postprocess
from jax_dqpost._kernel import arch as arch_, cache as kernel_cache
from support import export_dq, export_layout, fake_compile, one_part_kernel

LAYOUT = export_layout()  # FlashAttention-4's sm90 dQ at head dim 128
SMALL_CALL = one_part_kernel(jnp.bfloat16, LAYOUT, 128, shares=4)  # export_dq's kernel: its tiles split (Plan.kernel)


def test_cuda_arch_chooses_the_target_and_validates():
    for arch in ("sm_80", "sm_100a"):
        with cuda_arch(arch):
            text = export_dq().mlir_module()
        assert kernel_cache.get_kernel(SMALL_CALL, arch=arch).fingerprint in text
    with cuda_arch("sm_90"):  # the Hopper kernel needs sm_90a code: sm_90 means sm_90a
        assert arch_.target_arch() == "sm_90a"
        text = export_dq().mlir_module()
    assert kernel_cache.get_kernel(SMALL_CALL, arch="sm_90a").fingerprint in text
    for bad in ("hopper", "sm_75", "sm_90f", "sm_107a", "sm_90a "):
        with pytest.raises(ValueError, match=rf"^arch={bad!r} is not a GPU architecture the kernel compiles for; "
                                             r"the accepted names are sm_80, sm_86, .*sm_90a, .*sm_120a, .*"
                                             r"\('sm_90' means 'sm_90a'\)$"):
            with cuda_arch(bad):
                pass
    with pytest.raises(TypeError, match=r"^arch=90: a GPU architecture is a string such as 'sm_90a', got 90 \(int\)"):
        with cuda_arch(90):
            pass


def test_every_accepted_arch_compiles_and_is_the_dsls():
    """Each name check_arch accepts is an architecture of the CuTe DSL and compiles the kernel's Hopper order (whose
    WGMMA atoms refuse sm_90): nothing accepted fails later, inside the DSL."""
    from cutlass.base_dsl import Arch

    for name in arch_.SUPPORTED_ARCHS:
        assert name in Arch.__members__, name
        kernel = kernel_cache.get_kernel(one_part_kernel(jnp.bfloat16, LAYOUT, 128), arch=name)
        assert kernel.arch == name and kernel.module[:4] == b"\x7fELF"
    assert "sm_90" in Arch.__members__ and arch_.check_arch("sm_90") == "sm_90a"


def test_cute_dsl_arch_and_the_device_are_validated(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90")
    assert arch_.target_arch() == "sm_90a"
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_75")
    with pytest.raises(ValueError, match=r"^CUTE_DSL_ARCH='sm_75' is not a GPU architecture .* sm_80, "):
        arch_.target_arch()
    with pytest.raises(ValueError, match=r"CUTE_DSL_ARCH='sm_75'"):  # lowering for CUDA: before any compile
        export_dq()
    # Without either, the first CUDA device's compute capability names it.
    monkeypatch.delenv("CUTE_DSL_ARCH")
    for capability, want in (("8.0", "sm_80"), ("8.9", "sm_89"), ("9.0", "sm_90a"), ("10.0", "sm_100a"),
                             ("10.3", "sm_103a"), ("11.0", "sm_110a"), ("12.0", "sm_120a"), ("12.1", "sm_121a"),
                             ("7.5", None)):
        device = type("Device", (), dict(compute_capability=capability, device_kind=f"GPU {capability}"))()
        monkeypatch.setattr(arch_, "cuda_devices", lambda: (device,))
        if want is not None:
            assert arch_.target_arch() == want
        else:
            with pytest.raises(ValueError, match=r"^'sm_75', the architecture of the first CUDA device \(GPU 7.5\), "
                                                 r"is not a GPU architecture the kernel compiles for"):
                arch_.target_arch()


_SCRIPT = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp
    from jax_dqpost import AccumLayout
    from jax_dqpost._kernel import cache as c
    from jax_dqpost._kernel.abi import Tiling
    from jax_dqpost._kernel.spec import KernelSpec, TensorKernel
    layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
    k = c.get_kernel(KernelSpec("bf16", (TensorKernel(layout, 128, Tiling.VARLEN),)), arch="sm_90a")
    print(k.fingerprint, "cutlass" in sys.modules)
""")


def _run(cache, n=1):
    env = {**__import__("os").environ, "JAX_DQPOST_CACHE_DIR": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT], cwd="/", text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env)
             for _ in range(n)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    return [o[0].split() for o in outs]


def test_disk_cache_hit_skips_cutlass_and_gives_the_same_module(tmp_path):
    (fp1, imported1), = _run(tmp_path)
    (fp2, imported2), = _run(tmp_path)
    assert imported1 == "True" and imported2 == "False", "the second process should load from disk"
    assert fp1 == fp2
    assert len(list(tmp_path.glob("*.cute"))) == 1 and not list(tmp_path.glob(".tmp-*"))


def test_concurrent_writers(tmp_path):
    results = _run(tmp_path, n=3)  # three processes compile and write the same entry at once
    assert len({fp for fp, _ in results}) == 1
    assert len(list(tmp_path.glob("*.cute"))) == 1 and not list(tmp_path.glob(".tmp-*"))


def test_scale_and_values_do_not_recompile(rng):
    """Scales, values and shapes are run-time arguments of one compiled kernel: new ones reuse it."""
    layout = AccumLayout(90, 64, 256, 1, False, 32)
    f = jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=100, head_dim=128, layout=layout))
    exported = lambda: jax.export.export(f, platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(
        jax.ShapeDtypeStruct(layout.accum_shape(2, 2, 100, 128), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))
    exported()
    n = kernel_cache.cache_size()
    for scale in rng.uniform(0.05, 2.0, 2):  # concrete scales, each lowered for CUDA into its own program
        jax.export.export(jax.jit(lambda a, s=float(scale): dq_postprocess(a, s, seqlen_q=100, head_dim=128,
                                                                           layout=layout)),
                          platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(
            jax.ShapeDtypeStruct(layout.accum_shape(2, 2, 100, 128), jnp.float32))
    # Other shapes of the same binary configuration reuse the compiled kernel.
    jax.export.export(jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=7, head_dim=120, layout=layout)),
                      platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(
        jax.ShapeDtypeStruct(layout.accum_shape(5, 1, 7, 120), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))
    assert kernel_cache.cache_size() == n


@pytest.mark.parametrize("damage", ["truncated", "garbage", "one_byte", "empty", "old_format"])
def test_a_damaged_entry_is_recompiled_and_rewritten_with_one_warning(tmp_path, monkeypatch, rng, damage):
    """Every read verifies the entry against its sha256: a damaged entry never reaches a module (or an exported
    artifact); it is compiled again and rewritten, then reported by one warning at the caller's line (here: this
    file, also through a jax lowering), so that warnings turned into errors (``python -W error``) cannot stop the
    heal: the exception comes after the rewrite, and the next call is a clean hit."""
    from jax_dqpost._kernel.abi import Tiling

    monkeypatch.setenv("JAX_DQPOST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_cache", {})
    key = one_part_kernel(jnp.bfloat16, LAYOUT, 128, Tiling.VARLEN, shares=4, short_heads=1)  # the small call's below
    good = kernel_cache.get_kernel(key, arch="sm_90a")
    (entry,) = tmp_path.glob("*.cute")
    intact = entry.read_bytes()
    module_at = len(intact) - len(good.module)
    broken = {"truncated": intact[:len(intact) // 2], "garbage": rng.bytes(len(intact)), "empty": b"",
              "one_byte": intact[:module_at + 100] + bytes([intact[module_at + 100] ^ 1]) + intact[module_at + 101:],
              "old_format": good.module}[damage]

    def damaged_again():
        entry.write_bytes(broken)
        monkeypatch.setattr(kernel_cache, "_cache", {})  # a new process: only the disk cache

    damaged_again()
    with pytest.warns(RuntimeWarning, match=r"kernel cache entry .* was damaged") as caught:
        again = kernel_cache.get_kernel(key, arch="sm_90a")
    assert [w.filename for w in caught if "damaged" in str(w.message)] == [__file__]
    assert again.module == good.module and again.fingerprint == good.fingerprint
    assert entry.read_bytes() == intact  # rewritten whole
    monkeypatch.setattr(kernel_cache, "_cache", {})
    assert kernel_cache.get_kernel(key, arch="sm_90a").module == good.module  # a clean hit now, no warning

    damaged_again()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="was damaged"):
            kernel_cache.get_kernel(key, arch="sm_90a")
    assert entry.read_bytes() == intact  # healed, although the warning raised
    monkeypatch.setattr(kernel_cache, "_cache", {})
    assert kernel_cache.get_kernel(key, arch="sm_90a").module == good.module

    damaged_again()  # through jax: the warning points at the line that lowered, not into jax's mlir.py
    acc = jax.ShapeDtypeStruct(LAYOUT.varlen_accum_shape(1, 2, 100, 128), jnp.float32)
    with pytest.warns(RuntimeWarning, match="was damaged") as caught:
        jax.export.export(jax.jit(lambda a: dq_postprocess(a, 1.0, head_dim=128, total_q=100, cu_seqlens_q=[0, 100],
                                                           layout=LAYOUT)),
                          platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(acc)
    assert [w.filename for w in caught if "damaged" in str(w.message)] == [__file__]
    assert entry.read_bytes() == intact


def test_cache_off_and_precompile_cli(tmp_path):
    env = {**__import__("os").environ, "JAX_DQPOST_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "jax_dqpost.precompile", "--arch", "sm_90a", "--presets", "90",
                          "--head-dims", "64,128", "--dtypes", "bf16", "--tilings", "dense,varlen"],
                         cwd="/", env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    # each layout's tiles whole, and split into its finest shares (a small call's kernel: 8, the swapped hd128's 4);
    # hd128's varlen short tiles also by CTAs of one head (a pack of few sequences)
    head = "14 kernels for sm_90a (3 layouts x 1 dtypes x 2 tilings, whole or split tiles, short tiles of 8 heads or 1)"
    assert f"{head}: 14 compiled in " in out.stdout, out.stdout
    assert len(list(tmp_path.glob("*.cute"))) == 14 and len(list(tmp_path.glob("bf16-varlen8-*.cute"))) == 2 \
        and len(list(tmp_path.glob("bf16-varlen4-*.cute"))) == 1
    assert len(list(tmp_path.glob("bf16-varlen*h1-*.cute"))) == 2
    again = subprocess.run([sys.executable, "-m", "jax_dqpost.precompile", "--arch", "sm_90a", "--presets", "90",
                            "--head-dims", "128,64", "--dtypes", "bfloat16", "--tilings", "varlen,dense"],
                           cwd="/", env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]  # either spelling of the dtype; nothing left to compile
    assert again.stdout.strip() == f"{head}: all already cached in {tmp_path}", again.stdout
    damaged = sorted(tmp_path.glob("*.cute"))[0]
    damaged.write_bytes(damaged.read_bytes()[:100])
    healed = subprocess.run(again.args, cwd="/", env=env, capture_output=True, text=True, timeout=600)
    assert healed.returncode == 0 and ": 1 compiled in " in healed.stdout and "13 already cached" in healed.stdout
    assert healed.stderr.count(f"the kernel cache entry {damaged} was damaged") == 1, healed.stderr[-2000:]
    # The fused kernels too: hd64 has one (dQ, dK/dV) preset pair, hd128 two (causal or not).
    fused = subprocess.run([sys.executable, "-m", "jax_dqpost.precompile", "--arch", "sm_90a", "--presets", "90",
                            "--head-dims", "64,128", "--dtypes", "bf16", "--tilings", "dense", "--fused", "none,f32"],
                           cwd="/", env=env, capture_output=True, text=True, timeout=600)
    assert fused.returncode == 0, fused.stderr[-2000:]
    assert "6 fused kernels for sm_90a (3 layout pairs x 1 dtypes x 1 tilings x 2 sinks): 6 compiled" in fused.stdout
    assert len(list(tmp_path.glob("bf16-dense-dense-dense-*sm_90a-*.cute"))) == 6
    off = subprocess.run([sys.executable, "-m", "jax_dqpost.precompile", "--arch", "sm_90a"], cwd="/",
                         env={**env, "JAX_DQPOST_CACHE_DIR": "none"}, capture_output=True, text=True, timeout=600)
    assert off.returncode == 1 and "cache is off" in off.stderr


@pytest.mark.parametrize("argv, message", [
    (["--dtypes", "fp32"], "--dtypes: 'fp32': choose from bf16, bfloat16, fp16, f16, float16"),
    (["--dtypes", "float32"], "--dtypes: 'float32': choose from bf16, bfloat16, fp16, f16, float16"),
    (["--presets", "sm90"], "--presets: 'sm90': not an integer"),
    (["--presets", "75"], "--presets: '75': not a GPU architecture; the known ones are 80, 86, 87, 89, 90, 100"),
    (["--presets", "90,99"], "--presets: '99': not a GPU architecture"),
    (["--presets", "86"], "--presets: '86': FlashAttention-4's backward does not run on sm86; it runs on 90, 100"),
    (["--presets", "100", "--head-dims", "200,256"], "--presets 100 with --head-dims 200,256 selects no kernel"),
    (["--arch", "sm_100a", "--head-dims", "256"], r"--arch sm_100a \(its presets\) with --head-dims 256 selects no "
                                                  "kernel"),
    (["--arch", "sm_80"], r"--arch sm_80 has no FlashAttention-4 presets of its own: .* Name the GPUs whose orders "
                          r"to compile for sm_80 with --presets \(e.g. --presets 120"),
    (["--head-dims", "60"], "--head-dims: '60': head_dim must be a positive multiple of 8 and at most 256, got 60"),
    (["--tilings", "dense,sparse"], "--tilings: 'sparse': choose from dense, dense_seqused, varlen"),
    (["--fused", "f64"], "--fused: 'f64': choose from none, f32, bf16, f16"),
    (["--arch", "hopper"], "--arch: 'hopper' is not a GPU architecture the kernel compiles for; the accepted names "
                           "are sm_80, "),
    (["--arch", "sm_75"], r"--arch: 'sm_75' is not a GPU architecture .*\('sm_90' means 'sm_90a'\)\n$"),
])
def test_precompile_argument_errors_exit_2_naming_the_value(argv, message, capsys):
    from jax_dqpost import precompile

    with pytest.raises(SystemExit) as exit_:
        precompile.main(["--arch", "sm_90a", *argv] if argv[0] != "--arch" else argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_precompile_without_a_gpu_or_arch_says_what_to_pass(monkeypatch, capsys):
    from jax_dqpost._kernel import arch
    from jax_dqpost import precompile

    if arch.cuda_devices():
        pytest.skip("this machine has a GPU: its architecture is the default")
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    with pytest.raises(SystemExit) as exit_:
        precompile.main([])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "pass --arch (e.g. --arch sm_90a) or set CUTE_DSL_ARCH" in lines[-1] and "Traceback" not in lines[-1]


def test_precompile_checks_cute_dsl_arch_and_takes_sm_90_for_sm_90a(tmp_path):
    """CUTE_DSL_ARCH naming no architecture the kernel compiles for: a one-line error and status 2, no traceback;
    sm_90 (from --arch or CUTE_DSL_ARCH) compiles for sm_90a."""
    env = {**os.environ, "JAX_DQPOST_CACHE_DIR": str(tmp_path)}
    small = ["--presets", "90", "--head-dims", "64", "--dtypes", "bf16", "--tilings", "dense"]
    run = lambda argv, **extra: subprocess.run([sys.executable, "-m", "jax_dqpost.precompile", *argv], cwd="/",
                                               env={**env, **extra}, capture_output=True, text=True, timeout=600)
    bad = run([], CUTE_DSL_ARCH="sm_75")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert bad.stderr.startswith("usage: "), bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith(
        "python -m jax_dqpost.precompile: error: CUTE_DSL_ARCH='sm_75' is not a GPU architecture the kernel compiles "
        "for; the accepted names are sm_80, "), bad.stderr
    for out in (run(["--arch", "sm_90", *small]), run(small, CUTE_DSL_ARCH="sm_90")):
        assert out.returncode == 0, out.stderr[-2000:]
        assert "2 kernels for sm_90a (1 layouts x 1 dtypes x 1 tilings, whole or split tiles)" in out.stdout
    entries = list(tmp_path.glob("*.cute"))
    assert len(entries) == 2 and all("-sm_90a-" in entry.name for entry in entries), entries


def test_precompile_help_describes_every_option(capsys):
    from jax_dqpost import precompile

    with pytest.raises(SystemExit):
        precompile.main(["--help"])
    text = capsys.readouterr().out
    for option in ("--arch", "--presets", "--head-dims", "--dtypes", "--tilings", "--fused"):
        assert re.search(rf"{option} \S+\s+\S", text), option


def test_cross_compiling_without_a_gpu_leaves_the_default_cache_alone(tmp_path):
    """A CPU-only machine that lowers for CUDA (jax.export) does not write kernels into ~/.cache; a configured
    JAX_DQPOST_CACHE_DIR is written."""
    from jax_dqpost._kernel import arch

    if arch.cuda_devices():
        pytest.skip("this machine has a GPU: kernels for it are cached by default")
    code = ("import jax, jax.numpy as jnp; from jax_dqpost import AccumLayout\n"
            "from jax_dqpost._kernel import arch, cache as kernel_cache\n"
            "from jax_dqpost._kernel.spec import KernelSpec, TensorKernel\n"
            "assert not arch.cuda_devices()\n"
            "layout = AccumLayout.flash_attention(90, 64, causal=False, tensor='dq', version='4.0.0b36')\n"
            "kernel_cache.get_kernel(KernelSpec(jnp.bfloat16, (TensorKernel(layout, 64, 0),)), arch='sm_90a')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_DQPOST_CACHE_DIR", "XDG_CACHE_HOME")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "HOME": str(tmp_path)}, cwd="/",
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not (tmp_path / ".cache").exists()
    configured = tmp_path / "configured"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "HOME": str(tmp_path),
                                                            "JAX_DQPOST_CACHE_DIR": str(configured)},
                         cwd="/", capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and len(list(configured.glob("*.cute"))) == 1, out.stderr[-2000:]


def test_a_disk_entry_is_named_by_every_module_the_kernel_is_made_from():
    """A change to any module the kernel imports (transitively, within the package) changes the entries' names: none
    is missing from ``kernel_cache.KERNEL_SOURCES``."""
    import ast
    from pathlib import Path

    from jax_dqpost._kernel import cache as kernel_cache

    package = Path(kernel_cache.__file__).parents[1]
    seen, todo = set(), ["_kernel/kernel.py"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        folder = Path(name).parent
        for node in ast.walk(ast.parse((package / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                base = folder.parents[node.level - 2] if node.level > 1 else folder
                modules = [node.module] if node.module else [a.name for a in node.names]
                paths = [base.joinpath(*m.split(".")).with_suffix(".py") for m in modules]
                todo += [str(p) for p in paths if (package / p).is_file()]
    assert seen <= set(kernel_cache.KERNEL_SOURCES), sorted(seen - set(kernel_cache.KERNEL_SOURCES))
    assert {"_kernel/kernel.py", "_kernel/schedule.py", "_kernel/tile.py"} <= seen


@pytest.mark.parametrize("value", ["cache", "./cache", "~/cache", "0", "off", "None", "NONE", " none", "false", " "])
def test_the_cache_directory_is_an_absolute_path_or_none(value, tmp_path, monkeypatch):
    """``none`` (that spelling) turns the disk cache off; unset or empty is the default directory; any other value
    that is not an absolute path (relative to each process's working directory, or another spelling of off) is
    refused before anything is made, by an error naming the variable and the value."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("JAX_DQPOST_CACHE_DIR", "none")
    assert kernel_cache.cache_dir() is None
    monkeypatch.setenv("JAX_DQPOST_CACHE_DIR", str(tmp_path / "mine"))
    assert kernel_cache.cache_dir() == tmp_path / "mine"
    for default in ("", None):
        if default is None:
            monkeypatch.delenv("JAX_DQPOST_CACHE_DIR")
        else:
            monkeypatch.setenv("JAX_DQPOST_CACHE_DIR", default)
        assert kernel_cache.cache_dir() == tmp_path / "xdg" / "jax_dqpost"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # the XDG specification: a relative path is ignored
    assert kernel_cache.cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "jax_dqpost"
    monkeypatch.setenv("JAX_DQPOST_CACHE_DIR", value)
    message = (rf"^JAX_DQPOST_CACHE_DIR must be an absolute path, or none to turn the on-disk kernel cache off "
               rf"\(unset or empty: the default directory\), got {re.escape(repr(value))}$")
    with pytest.raises(ValueError, match=message):
        kernel_cache.cache_dir()
    monkeypatch.setattr(kernel_cache, "_cache", {})  # (a kernel in memory needs no disk cache)
    with pytest.raises(ValueError, match=message):  # where the cache is used: lowering for CUDA
        export_dq()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["a file", "under a file", "proc", "entry unreadable", "default"])
def test_a_cache_that_cannot_be_used_is_reported_once(where, tmp_path, monkeypatch):
    """A directory that cannot be made, read or written: the kernel is compiled and not kept, and the first time in
    the process one RuntimeWarning at the user's call names the variable, the path and why (root writes in any
    directory: the directories here are unusable for root too)."""
    from jax_dqpost._kernel.abi import Tiling

    file = tmp_path / "file"
    file.write_text("not a directory")
    directory = {"a file": file, "under a file": file / "cache", "proc": Path(f"/proc/jax_dqpost_test_{os.getpid()}"),
                 "entry unreadable": tmp_path / "cache", "default": file / "jax_dqpost"}[where]
    why = {"a file": "it is not a directory", "proc": "cannot create it: No such file or directory",
           "entry unreadable": r"cannot read bf16-varlen-sm_90a-cu\d+-\w+\.cute: Is a directory"}.get(
        where, "cannot create it: Not a directory")
    named = rf"JAX_DQPOST_CACHE_DIR={re.escape(str(directory))}"
    if where == "default":  # XDG_CACHE_HOME a file
        monkeypatch.delenv("JAX_DQPOST_CACHE_DIR")
        monkeypatch.setenv("XDG_CACHE_HOME", str(file))
        named = rf"the default kernel cache directory {re.escape(str(directory))} \(JAX_DQPOST_CACHE_DIR is unset\)"
    else:
        monkeypatch.setenv("JAX_DQPOST_CACHE_DIR", str(directory))
    monkeypatch.setattr(kernel_cache, "compile_executor", fake_compile)
    monkeypatch.setattr(kernel_cache, "_unusable_reported", False)
    key = one_part_kernel(jnp.bfloat16, LAYOUT, 128, Tiling.VARLEN)
    if where == "entry unreadable":  # a directory where the entry would be: reading it fails, not as a miss
        (directory / kernel_cache._disk_name(kernel_cache._key(key, "sm_90a"))).mkdir(parents=True)
    for name in ("first", "second"):
        monkeypatch.setattr(kernel_cache, "_cache", {})  # a disk lookup each time
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel = kernel_cache.get_kernel(key, arch="sm_90a", persist=True)
        assert kernel.module.startswith(b"\x7fELF module of ")
        if name == "first":
            (w,) = caught
            assert w.category is RuntimeWarning and w.filename == __file__, (w.category, w.filename)
            assert re.fullmatch(rf"jax_dqpost: {named} cannot be used as the kernel cache \({why}\): kernels are "
                                r"compiled but not kept\. Set JAX_DQPOST_CACHE_DIR to a directory this process can "
                                r"write, or to none to turn the cache off", str(w.message)), str(w.message)
        else:
            assert caught == [], [str(w.message) for w in caught]  # once per process
    assert not kernel_cache.on_disk(key, arch="sm_90a") and file.read_text() == "not a directory"


def test_precompile_refuses_a_cache_it_cannot_use(tmp_path, monkeypatch, capsys):
    """precompile's work is the disk cache: a directory it cannot write exits 1 before any compile, a value that
    names no directory exits 2 (as a bad argument), each with one line and no traceback."""
    from jax_dqpost import precompile

    file = tmp_path / "file"
    file.write_text("")
    small = ["--arch", "sm_90a", "--presets", "90", "--head-dims", "64", "--dtypes", "bf16", "--tilings", "dense"]
    monkeypatch.setattr(kernel_cache, "compile_executor", None)  # nothing may be compiled
    monkeypatch.setenv("JAX_DQPOST_CACHE_DIR", str(file / "cache"))
    assert precompile.main(small) == 1
    assert capsys.readouterr().err == (f"python -m jax_dqpost.precompile: error: JAX_DQPOST_CACHE_DIR={file}/cache "
                                       "cannot be used as the kernel cache (cannot create it: Not a directory): "
                                       "nothing would be kept\n")
    monkeypatch.setenv("JAX_DQPOST_CACHE_DIR", "off")
    with pytest.raises(SystemExit) as exit_:
        precompile.main(small)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == ("python -m jax_dqpost.precompile: error: JAX_DQPOST_CACHE_DIR must be an "
                                            "absolute path, or none to turn the on-disk kernel cache off (unset or "
                                            "empty: the default directory), got 'off'"), err
