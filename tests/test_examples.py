"""The examples the README points to run and check their own results (on CPU here)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_GPU

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FLAX_EXAMPLES = ("flax_attention.py", "gpt_oss_sinks.py")  # the [examples] extra's
# The training examples run the real producer (fa4-jax's backward kernels) where it can run, else the stand-in.
PRODUCER = "producer: fa4-jax" if HAS_GPU and importlib.util.find_spec("fa4_jax") else "producer: stand-in"


def test_quickstart():
    out = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True,
                         cwd="/", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "jax.nn's attention without sinks: True | a large sink takes the softmax: True" in out.stdout, out.stdout


def test_postprocess_quickstart():
    out = subprocess.run([sys.executable, str(EXAMPLES / "postprocess_quickstart.py")], capture_output=True,
                         text=True, cwd="/", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "bit-exact vs numpy: True" in out.stdout


def test_train_step():
    out = subprocess.run([sys.executable, str(EXAMPLES / "train_step.py")], capture_output=True, text=True,
                         cwd="/", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout[-2000:]
    assert "gradient vs plain autodiff" in out.stdout and PRODUCER in out.stdout, out.stdout


IMPLEMENTATION = "implementation: fa4" if PRODUCER == "producer: fa4-jax" else "implementation: xla"


def test_gpt_oss_sinks():
    """gpt-oss's attention with sinks, an nnx model, trains with jax_dqpost.dot_product_attention (FlashAttention-4's
    kernels where fa4-jax runs, else jax.numpy), its gradients checked against float64 formulas."""
    pytest.importorskip("flax", reason="flax is in the package's examples and test extras")
    out = subprocess.run([sys.executable, str(EXAMPLES / "gpt_oss_sinks.py")], capture_output=True, text=True,
                         cwd="/", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout[-2000:]
    assert "attention gradients vs float64 formulas" in out.stdout and IMPLEMENTATION in out.stdout, out.stdout


def test_gqa_postprocess():
    out = subprocess.run([sys.executable, str(EXAMPLES / "gqa_postprocess.py")], capture_output=True, text=True,
                         cwd="/", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout[-2000:]
    assert "dq, dk, dv bit-exact: True" in out.stdout and "dsink vs float64: True" in out.stdout


def test_examples_import_only_what_their_install_brings(tmp_path):
    """The README's plain install brings what every example imports (read from their source; the tests above run
    them) but the flax of flax_attention.py and gpt_oss_sinks.py, which their extra (``[examples]``, named by the
    README and the examples) brings; without flax each says so in one line."""
    import ast
    import tomllib

    root = EXAMPLES.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["examples"] == ["flax>=0.10"] and "jax-dqpost[examples]" in extras["test"], extras
    assert "| `[examples]` | flax | `examples/flax_attention.py`, `examples/gpt_oss_sinks.py` |" in (
        root / "README.md").read_text()
    plain = {"jax", "numpy", "jax_dqpost", "train_step", "sys", "os", "functools", "dataclasses"}
    for example in sorted(EXAMPLES.glob("*.py")):
        tree = ast.parse(example.read_text())
        top = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
               for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
               for a in (n.names if isinstance(n, ast.Import) else [n])}
        assert top - plain <= ({"flax", "optax"} if example.name in FLAX_EXAMPLES else set()), (example, top)
    # Without flax (a site directory where importing it fails): one line naming the extra, exit status 1.
    (tmp_path / "flax").mkdir()
    (tmp_path / "flax" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'flax'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    for name in FLAX_EXAMPLES:
        out = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, cwd="/",
                             timeout=600, env=env)
        assert out.returncode == 1 and out.stderr.strip() == (
            f"examples/{name} needs flax (No module named 'flax'): python -m pip install \".[examples]\""), \
            out.stderr[-2000:]


def test_flax_attention():
    pytest.importorskip("flax", reason="flax is in the package's examples and test extras")
    out = subprocess.run([sys.executable, str(EXAMPLES / "flax_attention.py")], capture_output=True, text=True,
                         cwd="/", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout[-2000:]
    assert "query-kernel gradient vs flax's attention" in out.stdout and IMPLEMENTATION in out.stdout, out.stdout


def test_transformations(tmp_path):
    """Every transformation checked against the plain call; on a machine without a GPU the example's export
    for CUDA leaves the user's cache (~/.cache) alone."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_DQPOST_CACHE_DIR", "XDG_CACHE_HOME")}
    out = subprocess.run([sys.executable, str(EXAMPLES / "transformations.py")], capture_output=True, text=True,
                         cwd="/", timeout=600, env={**env, "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout[-2000:]
    lines = out.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["jit", "vmap", "grad", "export", "sharding", "fori_loop"], lines
    assert all(line.endswith("True") for line in lines), lines
    from jax_dqpost._kernel import arch

    if not arch.cuda_devices():
        assert not (tmp_path / ".cache").exists(), list((tmp_path / ".cache").rglob("*"))


def test_examples_take_their_layouts_from_the_presets():
    """The examples teach what the README recommends: FlashAttention-4's layouts from its presets
    (``AccumLayout.flash_attention``), an accumulator made in JAX with ``AccumLayout.row_major``; never the fields
    spelled by hand."""
    by_hand = {path.name: re.findall(r"AccumLayout\((?!\))[^)]*\)", path.read_text())
               for path in sorted(EXAMPLES.glob("*.py"))}
    assert {name: found for name, found in by_hand.items() if found} == {}
