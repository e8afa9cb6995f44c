"""On the GPU (skipped without one), the tools around the op: artifacts exported on a CPU machine, XLA's CUDA
graphs, jax.profiler around calls, and a damaged disk-cache entry healing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HAS_GPU
import oracle
from oracle import assert_same_bits
from support import cu_seqlens

pytestmark = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


def _manifest():
    import json
    from pathlib import Path

    data = Path(__file__).parent / "data"
    return data, json.loads((data / "exported_manifest.json").read_text())


@pytest.mark.parametrize("name", ["dense", "varlen"])
def test_artifact_exported_on_a_cpu_machine_runs_here(rng, name):
    """tests/data/exported_*.bin were exported for platforms=["cuda"] on a machine without a GPU
    (tests/data/export_artifacts.py, jax.export + jax_dqpost.cuda_arch("sm_90a")): same bits as the oracle here."""
    data, manifest = _manifest()
    case = manifest["cases"][name]
    exported = jax.export.deserialize(bytearray((data / case["file"]).read_bytes()))
    assert exported.platforms == ("cuda",)
    tile_m, threads, atom, swap, mult = case["layout"][1:]
    dtype, D, H = jnp.dtype(case["dtype"]), case["head_dim"], case["heads"]
    if case["packing"] == "dense":
        B, S = case["batch"], case["seqlen"]
        logical = oracle.random_logical(rng, (B, S, H, D))
        acc = oracle.build_accumulator(logical, (tile_m, threads, atom, swap), hdim_multiple_of=mult, rng=rng)
        scale = np.float32(rng.uniform(0.05, 2.0))
        got = exported.call(acc, scale)
        want = oracle.expected_dq(logical, scale, dtype)
    else:
        B, T = case["batch"], case["total_q"]
        lengths = rng.integers(0, 2 * T // B, B)
        cu = cu_seqlens(lengths)
        used = np.array([rng.integers(0, n + 1) for n in lengths], np.int32)
        acc, want = oracle.build_varlen(rng, cu.tolist(), used.tolist(), T, H, D, (tile_m, threads, atom, swap),
                                        hdim_multiple_of=mult, scale=case["scale"], dtype=dtype)
        got = exported.call(acc, cu, used)
    assert_same_bits(got, want, f"artifact {name} exported on {manifest['exported_on']}")


@pytest.mark.parametrize("capturable", [False, True], ids=["default", "JAX_DQPOST_COMMAND_BUFFERS=1"])
def test_cuda_graphs(tmp_path, seed, capturable):
    """Programs that XLA runs with command buffers (CUDA graphs) give bit-exact results, in a straight chain of
    calls and in a lax.fori_loop (tests/command_buffer_main.py, own process). By default XLA launches our call
    between its command buffers; with JAX_DQPOST_COMMAND_BUFFERS=1 it records the call into them."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "command_buffer_main.py"
    env = {k: v for k, v in os.environ.items() if k != "JAX_DQPOST_COMMAND_BUFFERS"}  # the default: unset
    env.update({"XLA_FLAGS": f"--xla_dump_to={tmp_path}", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    if capturable:
        env["JAX_DQPOST_COMMAND_BUFFERS"] = "1"
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
            assert not where, f"{name}: our call was captured into a command buffer by default: {where}"


def test_profiler_around_calls(seed):
    """Both ops, static and traced varlen offsets, at a size that crashes under the profiler when the launches are
    captured: each program runs before, inside and after a jax.profiler trace with bit-exact results
    (tests/profiler_main.py, own process)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "profiler_main.py"
    out = subprocess.run([sys.executable, str(script), str(seed)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert out.returncode == 0, f"seed {seed}: " + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("dq_static", "dq_traced", "fused_static", "fused_traced"):
        assert report[name] == [True] * 4, (name, seed, report)


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
