"""Does a device copy of equal bytes take equal time? On the GPU machine, from the repository root:

    python -m benchmarks.copy_probe

For byte counts around the benchmark's sweep sizes (multiples of 2 KiB, 4 KiB and more), a copy of ``N`` bytes
each way timed as the benchmark times it (a CUDA graph of back-to-back ``copy_``: memcpy nodes) and eagerly, and a
copy kernel (``torch.bitwise_or(src, 0, out=dst)``: an elementwise kernel, read N, write N) in a graph.
"""

from __future__ import annotations

import math
import sys

from . import harness
from .cases import ROTATE_BYTES


def main() -> int:
    import torch

    sizes = [(1 << 20) + 2048, 1 << 20, (1 << 23) + 2048, 1 << 23, (1 << 26) - 2048, 1 << 26, (1 << 26) + 2048,
             (1 << 26) + 4096, (1 << 26) + 8192, (1 << 26) - 4096, (1 << 29) - 2048, 1 << 29, (1 << 29) + 4096]
    for half in sizes:
        words = half // 4
        copies = max(2, min(256, math.ceil(ROTATE_BYTES / (2 * half))))
        src = [torch.randint(0, 1 << 30, (words,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        dst = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(copies)]

        def memcpy(n):
            for i in range(n):
                dst[i % copies].copy_(src[i % copies])

        def kernel(n):
            for i in range(n):
                torch.bitwise_or(src[i % copies], 0, out=dst[i % copies])

        graph, eager = harness.graph_per_call(torch, memcpy, copies, 9)
        kgraph, keager = harness.graph_per_call(torch, kernel, copies, 9)
        tb = lambda t: 2 * half / t / 1e12  # noqa: E731
        print(f"{half:>11d} B each way (mod 4096: {half % 4096:4d})  memcpy graph {graph * 1e6:8.1f} us "
              f"({tb(graph):4.2f} TB/s)  eager {eager * 1e6:8.1f} us ({tb(eager):4.2f})  kernel graph "
              f"{kgraph * 1e6:8.1f} us ({tb(kgraph):4.2f})  eager {keager * 1e6:8.1f} us ({tb(keager):4.2f})",
              flush=True)
        del src, dst
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
