"""Where an uncaptured call's microseconds go, on the GPU machine, from the repository root:

    python -m benchmarks.launch_cost

Builds ``launch_cost.cc`` (g++ and the CUDA toolkit's ``cuda.h``) and runs our smallest kernel (the hd128 dQ preset,
one tile) through the CuTe runtime's entry, as the FFI handler calls it, and an empty kernel through
``cuLaunchKernel``: host microseconds per launch of each. Then the benchmark's jitted chain of 200 tiny calls
(``probes.chain_cost``): per call, ours and XLA's own elementwise kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from . import internals, probes


def _cuda_home() -> Path:
    nvcc = shutil.which("nvcc")
    if os.environ.get("CUDA_HOME"):
        return Path(os.environ["CUDA_HOME"])
    if nvcc is None:
        raise SystemExit("launch_cost: needs nvcc (the CUDA toolkit) on PATH, or CUDA_HOME")
    return Path(nvcc).resolve().parents[1]


def main() -> int:
    import jax.numpy as jnp

    from jax_dqpost import AccumLayout

    layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
    S, D = layout.tile_m, 128
    plan = internals.plan([internals.dense_part(layout, D, jnp.bfloat16, S)])
    acc_shape = layout.accum_shape(1, 1, S, D)
    kernel = internals.get_kernel(plan)
    extents, _ = plan.launch([acc_shape])
    sizes = internals.in_entry_order(plan, dict(dq_accum=int(np.prod(acc_shape)) * 4, q_aux=0, scales=4, dq=S * D * 2))
    with tempfile.TemporaryDirectory() as tmp:
        exe, module = Path(tmp) / "launch_cost", Path(tmp) / "module.o"
        module.write_bytes(kernel.module)
        cuda = _cuda_home()
        libs = [p for p in (cuda / "lib64", cuda / "lib64" / "stubs", cuda / "targets" / "x86_64-linux" / "lib")
                if p.is_dir()]
        cmd = ["g++", "-O2", "-std=c++17", str(Path(__file__).with_name("launch_cost.cc")), "-o", str(exe),
               f"-I{cuda / 'include'}", *(f"-L{p}" for p in libs), "-lcuda", "-ldl"]
        subprocess.run(cmd, check=True)
        out = subprocess.run([str(exe), str(internals.cute_runtime_path()), str(module), "20000",
                              *map(str, sizes), "--", *map(str, extents)], capture_output=True, text=True)
        print(out.stdout.strip(), out.stderr.strip()[-2000:])
    chain = probes.chain_cost(15)
    print(json.dumps(chain, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
