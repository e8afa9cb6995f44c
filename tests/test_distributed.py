"""Both ops in a jax.distributed program of two processes of four CPU devices each (gloo collectives;
tests/distributed_main.py is each process), sharded over a global (batch, heads) mesh whose batch axis crosses the
processes: dq_postprocess in bf16 and fp16 with and without a learnable sink, and the grouped-query op with one.

Every shard either process holds is checked against this process: dq, dk and dv have the bits of the unsharded op;
dsink, whose batch-sharded all-reduce (one per program, none without a sink) goes between the processes, has the
bits of the same program sharded over the same mesh of this process's eight devices and is within float32
rounding of the float64 sum. Each process holds its own batch row, and the shards of the two cover every result.
Every wait is bounded: a process that fails or hangs fails the test with both processes' stderr, and both are
killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import distributed_main as dm
import jax_dqpost
import oracle
from oracle import assert_same_bits

WORKER = Path(__file__).parent / "distributed_main.py"
DEADLINE_S = 240
CPUS = jax.devices("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    """Four CPU devices and this process's jax_dqpost."""
    paths = [os.path.dirname(os.path.dirname(jax_dqpost.__file__)), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def wait(procs, deadline: float) -> list[int | None]:
    """The exit codes once both processes exit 0, one fails, or the deadline passes (None: still running)."""
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
            return codes
        time.sleep(0.1)
    return [p.poll() for p in procs]


def run_processes(tmp_path: Path, seed: int) -> list[dict]:
    """Both processes' JSON reports, after both exit 0 within DEADLINE_S."""
    port, env, procs = free_port(), worker_env(), []
    try:
        for pid in range(dm.PROCESSES):
            with open(tmp_path / f"{pid}.out", "w") as out, open(tmp_path / f"{pid}.err", "w") as err:
                procs.append(subprocess.Popen([sys.executable, str(WORKER), str(pid), str(port), str(seed),
                                               str(tmp_path)], stdout=out, stderr=err, env=env, start_new_session=True))
        codes = wait(procs, time.monotonic() + DEADLINE_S)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    tails = "".join(f"\n---- process {pid} stderr:\n{(tmp_path / f'{pid}.err').read_text()[-3000:]}"
                    for pid in range(len(procs)))
    killed = f"None: killed, running when the other failed or after {DEADLINE_S} s"
    assert codes == [0] * dm.PROCESSES, f"exit codes {codes} ({killed}){tails}"
    return [report(tmp_path / f"{pid}.out") for pid in range(len(procs))]


def report(stdout: Path) -> dict:
    """A process's JSON report: its last line that is one (gloo prints its connections on stdout too)."""
    return json.loads(next(line for line in reversed(stdout.read_text().splitlines()) if line.startswith("{")))


def written_shards(path: Path):
    """``(case, result, global slices, bits)`` of every shard a process wrote."""
    with np.load(path) as z:
        for key in sorted(k for k in z.files if k.endswith("/index")):
            case, name, _, _ = key.split("/")
            yield case, name, tuple(slice(int(a), int(b)) for a, b in z[key]), z[key.replace("/index", "/bits")]


def one_process(x: dict) -> tuple[dict, dict, dict]:
    """This process's results of every case: unsharded on one device, and over the same mesh of its eight devices
    (with the all-reduces of its programs)."""
    unsharded = {case: dict(zip(names, jax.jit(op)(jax.device_put(x, CPUS[0]))))
                 for case, (op, names) in dm.CASES.items()}
    return unsharded, *dm.results(dm.global_mesh(CPUS[:8]), x)


def check_shard(pid: int, case: str, name: str, where: tuple, got, unsharded, sharded_here, dsink64) -> None:
    """One shard a process wrote against this process's results (``dsink64``: the float64 sum and its scale)."""
    what = f"process {pid}, {case}, {name}{[(s.start, s.stop) for s in where]}"
    if name == "dsink":
        assert_same_bits(got, np.asarray(sharded_here[case][name])[where], f"{what}: one process's sharded program")
        oracle.assert_dsink_close(got, dsink64[0][where], dsink64[1][where], np.float32, what)
    else:
        assert (where[0].start, where[0].stop) == (pid, pid + 1), f"{what}: not the process's batch row"
        assert_same_bits(got, np.asarray(unsharded[case][name])[where], what)


@pytest.mark.skipif(len(CPUS) < 8, reason="needs --xla_force_host_platform_device_count=8")
def test_two_processes_shard_like_one(tmp_path, seed):
    reports = run_processes(tmp_path, seed)
    all_reduces = {case: int("dsink" in names) for case, (_, names) in dm.CASES.items()}
    for pid, got in enumerate(reports):
        assert got == {"process_index": pid, "process_count": 2, "local_devices": 4, "devices": 8,
                       "mesh_row_processes": [[0], [1]], "all_reduces": all_reduces}, got

    x = dm.operands(seed)
    unsharded, sharded_here, all_reduces_here = one_process(x)
    assert all_reduces_here == all_reduces
    dsink64 = oracle.expected_dsink(x["sink"], x["lse"], x["dpsum"])
    covered = {(case, name): np.zeros(v.shape, bool) for case, outs in unsharded.items() for name, v in outs.items()}
    for pid in range(dm.PROCESSES):
        for case, name, where, bits in written_shards(tmp_path / f"process{pid}.npz"):
            got = bits.view(unsharded[case][name].dtype)
            check_shard(pid, case, name, where, got, unsharded, sharded_here, dsink64)
            covered[case, name][where] = True
    for key, mask in covered.items():
        assert mask.all(), f"{key}: {(~mask).sum()} of {mask.size} elements in no process's shards"
