"""The target-architecture option and the on-disk kernel cache (compiles for sm_90a without a GPU)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from jax_dqpost import AccumLayout, cuda_arch, dq_postprocess
from jax_dqpost import kernel_cache

LAYOUT = AccumLayout.flash_attention(90, 128)
DISABLED = [jax.export.DisabledSafetyCheck.custom_call("jax_dqpost_postprocess_v1")]


def _export(seqlen=100):
    f = jax.jit(lambda a: dq_postprocess(a, 1.0, seqlen_q=seqlen, head_dim=128, layout=LAYOUT))
    return jax.export.export(f, platforms=["cuda"], disabled_checks=DISABLED)(
        jax.ShapeDtypeStruct(LAYOUT.accum_shape(1, 2, seqlen, 128), jnp.float32))


def test_cuda_arch_chooses_the_target_and_validates():
    for arch in ("sm_80", "sm_100a"):
        with cuda_arch(arch):
            text = _export().mlir_module()
        assert kernel_cache.get_kernel(jnp.bfloat16, LAYOUT, 128, arch=arch).fingerprint in text
    with pytest.raises(ValueError, match=r"GPU architecture must look like 'sm_90a'.*got 'hopper'"):
        with cuda_arch("hopper"):
            pass


_SCRIPT = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp
    from jax_dqpost import AccumLayout, kernel_cache as c
    from jax_dqpost.plan import Tiling
    k = c.get_kernel(jnp.bfloat16, AccumLayout.flash_attention(90, 128), 128, Tiling.VARLEN, arch="sm_90a")
    print(k.fingerprint, "cutlass" in sys.modules)
""")


def _run(cache, n=1):
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT], cwd="/", text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**__import__("os").environ, "JAX_DQPOST_CACHE_DIR": str(cache)})
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


def test_concurrent_writers_and_damaged_entries(tmp_path):
    results = _run(tmp_path, n=3)  # three processes compile and write the same entry at once
    assert len({fp for fp, _ in results}) == 1
    (entry,) = tmp_path.glob("*.cute")
    entry.write_bytes(b"garbage")  # a damaged entry is recompiled and replaced
    (fp, imported), = _run(tmp_path)
    assert fp == results[0][0] and imported == "True" and entry.read_bytes()[:4] == b"\x7fELF"


def test_cache_off_and_precompile_cli(tmp_path):
    env = {**__import__("os").environ, "JAX_DQPOST_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "jax_dqpost.precompile", "--arch", "sm_90a", "--presets", "90",
                          "--head-dims", "64,128", "--dtypes", "bf16", "--tilings", "dense,varlen"],
                         cwd="/", env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "6 kernels for sm_90a (3 layouts x 1 dtypes x 2 tilings)" in out.stdout
    assert len(list(tmp_path.glob("*.cute"))) == 6
    off = subprocess.run([sys.executable, "-m", "jax_dqpost.precompile", "--arch", "sm_90a"], cwd="/",
                         env={**env, "JAX_DQPOST_CACHE_DIR": "none"}, capture_output=True, text=True, timeout=600)
    assert off.returncode == 1 and "cache is off" in off.stderr
