"""A test run leaves nothing behind: the per-process kernel caches the test configuration makes are removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_test_session_removes_its_kernel_cache(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(TESTS / "test_reference_arith.py")], capture_output=True, text=True, timeout=600,
                         cwd=str(TESTS.parent), env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "warning" not in out.stdout.lower(), out.stdout[-2000:]
    assert not list(tmp_path.glob("jax_dqpost_test_cache_*")), list(tmp_path.iterdir())
