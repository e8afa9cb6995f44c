"""Run a stored jax.export artifact in a process of its own, as a user's program that only deserializes it would:

    python3 tests/artifact_main.py SEED NAME        (NAME: a case of tests/data/exported_manifest.json)

The process imports jax_dqpost and nothing that lowers it, deserializes ``tests/data/exported_NAME.bin`` (exported
for CUDA on a machine without a GPU by tests/data/export_artifacts.py), calls it on random inputs and compares the
bits with the oracle. Prints one JSON object (test_gpu_runtime.py reads it): whether the target was registered
at import, whether anything of ours was lowered, the number of elements compared, or the call's error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402
from support import cu_seqlens  # noqa: E402

import jax_dqpost  # noqa: E402,F401  -- the import alone registers the CUDA target


def run(seed: int, name: str) -> dict:
    data = Path(__file__).resolve().parent / "data"
    manifest = json.loads((data / "exported_manifest.json").read_text())
    case = manifest["cases"][name]
    exported = jax.export.deserialize(bytearray((data / case["file"]).read_bytes()))
    assert exported.platforms == ("cuda",), exported.platforms
    rng = np.random.default_rng(seed)
    tile_m, threads, atom, swap, mult = case["layout"][1:]
    dtype, D, H = jnp.dtype(case["dtype"]), case["head_dim"], case["heads"]
    if case["packing"] == "dense":
        B, S = case["batch"], case["seqlen"]
        logical = oracle.random_logical(rng, (B, S, H, D))
        acc = oracle.build_accumulator(logical, (tile_m, threads, atom, swap), hdim_multiple_of=mult, rng=rng)
        scale = np.float32(rng.uniform(0.05, 2.0))
        args, want = (acc, scale), oracle.expected_dq(logical, scale, dtype)
    else:
        B, T = case["batch"], case["total_q"]
        lengths = rng.integers(0, 2 * T // B, B)
        cu = cu_seqlens(lengths)
        used = np.array([rng.integers(0, n + 1) for n in lengths], np.int32)
        acc, want = oracle.build_varlen(rng, cu.tolist(), used.tolist(), T, H, D, (tile_m, threads, atom, swap),
                                        hdim_multiple_of=mult, scale=case["scale"], dtype=dtype)
        args = (acc, cu, used)
    report = {"registered_at_import": jax_dqpost.postprocess._primitive.ffi._registered}
    try:
        got = exported.call(*args)
        oracle.assert_same_bits(got, want, f"artifact {name} exported on {manifest['exported_on']}")
        report["compared"] = int(np.size(want))
    except Exception as e:  # noqa: BLE001 -- reported to the test, which says what it expected
        report["error"] = f"{type(e).__name__}: {e}"
    report["lowered"] = "jax_dqpost._kernel.cache" in sys.modules  # a lowering of ours would have imported it
    return report


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1]), sys.argv[2])))
