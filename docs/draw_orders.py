"""Draw docs/accum_orders.png: for each accumulator order, which producer thread stored each dQ element
of one tile, and where the first thread's values sit. Needs matplotlib (not a package dependency).

    python docs/draw_orders.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jax_dqpost import AccumLayout  # noqa: E402

ORDERS = [
    ("arch=90 Hopper WGMMA\n64 x 128, 2 warpgroups (FA hd128 causal)", AccumLayout(90, 64, 256, 1, False, 32), 128),
    ("arch=90, swap_ab\n80 x 128, 2 warpgroups (FA hd128)", AccumLayout(90, 80, 256, 1, True, 32), 128),
    ("arch=80 mma.sync m16n8k16\n64 x 128, 4 warps (FA sm120)", AccumLayout(80, 64, 128, 4, False, 32), 128),
    ("arch=100 tcgen05, 1-CTA\n128 x 64 (FA sm100 hd64)",
     AccumLayout(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=1), 64),
    ("arch=100 tcgen05, two_cta\n128 x 128 (FA sm100 hd128)",
     AccumLayout(100, 128, 128, 1, False, 32, two_cta=True, cluster_size=1), 128),
    ("arch=None row-major\n64 x 128", AccumLayout(None, 64, 256, 1, False, 32), 128),
]


def writer(layout, f):
    """The producer thread that stored flat position f (how each order's store loop assigns positions)."""
    if layout.arch == 90:
        chunk = f.size // layout.num_warpgroups
        return (f // chunk) * 128 + (f % 512) // 4
    if layout.arch == 80:
        return f % layout.num_threads
    if layout.arch == 100:
        return (f % 512) // 4
    return (f // 4) % layout.num_threads


def main():
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (title, layout, head_dim) in zip(axes.ravel(), ORDERS):
        F = layout.tile_index_map(head_dim)
        thread = writer(layout, F)
        ax.imshow(thread, cmap="twilight", interpolation="nearest", aspect="auto")
        first = np.argwhere(thread == 0)
        ax.scatter(first[:, 1], first[:, 0], s=6, c="black", marker="s", label="thread 0's values")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("column j (head dim)")
        ax.set_ylabel("row i")
    axes[0, 0].legend(loc="lower right", fontsize=8)
    fig.suptitle("Which producer thread stored dQ(i, j) of one accumulator tile (colour = thread id); "
                 "position in the tile: AccumLayout.tile_index_map", fontsize=11)
    fig.tight_layout()
    out = Path(__file__).resolve().with_name("accum_orders.png")
    fig.savefig(out, dpi=80)
    print(out)


if __name__ == "__main__":
    main()
