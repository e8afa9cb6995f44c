"""On the GPU (skipped without one), the tools around the op: artifacts exported on a CPU machine run in a fresh
process, XLA's CUDA graphs, jax.profiler around calls, and a damaged disk-cache entry healing.
"""

from __future__ import annotations

import importlib.util

import pytest

from conftest import HAS_GPU

pytestmark = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


def _artifact_in_own_process(seed, name, **env) -> dict:
    """tests/artifact_main.py's report: the artifact ``name`` called in a fresh process that imports jax_dqpost
    and lowers nothing of ours (``env``: variables to add)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "artifact_main.py"
    out = subprocess.run([sys.executable, str(script), str(seed), name], capture_output=True, text=True,
                         env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **env}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["dense", "varlen"])
def test_artifact_exported_on_a_cpu_machine_runs_in_a_fresh_process(seed, name):
    """tests/data/exported_*.bin were exported for platforms=["cuda"] on a machine without a GPU
    (tests/data/export_artifacts.py, jax.export + jax_dqpost.cuda_arch("sm_90a")). A fresh process that imports
    jax_dqpost and only deserializes and calls one gets the oracle's bits: the import registered the target."""
    report = _artifact_in_own_process(seed, name)
    assert report["registered_at_import"] and not report["lowered"], report
    assert "error" not in report and report["compared"] > 0, report


def test_artifact_without_a_cute_runtime_names_the_cause_when_called(seed, tmp_path):
    """Where the handler cannot open the CuTe DSL runtime, calling the artifact fails with the cause (the path and
    dlopen's reason), not with XLA's "no handler registered"."""
    missing = tmp_path / "libcute_dsl_runtime.so"
    report = _artifact_in_own_process(seed, "dense", JAX_DQPOST_CUTE_RUNTIME=str(missing))
    assert report["registered_at_import"] and not report["lowered"], report
    assert f"cannot load the CuTe DSL runtime {missing}: dlopen failed" in report.get("error", ""), report


@pytest.mark.parametrize("capturable", [True, False], ids=["default", "JAX_DQPOST_COMMAND_BUFFERS=0"])
def test_cuda_graphs(tmp_path, seed, capturable):
    """Programs that XLA runs with command buffers (CUDA graphs) give bit-exact results, in a straight chain of
    calls and in a lax.fori_loop (tests/command_buffer_main.py, own process). By default XLA records our call into
    its command buffers; with JAX_DQPOST_COMMAND_BUFFERS=0 it launches the call between them."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "command_buffer_main.py"
    env = {k: v for k, v in os.environ.items() if k != "JAX_DQPOST_COMMAND_BUFFERS"}  # the default: unset
    env.update({"XLA_FLAGS": f"--xla_dump_to={tmp_path}", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    if not capturable:
        env["JAX_DQPOST_COMMAND_BUFFERS"] = "0"
    out = subprocess.run([sys.executable, str(script), str(seed), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("chain", "fori_loop", "fused_chain"):
        for file, text in report[name]["thunk_sequences"].items():
            print(f"---- {name}: {file}\n{text[:4000]}")
        assert report[name]["bit_exact"], report
        where = report[name]["hlo_command_buffers"] + report[name]["thunk_command_buffers"]
        if capturable:
            assert where, f"{name}: no command buffer holds our call ({report['xla_flags']})"
        else:
            assert not where, f"{name}: our call was captured into a command buffer: {where}"


def _profiler_main(seed, *args) -> dict:
    """tests/profiler_main.py's report, run in its own process with the package's defaults (our launches captured
    into XLA's command buffers)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "profiler_main.py"
    env = {k: v for k, v in os.environ.items() if k != "JAX_DQPOST_COMMAND_BUFFERS"}
    out = subprocess.run([sys.executable, str(script), str(seed), *args], capture_output=True, text=True,
                         timeout=600, env={**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert out.returncode == 0, f"seed {seed}: " + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_profiler_around_calls(seed):
    """Both ops, static and traced varlen offsets, at a size that crashed under the profiler when the launches were
    captured, and a lax.scan over layers calling the op: each program runs before, inside and after a jax.profiler
    trace with bit-exact results (tests/profiler_main.py, own process)."""
    report = _profiler_main(seed)
    for name in ("dq_static", "dq_traced", "fused_static", "fused_traced", "scan"):
        assert report[name] == [True] * 4, (name, seed, report)


@pytest.mark.skipif(not importlib.util.find_spec("fa4_jax"), reason="needs fa4-jax (pip install '.[fa4-jax]')")
def test_profiler_around_an_attention_step(seed):
    """jax.grad of the 'fa4' attention with sinks, before, inside and after a jax.profiler trace: finite, and each
    run within a bf16 rounding of the first (tests/profiler_main.py attention, own process)."""
    report = _profiler_main(seed, "attention")
    assert report["attention"] == [True] * 4, (seed, report)


_CACHE_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, sys.argv[2])
import oracle
from jax_dqpost import AccumLayout, dq_postprocess
rng = np.random.default_rng(int(sys.argv[1]))
layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
logical = oracle.random_logical(rng, (2, 200, 3, 128))
acc = oracle.build_accumulator(logical, (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab),
                               hdim_multiple_of=layout.hdim_multiple_of, rng=rng)
got = jax.jit(lambda a: dq_postprocess(a, 0.5, seqlen_q=200, head_dim=128, layout=layout))(acc)
print(np.array_equal(np.asarray(got).view(np.uint16), oracle.expected_dq(logical, 0.5, jnp.bfloat16).view(np.uint16)))
"""


def test_a_damaged_cache_entry_heals_on_the_gpu(tmp_path, seed, rng):
    """A process that finds its kernel's disk entry truncated or overwritten compiles the kernel again, rewrites the
    entry, launches the right module (bit-exact) and warns once, at its own line that called the op (line 11 of the
    script); the next process loads the healed entry."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "JAX_DQPOST_CACHE_DIR": str(tmp_path / "cache"), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    tests = str(Path(__file__).parent)

    def run():
        out = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(seed), tests],
                             env=env, capture_output=True, text=True, timeout=600, cwd="/")
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split()[-1] == "True", out.stdout
        return out.stderr

    assert "damaged" not in run()
    (entry,) = (tmp_path / "cache").glob("*.cute")
    intact = entry.read_bytes()
    for broken in (intact[: len(intact) // 3], rng.bytes(len(intact))):  # truncated, overwritten
        entry.write_bytes(broken)
        warned = [line for line in run().splitlines() if "was damaged" in line]
        assert len(warned) == 1 and warned[0].startswith("<string>:11: RuntimeWarning: jax_dqpost: the kernel cache "
                                                         "entry "), warned
        assert entry.read_bytes() == intact
    assert "damaged" not in run()
