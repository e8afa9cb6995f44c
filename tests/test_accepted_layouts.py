"""What the API accepts runs on every platform: every layout and head dim that ``AccumLayout.check_head_dim``
accepts (and so ``dq_postprocess`` at trace time) compiles for sm_80, sm_90a and sm_100a, without a warning;
what the kernel cannot run is refused at trace time with the reason. Compiles without a GPU."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dqpost import AccumLayout, dq_postprocess
from jax_dqpost._kernel import cache as kernel_cache, varlen
from jax_dqpost._kernel.spec import KernelSpec, TensorKernel, Tuning
from jax_dqpost.layout.limits import SMEM_LIMIT, store_tiling
from jax_dqpost._kernel.tuning import call_shares
from jax_dqpost.postprocess._primitive.plan import Part, Plan
from jax_dqpost._kernel.abi import Tiling

ARCHS = ("sm_80", "sm_90a", "sm_100a")

# The edges: FlashAttention's presets, the largest tiles that fit, the most registers per thread, the smallest.
EDGES = [
    (AccumLayout.flash_attention(90, 64, causal=False, tensor="dq", version="4.0.0b36"), 64),
    (AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36"), 128),
    (AccumLayout.flash_attention(90, 256, causal=False, tensor="dq", version="4.0.0b36"), 256),
    (AccumLayout.flash_attention(100, 192, causal=False, tensor="dq", version="4.0.0b36"), 192),
    (AccumLayout.flash_attention(120, 96, causal=False, tensor="dq", version="4.0.0b36"), 96),
    (AccumLayout(None, 192, 256, 1, False, 32), 256),  # 96 KiB of shared memory
    (AccumLayout(90, 128, 128, 1, False, 32), 256),  # 256 fp32 registers per thread
    (AccumLayout(90, 192, 128, 1, True, 64), 128),
    (AccumLayout(80, 128, 32, 1, False, 32), 192),
    (AccumLayout(100, 128, 128, 1, False, 32, two_cta=True, cluster_size=1), 256),
    (AccumLayout(None, 32, 32, 1, False, 8), 8), (AccumLayout(None, 128, 32, 1, False, 256), 256),
    # flash-attn-4 4.0.0b36's sm90 tiles of 16-column multiples in rows allocated for 32: non-swapped WGMMA atoms of
    # 48, 80 and 56 columns (dQ), 112 (dK/dV)
    (AccumLayout.flash_attention(90, 40, causal=False, tensor="dq", version="4.0.0b36"), 40),
    (AccumLayout.flash_attention(90, 72, causal=False, tensor="dq", version="4.0.0b36"), 72),
    (AccumLayout.flash_attention(90, 104, causal=True, tensor="dq", version="4.0.0b36"), 104),
    (AccumLayout.flash_attention(90, 112, causal=True, tensor="dkv", version="4.0.0b36"), 112),
    # WGMMA atoms of odd multiples of 8 columns, placed element by element
    (AccumLayout(90, 64, 256, 1, False, 16), 16), (AccumLayout(90, 128, 256, 2, False, 8), 40),
    (AccumLayout(None, 80, 128, 1, False, 32), 72),  # stored by 64 of the 128 threads (128 cannot tile (80, 96))
]
assert all(layout.alloc_hdim_multiple_of == 32 and layout.hdim_multiple_of == 16 for layout, _ in EDGES[-7:-3])
assert [layout.mma_geometry(d)["n_atom"] for layout, d in EDGES[-7:-1]] == [48, 80, 56, 112, 8, 40]
assert store_tiling(EDGES[-1][0], 96) == (16, 4)


def _random_accepted(rng, count):
    """``count`` random (layout, head_dim) pairs the API accepts."""
    out = []
    while len(out) < count:
        arch = [90, 80, 100, None][rng.integers(4)]
        kw = dict(hdim_multiple_of=int(rng.choice([8, 16, 32, 64, 128])))
        if arch == 100:  # tcgen05: 128 rows, one thread per TMEM lane
            kw.update(tile_m=128, num_threads=128, atom_layout=1, swap_ab=False, two_cta=bool(rng.integers(2)),
                      cluster_size=int(rng.choice([1, 2])))
        else:
            threads = int(rng.choice([32, 64, 128, 256, 384, 512]))
            atom = int(rng.choice([1, 2, 3, 4]))
            kw.update(tile_m=8 * int(rng.integers(1, 25)), num_threads=threads,
                      atom_layout=atom if arch in (80, 90) else 1, swap_ab=bool(rng.integers(2)) and arch in (80, 90))
        try:
            layout = AccumLayout(arch, **kw)
            head_dim = 8 * int(rng.integers(1, 33))
            layout.check_head_dim(head_dim)
        except ValueError:
            continue
        out.append((layout, head_dim))
    return out


def compile_all(seed: int, count: int) -> None:
    """Compile the edges and ``count`` random accepted layouts for every target, one tiling each in turn,
    printing each case first (a compile that aborts the process is then named by the last line)."""
    cases = EDGES + _random_accepted(np.random.default_rng(seed), count)
    for k, (layout, head_dim) in enumerate(cases):
        layout.check_head_dim(head_dim)
        tilings = {list(Tiling)[k % len(Tiling)]}
        if varlen.short_rows(layout):
            tilings.add(Tiling.VARLEN)  # the short-tile path
        for tiling, arch in itertools.product(sorted(tilings), ARCHS):
            print(f"compiling {layout} head_dim={head_dim} {tiling.name} {arch}", flush=True)
            dr = layout.padded_head_dim(head_dim)
            # a small call splits its tiles, a pack of few sequences takes one head a short-tile CTA (Plan.kernel)
            one_head = 1 if tiling == Tiling.VARLEN and varlen.short_rows(layout) else varlen.SHORT_HEADS
            for split, heads in itertools.product(call_shares(layout, dr), {varlen.SHORT_HEADS, one_head}):
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # a user sees no warning from compiling
                    spec = KernelSpec(jnp.bfloat16, (TensorKernel(layout, dr, tiling),), tuning=Tuning(split, heads))
                    kernel = kernel_cache.get_kernel(spec, arch=arch)
                assert kernel.module[:4] == b"\x7fELF", (layout, head_dim, arch, split, heads)
    print("compiled", len(cases), "cases", flush=True)


def test_every_accepted_layout_compiles_for_every_target(seed):
    """In a process of its own: a layout the DSL cannot partition aborts the process instead of raising."""
    out = subprocess.run([sys.executable, __file__, str(seed), "10"], capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "JAX_DQPOST_CACHE_DIR": "none"})
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, f"seed {seed}: failed at {lines[-1:]}\n{out.stderr[-3000:]}"
    assert lines[-1] == f"compiled {len(EDGES) + 10} cases"


def test_a_shares_region_holds_its_threads_elements(seed):
    """Where a tile splits between CTAs (``spec.tile_shares``), the rectangle CTA ``w`` converts holds exactly
    the elements of the producer's threads ``w * n .. (w + 1) * n - 1`` by the wgmma fragment's coordinates
    (``fragments.wgmma_coord``, the PTX ISA's map; independent of the owner formula, not of that map), in whole
    16-row blocks of the shared-memory tile that repeat over the tile; FlashAttention-4's
    Hopper dQ presets split down to one warp a CTA, short tiles' orders to a CTA per short tile's row pairs and
    16-column blocks."""
    from jax_dqpost.layout import fragments
    from jax_dqpost._kernel.spec import share_regions, tile_shares

    cases = EDGES + _random_accepted(np.random.default_rng(seed), 200)
    checked = 0
    for layout, head_dim in cases:
        dr = layout.padded_head_dim(head_dim)
        geom = layout.mma_geometry(dr)
        for split in tile_shares(layout, dr):
            (rows, cols), corners = share_regions(layout, dr, split)
            n = layout.num_threads // split
            assert len(corners) == split and n % 32 == 0, (layout, head_dim, split)
            assert rows % 16 == 0 and layout.tile_m % rows == 0 and dr % cols == 0, (layout, head_dim, split)
            for w, (r0, c0) in enumerate(corners):
                tid, r = np.meshgrid(np.arange(w * n, (w + 1) * n), np.arange(geom["regs"]), indexing="ij")
                i, j = fragments.wgmma_coord(tid, r, n_atom=geom["n_atom"], atoms_m=geom["atoms_m"],
                                             swap_ab=layout.swap_ab)
                got = np.zeros((layout.tile_m, dr), bool)
                got[i.ravel(), j.ravel()] = True
                want = np.zeros_like(got)
                want[r0:r0 + rows, c0:c0 + cols] = True
                assert i.size == rows * cols and (got == want).all(), (layout, head_dim, split, w)
            checked += 1
    assert checked >= 10
    for head_dim, causal, want in [(64, False, (2, 4, 8)), (96, False, (2, 4)), (128, True, (2, 4, 8)),
                                   (128, False, (2, 4)), (192, False, (2, 4, 8)), (256, False, (2, 4, 8))]:
        layout = AccumLayout.flash_attention(90, head_dim, causal=causal, tensor="dq", version="4.0.0b36")
        assert tile_shares(layout, head_dim) == want, (head_dim, causal)


def test_small_calls_split_their_tiles():
    """A kernel of one part and no sink whose tiles move fewer than ``tuning.FINE_SHARES_BYTES`` (accumulator and
    output) converts each tile with the finest split of the order; the launch's CTAs count them. A fused or sink
    kernel never splits; a split the order cannot take is refused."""
    from jax_dqpost._kernel.tuning import FINE_SHARES_BYTES

    layout = AccumLayout.flash_attention(90, 128, causal=True, tensor="dq", version="4.0.0b36")  # 64-row tiles
    tile_bytes = 64 * 128 * 6
    assert FINE_SHARES_BYTES // tile_bytes == 426
    dense = Plan((Part(layout, 128, np.dtype(jnp.bfloat16), seqlen=64 * 31),))
    for batch, heads, split in [(1, 13, 8), (1, 14, 1), (2, 7, 1), (2, 6, 8)]:  # 31 tiles a head: 403, 434, 434, 372
        shape = layout.accum_shape(batch, heads, 64 * 31, 128)
        assert dense.kernel([shape]).tuning.shares == split
        assert dense.launch([shape])[1] == batch * split * heads * 31
    work, _ = varlen.WorkList.build(np, [0, 64 * 3, 64 * 8], None, total=64 * 8, layout=layout)
    packed = Plan((Part(layout, 128, np.dtype(jnp.bfloat16), work=work),))
    for heads, split in [(53, 8), (54, 1)]:  # 8 tiles: 424 CTAs, then 432
        shape = (heads, work.padded_total * 128)
        assert packed.kernel([shape]).tuning.shares == split
        assert packed.launch([shape])[1] == split * heads * 8
    swapped = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")  # short tiles
    work, _ = varlen.WorkList.build(np, [0, 245, 400], None, total=400, layout=swapped)  # 3 + 2 long tiles, 1 short
    shape = (3, work.padded_total * 128)
    short = Plan((Part(swapped, 128, np.dtype(jnp.bfloat16), work=work),))
    assert short.kernel([shape]).tuning.shares == 4  # 64 threads a CTA: a short tile's 8 row pairs x 8 blocks
    assert short.kernel([shape]).tuning.short_heads == 1  # few spans: a short-tile CTA per span and head
    assert short.launch([shape])[1] == 4 * 3 + 4 * 3 * 5
    fused = Plan((dense.parts[0],) * 3)
    shape = layout.accum_shape(1, 2, 64 * 31, 128)
    assert fused.kernel([shape] * 3).tuning == Tuning()
    sink = Plan(dense.parts, sink_dtype=np.dtype(np.float32), dsink_dtype=np.dtype(np.float32))
    assert sink.kernel([shape]).tuning.shares == 1
    single = AccumLayout.flash_attention(90, 96, causal=False, tensor="dq", version="4.0.0b36")  # one warpgroup
    small = Plan((Part(single, 96, np.dtype(jnp.bfloat16), seqlen=64),))
    assert small.kernel([single.accum_shape(1, 1, 64, 96)]).tuning.shares == 4
    for tensors, shares, why in [((TensorKernel(single, 96, Tiling.DENSE),), 8, "shares=8"),
                                 ((TensorKernel(swapped, 128, Tiling.VARLEN),), 8, "shares=8"),
                                 ((TensorKernel(layout, 128, Tiling.DENSE),), 3, "shares=3"),
                                 ((TensorKernel(layout, 128, Tiling.DENSE),) * 3, 2, r"3 tensor\(s\)")]:
        with pytest.raises(ValueError, match=why):
            KernelSpec("bf16", tensors, tuning=Tuning(shares))
    with pytest.raises(ValueError, match="1 tensor.s. with a sink"):
        KernelSpec("bf16", (TensorKernel(layout, 128, Tiling.DENSE),), sink=("f32", "f32"), tuning=Tuning(2))
    # short-tile CTAs of one head: only a varlen kernel of its own grid, in an order with short tiles
    one_head = (TensorKernel(swapped, 128, Tiling.VARLEN),)
    assert KernelSpec("bf16", one_head, tuning=Tuning(2, 1)).label == "bf16-varlen2h1"
    for tensors, sink, heads, why in [(one_head, None, 2, "short_heads=2"),
                                      ((TensorKernel(swapped, 128, Tiling.DENSE),), None, 1, "DENSE"),
                                      ((TensorKernel(layout, 128, Tiling.VARLEN),), None, 1, "short_heads=1"),
                                      (one_head * 3, None, 1, r"3 tensor\(s\)"),
                                      (one_head, ("f32", "f32"), 1, "with a sink")]:
        with pytest.raises(ValueError, match=why):
            KernelSpec("bf16", tensors, sink=sink, tuning=Tuning(1, heads))
    with pytest.raises(TypeError, match="a kernel's tuning is a Tuning, got dict"):
        KernelSpec("bf16", one_head, tuning={"shares": 2})


def test_programmatic_dependent_launch_where_the_target_has_it(tmp_path):
    """sm_90 on: the kernel waits for the previous one (``griddepcontrol.wait``, once, first) and lets the next one
    launch (``griddepcontrol.launch_dependents``) from each place a CTA finds its work (a dense tile; a varlen short
    tile and long-tile slot, after the work list's loads; each part of a fused kernel and its sink CTAs); sm_80 has
    neither."""
    from jax_dqpost._kernel.kernel import Postprocess, entry_args
    from jax_dqpost._kernel import abi, arch as arch_

    swapped = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")  # short tiles
    work, _ = varlen.WorkList.build(np, [0, 245, 400], None, total=400, layout=swapped)
    dense = Part(swapped, 128, np.dtype(jnp.bfloat16), seqlen=256)
    f32 = np.dtype(np.float32)
    calls = [(Plan((dense,)), [swapped.accum_shape(1, 2, 256, 128)], 1),
             (Plan((Part(swapped, 128, np.dtype(jnp.bfloat16), work=work),)), [(2, work.padded_total * 128)], 2),
             (Plan((dense,) * 3, sink_dtype=f32, dsink_dtype=f32), [swapped.accum_shape(1, 2, 256, 128)] * 3, 4)]
    for plan, shapes, places in calls:
        spec = plan.kernel(shapes)
        n = len(spec.tensors)
        pointers = [16] * len(abi.pointers(n, spec.sink is not None))  # placeholders: compiled, not run
        args = entry_args(spec.dtype, n, spec.sink, pointers, [1, 1, 1, 8, 1] * n)
        for arch, waits, triggers in [("sm_90a", 1, places), ("sm_80", 0, 0)]:
            kernel = Postprocess(spec, target_sm=arch_.sm_version(arch))
            ptx = kernel_cache._cute_compile(kernel, args, arch, f"--keep-ptx --dump-dir={tmp_path}").__ptx__
            body = ptx[ptx.index(".entry"):]
            got = (body.count("griddepcontrol.wait"), body.count("griddepcontrol.launch_dependents"))
            assert got == (waits, triggers), (spec.label, arch, got)
            if waits:
                assert body.index("griddepcontrol.wait") < body.find("ld.global"), spec.label
            if triggers and spec.tensors[0].tiling == Tiling.VARLEN:  # after the work list's loads
                assert body.index("griddepcontrol.launch_dependents") > body.index("ld.global"), spec.label


def test_short_tile_vectors_follow_the_index_map(rng):
    """The kernel's short-tile path reads rows (2p, 2p + 1), columns 16 j .. 16 j + 15 of a swapped Hopper tile as
    eight 16-byte vectors (``TileConverter.short_vector``): checked against ``tile_index_map`` for every row pair
    and column block of FlashAttention-4's swapped presets and of random accepted swapped layouts."""
    import cutlass

    from jax_dqpost._kernel.tile import TileConverter

    presets = [(AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36"), 128),
               (AccumLayout.flash_attention(90, 192, causal=False, tensor="dkv", version="4.0.0b36"), 192),
               (AccumLayout.flash_attention(90, 256, causal=False, tensor="dkv", version="4.0.0b36"), 256),
               (AccumLayout(90, 192, 128, 1, True, 64), 128)]
    swapped = [c for c in _random_accepted(rng, 400) if varlen.short_rows(c[0])][:12]
    assert len(swapped) >= 4, "too few random swapped layouts"
    for layout, head_dim in presets + swapped:
        dr, f = layout.padded_head_dim(head_dim), layout.tile_index_map(head_dim)
        kernel = TileConverter(cutlass.BFloat16, layout, dr, tiling=Tiling.VARLEN)
        p, j, c, e, o = np.ix_(*map(np.arange, (layout.tile_m // 2, dr // 16, 8, 2, 2)))
        at = np.vectorize(kernel.short_vector)(p, j) + 16 * c + 2 * e + o
        assert np.array_equal(at, f[2 * p + o, 16 * j + 8 * e + c]), layout


@pytest.mark.parametrize("layout, head_dim, reason", [
    (AccumLayout(90, 8, 128, 1, True, 64), 64, "WGMMA tile is 8 wide along N; the kernel's transposed \\(swap_ab\\) "
     "stmatrix stores need a multiple of 16"),
    (AccumLayout(90, 160, 512, 4, True, 64), 128, "WGMMA tile is 40 wide along N"),
    (AccumLayout(80, 192, 384, 3, True, 32), 192, "a power-of-two number of warps, got 12"),
    (AccumLayout(80, 64, 64, 1, True, 32), 64, "swap_ab\\) mma.sync fragment needs atom_layout >= 2"),
    (AccumLayout(None, 80, 32, 1, False, 8), 72, "num_threads=32 cannot store the \\(80, 72\\) dQ tile"),
    (AccumLayout(None, 4096, 128, 1, False, 32), 128, f"1048576 bytes of shared memory .* more than the {SMEM_LIMIT}"),
    (AccumLayout(None, 168, 64, 1, False, 128), 72, "tile_m to be a multiple of 16, got 168"),
    (AccumLayout(90, 72, 128, 1, True, 32), 256, "WGMMA tile is 72 wide along N"),
    (AccumLayout(None, 64, 128, 1, False, 256), 264, "head_dim must be a positive multiple of 8 and at most 256"),
])
def test_what_the_kernel_cannot_run_is_refused_at_trace_time(layout, head_dim, reason):
    acc = jax.ShapeDtypeStruct((1, 1, 4096 * 256), jnp.float32)
    with pytest.raises(ValueError, match=reason):
        jax.eval_shape(lambda a: dq_postprocess(a, 1.0, seqlen_q=8, head_dim=head_dim, layout=layout), acc)
    with pytest.raises(ValueError, match=reason):
        layout.check_head_dim(head_dim)


def test_a_padding_wider_than_any_head_dim_is_refused_on_construction():
    with pytest.raises(ValueError, match=r"hdim_multiple_of must be a power of two from 8 to 256 .*, got 512$"):
        AccumLayout(None, 64, 256, 1, False, 512)


def test_the_index_map_is_defined_where_only_the_kernel_refuses():
    """tile_index_map describes the producer's order; the kernel's own limits do not change it."""
    layout = AccumLayout(90, 8, 128, 1, True, 64)
    f = layout.tile_index_map(64)
    assert np.array_equal(np.sort(f.ravel()), np.arange(8 * 64))


if __name__ == "__main__":
    compile_all(int(sys.argv[1]), int(sys.argv[2]))
