"""A test run leaves nothing behind, and its processes share one kernel cache: the directory the test configuration
makes is used by every xdist worker of the run and removed at its end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

_PROBE = '''
import os

import pytest


@pytest.mark.parametrize("i", range(6))
def test_probe(i):
    with open(os.path.join(os.environ["PROBE_OUT"], f"{i}"), "w") as f:
        f.write(f"{os.getpid()} {os.environ['JAX_DQPOST_CACHE_DIR']}")
'''


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist"])
def test_a_test_session_shares_one_kernel_cache_and_removes_it(tmp_path, workers):
    """(pytest-xdist, which runs the workers, is in the package's [test] extra: the xdist case never skips.)"""
    tests, out, tmp = tmp_path / "tests", tmp_path / "out", tmp_path / "tmp"
    for d in (tests, out, tmp):
        d.mkdir()
    shutil.copy(TESTS / "conftest.py", tests)
    (tests / "test_probe.py").write_text(_PROBE)
    env = {**os.environ, "TMPDIR": str(tmp), "PROBE_OUT": str(out)}
    args = ["-n", str(workers)] if workers else []
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tests)],
                         capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "warning" not in run.stdout.lower(), run.stdout[-2000:]
    seen = [f.read_text().split() for f in sorted(out.iterdir())]
    assert len(seen) == 6
    assert len({pid for pid, _ in seen}) == (workers or 1), seen  # (every worker ran some)
    (cache,) = {path for _, path in seen}  # one directory for every process of the run
    assert Path(cache).parent == tmp and Path(cache).name.startswith("jax_dqpost_test_cache_"), cache
    assert not Path(cache).exists() and not list(tmp.glob("jax_dqpost_test_cache_*")), list(tmp.iterdir())
