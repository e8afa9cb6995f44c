"""The base install is what the CPU needs: the CuTe DSL (nvidia-cutlass-dsl) and cuda-python come with the
``[cuda12]``/``[cuda13]`` extras (and ``[test]``). Without them ``import jax_dqpost`` and every CPU path work, and a
lowering for CUDA and ``python -m jax_dqpost.precompile`` say in one line which extra to install. Here they are
hidden from fresh processes by a sitecustomize on ``PYTHONPATH`` (``_HIDE``) whose import finder reports them not
installed, as in a venv of a plain ``pip install .``."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jax_dqpost._kernel import cute_runtime

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CUDA_DISTRIBUTIONS = {"nvidia-cutlass-dsl", "cuda-python"}

_HIDE = '''
import importlib.abc, os, sys


class _NotInstalled(importlib.abc.MetaPathFinder):
    """The modules named in $HIDE_MODULES (and those inside them) are not installed."""
    hidden = tuple(os.environ["HIDE_MODULES"].split(","))

    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in self.hidden):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''

_CPU = """
import contextlib, io, json, os, sys
for name in os.environ["HIDE_MODULES"].split(","):  # the hiding works, else this test proves nothing
    try:
        __import__(name)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"{name} is importable")
import jax, jax.numpy as jnp, numpy as np
import jax_dqpost
from jax_dqpost import AccumLayout, dq_accum_from_dq, dq_postprocess, flash_attention_postprocess, precompile

layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
dkv = AccumLayout.flash_attention(90, 128, causal=False, tensor="dkv", version="4.0.0b36")
assert layout.accum_shape(2, 4, 100, 128) == (2, 4, layout.padded_seqlen(100) * 128)
dq = jnp.asarray(np.random.default_rng(0).standard_normal((2, 100, 4, 128)), jnp.bfloat16)
acc = dq_accum_from_dq(dq, 1.0, layout=layout)
f = jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=100, head_dim=128, layout=layout))
assert (f(acc, 1.0) == dq).all()  # the jax.numpy reference, bit for bit
exported = jax.export.deserialize(jax.export.export(f, platforms=["cpu"])(acc, 1.0).serialize())
assert (exported.call(acc, 1.0) == dq).all()  # exported for CPU, serialized, called
kv = jnp.zeros(dkv.accum_shape(2, 2, 64, 128))
g = flash_attention_postprocess(acc, kv, kv, 0.5, head_dim=128, seqlen_q=100, seqlen_k=64, dq_layout=layout,
                                dkv_layout=dkv)
assert g.dq.shape == dq.shape and g.dk.shape == g.dv.shape == (2, 64, 2, 128) and g.dsink is None
with contextlib.redirect_stdout(io.StringIO()) as help_text, contextlib.suppress(SystemExit):
    precompile.main(["--help"])
assert help_text.getvalue().startswith("usage:"), help_text.getvalue()
# cuda-python's modules (cuda.bindings); the namespace `cuda` alone may come with jax's CUDA plugin (cuda.pathfinder)
print(json.dumps({"cutlass": "cutlass" in sys.modules, "cuda": "cuda.bindings" in sys.modules}))

try:  # a lowering for CUDA (what a call on a GPU does), the disk cache empty
    f.trace(jax.ShapeDtypeStruct(acc.shape, jnp.float32), 1.0).lower(lowering_platforms=("cuda",))
except ModuleNotFoundError as e:
    chained, cause = [], e
    while cause is not None:  # the exceptions it was raised from or while handling (jax's stack trace is one)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
        chained += [type(cause).__name__] if isinstance(cause, ImportError) else []
    print(json.dumps({"lowering": str(e), "chained import errors": chained}))
