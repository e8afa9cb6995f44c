"""AccumLayout: validation, value semantics, and its index map against the independent oracle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jax_dqpost import AccumLayout
import oracle


def test_frozen_hashable_and_normalised():
    a = AccumLayout(90, 64, 256, 1, False, 32)
    b = AccumLayout(arch=np.int64(90), tile_m=np.int32(64), num_threads=256, atom_layout=1, swap_ab=np.bool_(False))
    assert a == b and hash(a) == hash(b) and type(b.tile_m) is int and type(b.swap_ab) is bool
    with pytest.raises(Exception):
        a.tile_m = 128
    assert a.accum_shape(2, 3, 100, 120) == (2, 3, 128 * 128)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(arch=70), ValueError, r"AccumLayout.arch=70 is not an accumulator order"),
    (dict(arch=100, tile_m=64, num_threads=128), ValueError, r"AccumLayout.tile_m must be 128 for arch=100, got 64"),
    (dict(arch=100, tile_m=128, num_threads=128, swap_ab=True), ValueError, r"swap_ab must be False for arch=100"),
    (dict(arch=90, two_cta=True), ValueError, r"two_cta=True is a Blackwell \(arch=100\) order, got arch=90"),
    (dict(arch=80, num_threads=100), ValueError, r"multiple of 32 \(whole warps\), at most 1024, for arch=80, got 100"),
    (dict(arch=80, tile_m=40, num_threads=128, atom_layout=4), ValueError, r"tile_m=40 must be a multiple of 64"),
    (dict(arch=None, atom_layout=2), ValueError, r"atom_layout must be 1 for arch=None, got 2"),
    (dict(arch="90"), TypeError, r"AccumLayout.arch must be a Python int, got '90' \(str\)"),
    (dict(tile_m=0), ValueError, r"AccumLayout.tile_m must be >= 1, got 0"),
    (dict(tile_m=60), ValueError, r"AccumLayout.tile_m must be a multiple of 8, got 60"),
    (dict(tile_m=96), ValueError, r"AccumLayout.tile_m=96 must be a multiple of 64"),
    (dict(num_threads=200), ValueError, r"num_threads must be 128, 256, 384 or 512 .* got 200"),
    (dict(num_threads=640), ValueError, r"got 640"),
    (dict(atom_layout=3), ValueError, r"atom_layout=3 must divide the number of warpgroups num_threads/128=2"),
    (dict(swap_ab=1), TypeError, r"AccumLayout.swap_ab must be a bool, got 1"),
    (dict(hdim_multiple_of=12), ValueError, r"hdim_multiple_of must be a multiple of 8 and at most 256, got 12"),
    (dict(tile_m=64.0), TypeError, r"AccumLayout.tile_m must be a Python int, got 64.0 \(float\)"),
    (dict(arch=120), ValueError, r"arch=120 is not an accumulator order.*sm120 backward writes the arch=80 order"),
    (dict(arch=110), ValueError, r"sm110 backward writes the arch=100 order"),
    (dict(hdim_multiple_of=512), ValueError, r"hdim_multiple_of must be a multiple of 8 and at most 256, got 512"),
])
def test_invalid_fields_are_named(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        AccumLayout(**{**dict(arch=90, tile_m=64, num_threads=256, atom_layout=1), **kwargs})


def test_spec_worked_examples():
    i, j = np.arange(64)[:, None], np.arange(128)[None, :]
    a = AccumLayout(90, 64, 256, 1, False, 32).tile_index_map(128)
    assert a[0, 0] == 0 and a[8, 0] == 2 and a[0, 8] == 512 and a[16, 0] == 128 and a[0, 64] == 4096
    assert a[63, 127] == 8191 and a[1, 8] == 528
    np.testing.assert_array_equal(a, 4096 * (j // 64) + 512 * ((j % 64) // 8) + 128 * (i // 16) + 16 * (i % 8)
                                  + 4 * ((j % 8) // 2) + 2 * ((i % 16) // 8) + (j % 2))
    b = AccumLayout(90, 80, 256, 1, True, 32).tile_index_map(128)
    assert (b[0, 0], b[1, 0], b[0, 8], b[1, 8], b[8, 0], b[0, 1], b[0, 64]) == (0, 1, 2, 3, 512, 16, 5120)


CONFIGS = [(tm, nt, a, sw) for tm, nt, a, sw in itertools.product((64, 80, 96, 128, 192), (128, 256, 384, 512),
                                                                     (1, 2, 3, 4), (False, True))
           if (nt // 128) % a == 0]


@pytest.mark.parametrize("tile_m, threads, atom, swap", CONFIGS)
def test_index_map_matches_oracle_for_every_head_dim(tile_m, threads, atom, swap):
    """Every (layout, head_dim) either is a permutation equal to the producer emulation, or both the
    package and the oracle reject it."""
    for mult in (32, 64):
        for head_dim in range(8, 257, 8):
            dr = -(-head_dim // mult) * mult
            want = oracle.hopper_tile_positions(tile_m, dr, threads, atom, swap)
            try:
                layout = AccumLayout(90, tile_m, threads, atom, swap, mult)
                got = layout.tile_index_map(head_dim)
            except ValueError:
                assert want is None, (tile_m, threads, atom, swap, mult, head_dim)
                continue
            assert want is not None
            np.testing.assert_array_equal(got, want)
            assert np.array_equal(np.sort(got.ravel()), np.arange(tile_m * dr))


ALL_ORDERS = [
    (90, 64, 256, 1, False, False), (90, 80, 256, 1, True, False), (90, 128, 256, 2, False, False),
    (80, 64, 128, 4, False, False), (80, 128, 256, 4, False, False), (80, 64, 256, 2, True, False),
    (80, 64, 128, 1, False, False), (100, 128, 128, 1, False, False), (100, 128, 128, 1, False, True),
    (None, 64, 256, 1, False, False), (None, 8, 32, 1, False, False),
]


@pytest.mark.parametrize("arch, tile_m, threads, atom, swap, two_cta", ALL_ORDERS)
def test_every_order_matches_the_producer_emulation(arch, tile_m, threads, atom, swap, two_cta):
    for mult in (32, 64):
        for head_dim in range(8, 257, 8):
            layout = AccumLayout(arch, tile_m, threads, atom, swap, mult, two_cta=two_cta)
            dr = layout.padded_head_dim(head_dim)
            want = oracle.tile_positions(arch, tile_m, dr, threads, atom, swap, two_cta)
            try:
                got = layout.tile_index_map(head_dim)
            except ValueError:
                assert want is None or (tile_m * dr) % (4 * threads), (layout, head_dim)
                continue
            assert want is not None, (layout, head_dim)
            np.testing.assert_array_equal(got, want, err_msg=f"{layout} head_dim={head_dim}")


def test_closed_form_samples_for_other_orders():
    i, j = np.arange(64)[:, None], np.arange(128)[None, :]
    d = AccumLayout(80, 64, 128, 4, False, 32).tile_index_map(128)  # FlashAttention-4 sm120: 4 warps along the rows
    np.testing.assert_array_equal(d, 32 * (i // 16) + 4 * (i % 8) + (j % 8) // 2
                                  + 128 * ((j % 2) + 2 * ((i % 16) // 8) + 4 * (j // 8)))
    one = AccumLayout(100, 128, 128, 1, False, 32).tile_index_map(128)
    assert [one[0, 0], one[0, 3], one[0, 4], one[0, 31], one[0, 32], one[1, 0], one[63, 0], one[127, 127]] == \
        [0, 3, 512, 3587, 4096, 4, 252, 16383]
    two = AccumLayout(100, 128, 128, 1, False, 32, two_cta=True).tile_index_map(128)
    assert [two[0, 63], two[0, 64], two[0, 127], two[1, 64], two[64, 0]] == [7683, 256, 7939, 260, 8192]
    # The tcgen05 layouts do not depend on how many columns the producer reduced at a time.
    for two_cta in (False, True):
        np.testing.assert_array_equal(oracle.tcgen05_tile_positions(128, two_cta, 8),
                                      oracle.tcgen05_tile_positions(128, two_cta, 32))


def test_flash_attention_presets():
    fa = AccumLayout.flash_attention
    assert fa(90, 64) == AccumLayout(90, 128, 256, 2, False, 32)
    assert fa(90, 96) == AccumLayout(90, 64, 128, 1, False, 32)
    assert fa(90, 128) == AccumLayout(90, 80, 256, 1, True, 32)
    assert fa(90, 128, causal=True) == AccumLayout(90, 64, 256, 1, False, 32)
    assert fa(90, 192) == fa(90, 136) == fa(90, 256) == AccumLayout(90, 64, 256, 1, False, 64)
    assert fa(90, 136).padded_head_dim(136) == 192
    assert fa(100, 64) == AccumLayout(100, 128, 128, 1, False, 32)
    assert fa(100, 128) == fa(103, 192) == AccumLayout(100, 128, 128, 1, False, 32, two_cta=True)
    assert fa(120, 256) == AccumLayout(80, 64, 128, 4, False, 32)
    with pytest.raises(ValueError, match="dedicated hd256 kernel"):
        fa(100, 256)
    with pytest.raises(ValueError, match="no dQ postprocess configuration for arch=80"):
        fa(80, 128)
    with pytest.raises(ValueError, match="head_dim must be a positive multiple of 8"):
        fa(90, 100)
    for arch in (90, 100, 120):  # every preset accepts every head dim it is defined for
        for head_dim in range(8, 257, 8):
            if arch == 100 and head_dim > 192:
                continue
            for causal in (False, True):
                fa(arch, head_dim, causal=causal).check_head_dim(head_dim)


def test_presets_match_flash_attention_4():
    """FlashAttention-4 b36's dK/dV configurations (interface.py: _tile_size_bwd_sm90 and the postprocess calls);
    the sm90 entries were also observed in its backward on the H200 (test_fa4_producer.py)."""
    fa = AccumLayout.flash_attention
    sm90 = {64: (128, 256, 2, False, 32), 96: (128, 256, 2, False, 32), 128: (128, 256, 2, False, 32),
            192: (96, 256, 2, True, 64), 256: (48, 256, 1, True, 64)}
    for d, want in sm90.items():
        for causal in (False, True):
            assert fa(90, d, causal, tensor="dkv") == AccumLayout(90, *want)
    for d in (64, 96):
        assert fa(100, d, tensor="dkv") == AccumLayout(100, 128, 128, 1, False, 32)
    for d in (128, 192):
        assert fa(100, d, tensor="dkv") == AccumLayout(100, 128, 128, 1, False, 32, cluster_size=2)
        assert fa(110, d, tensor="dkv").cluster_size == 2
        assert fa(100, d).cluster_size == 1 and fa(100, d).two_cta
    assert fa(120, 256, tensor="dkv") == AccumLayout(80, 64, 128, 4, False, 32)
    with pytest.raises(ValueError, match="dedicated hd256 kernel"):
        fa(100, 256, tensor="dkv")
    with pytest.raises(ValueError, match="tensor must be 'dq' or 'dkv', got 'dk'"):
        fa(90, 128, tensor="dk")
    with pytest.raises(ValueError, match="no dK/dV postprocess configuration for arch=80"):
        fa(80, 128, tensor="dkv")


def test_cluster_size_pads_rows_in_clusters():
    layout = AccumLayout(100, 128, 128, cluster_size=2)
    assert layout.pad_rows == 256 and layout.padded_seqlen(300) == 512 and layout.num_tiles(300) == 3
    assert layout.varlen_accum_shape(2, 1, 100, 64) == (1, 768 * 64)  # round_up(100 + 2*256, 256)
    assert "cluster_size=2" in repr(layout) and "cluster_size" not in repr(AccumLayout())
    for bad, err in ((0, ValueError), (16, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(err, match="AccumLayout.cluster_size"):
            AccumLayout(cluster_size=bad)