sys.stdout.flush()
print("precompile:", precompile.main(["--presets", "90", "--head-dims", "64", "--dtypes", "bf16"]))
"""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package is missing
        return False


def _names(requirements) -> set[str]:
    return {re.match(r"[\w.-]+", r).group(0).lower() for r in requirements}


def test_the_base_install_brings_neither_the_cute_dsl_nor_cuda_python():
    """pyproject's dependencies: the CPU's; each CUDA extra and [test] (whose CPU tests compile for CUDA) bring both."""
    project = PYPROJECT["project"]
    assert not _names(project["dependencies"]) & CUDA_DISTRIBUTIONS, project["dependencies"]
    for extra in ("cuda12", "cuda13", "test"):
        assert CUDA_DISTRIBUTIONS <= _names(project["optional-dependencies"][extra]), extra


def _run(code: str, hidden, tmp_path: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python from the repository root, with ``hidden`` not installed and the caller's
    ``PYTHONPATH`` after the hiding sitecustomize's folder; CPU only, the kernel cache in ``tmp_path/cache``."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_HIDE)
    (tmp_path / "cache").mkdir(exist_ok=True)
    env = {**os.environ, "HIDE_MODULES": ",".join(hidden), "JAX_PLATFORMS": "cpu", "CUTE_DSL_ARCH": "sm_90a",
           "JAX_DQPOST_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def _message(names: str, module: str) -> str:
    """The one-line error of a missing ``names`` (distributions) found at ``module``, for this machine's driver."""
    driver = cute_runtime.driver_cuda_version()
    line = ('python -m pip install "jax-dqpost[cuda13]" ("jax-dqpost[cuda12]" where the GPU\'s driver runs CUDA 12, '
            'before 580)' if driver is None else
            f'python -m pip install "jax-dqpost[{"cuda13" if driver >= 13000 else "cuda12"}]"')
    return (f"jax_dqpost compiles its CUDA kernels with {names}, not installed here (no module named {module!r}): "
            f"install jax-dqpost's CUDA extra: {line}")


@pytest.mark.parametrize("hidden, names", [
    (("cutlass", "cuda"), "nvidia-cutlass-dsl and cuda-python"),
    (("cutlass",), "nvidia-cutlass-dsl"),
    (("cuda",), "cuda-python"),
], ids=["neither", "no DSL", "no cuda-python"])
def test_without_the_cute_dsl_the_cpu_works_and_cuda_names_the_extra(hidden, names, tmp_path):
    """The import, the jax.numpy reference, an export for CPU, precompile's --help and the layouts run and import
    neither; a CUDA lowering raises one ModuleNotFoundError (no chained ImportError) naming the extra's pip line, and
    precompile prints that line alone with status 1, compiling and keeping nothing."""
    kept = [m for m in cute_runtime.DSL_MODULES if m.split(".")[0] not in hidden]
    if not all(map(_installed, kept)):
        pytest.skip(f"{' and '.join(kept)} not installed here: the case with {'them' if len(kept) > 1 else 'it'} "
                    "cannot be made")
    out = _run(_CPU, hidden, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == '{"cutlass": false, "cuda": false}', lines
    lowering = re.fullmatch(r'\{"lowering": "(.*)", "chained import errors": \[\]\}', lines[1])
    assert lowering, lines
    module = re.search(r"no module named '([\w.]+)'", lowering.group(1)).group(1)
    assert module.split(".")[0] in {h.split(".")[0] for h in hidden}, module
    message = _message(names, module)
    assert lowering.group(1) == message.replace('"', '\\"'), lowering.group(1)
    assert lines[2:] == ["precompile: 1"], lines
    assert out.stderr.strip().splitlines() == [f"python -m jax_dqpost.precompile: error: {message}"], out.stderr
    assert list((tmp_path / "cache").iterdir()) == []


def test_without_the_cute_dsl_an_uncaught_cuda_lowering_ends_in_one_line(tmp_path):
    """What a user sees of the failed lowering: the traceback's last line is the error with the pip line, and no
    ImportError is chained to it (jax's own stack trace of the traced call, raised as its cause, ends in the same
    line)."""
    code = ("import jax, jax.numpy as jnp\nfrom jax_dqpost import AccumLayout, dq_postprocess\n"
            "layout = AccumLayout.flash_attention(90, 64, causal=False, tensor='dq', version='4.0.0b36')\n"
            "f = jax.jit(lambda a: dq_postprocess(a, 1.0, seqlen_q=64, head_dim=64, layout=layout))\n"
            "f.trace(jax.ShapeDtypeStruct(layout.accum_shape(1, 2, 64, 64), jnp.float32))"
            ".lower(lowering_platforms=('cuda',))\n")
    out = _run(code, ("cutlass", "cuda"), tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    message = "ModuleNotFoundError: " + _message("nvidia-cutlass-dsl and cuda-python", "cutlass")
    assert out.stderr.rstrip().splitlines()[-1] == message, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if re.match(r"[\w.]+: ", line)]
    assert errors and all(line.endswith(message) for line in errors), errors
    assert "During handling" not in out.stderr and "No module named" not in out.stderr, out.stderr[-3000:]
