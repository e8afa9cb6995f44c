"""AccumLayout: validation, value semantics, and its index map against the independent oracle."""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np
import pytest

from jax_dqpost import AccumLayout
import oracle
from support import round_up


def test_frozen_hashable_and_normalised():
    a = AccumLayout(90, 64, 256, 1, False, 32)
    b = AccumLayout(arch=np.int64(90), tile_m=np.int32(64), num_threads=256, atom_layout=1, swap_ab=np.bool_(False),
                    hdim_multiple_of=np.int16(32))
    assert a == b and hash(a) == hash(b) and type(b.tile_m) is int and type(b.swap_ab) is bool
    with pytest.raises(Exception):
        a.tile_m = 128
    assert a.accum_shape(2, 3, 100, 120) == (2, 3, 128 * 128)
    # alloc_hdim_multiple_of: hdim_multiple_of by default, normalised
    assert a.alloc_hdim_multiple_of == 32 and a == AccumLayout(90, 64, 256, 1, False, 32, alloc_hdim_multiple_of=32)
    c = AccumLayout(90, 64, 256, 1, False, np.int64(16), alloc_hdim_multiple_of=np.int32(32))
    assert type(c.alloc_hdim_multiple_of) is int and c == AccumLayout(90, 64, 256, 1, False, 16,
                                                                      alloc_hdim_multiple_of=32)
    assert hash(c) == hash(AccumLayout(90, 64, 256, 1, False, 16, alloc_hdim_multiple_of=32))
    assert c != AccumLayout(90, 64, 256, 1, False, 16) and "alloc_hdim_multiple_of=32" in repr(c)


def test_tiles_of_dr_in_rows_allocated_for_da():
    """``alloc_hdim_multiple_of``: the tiles pad the head dim to Dr, the allocation to Da; the shapes take Da, the
    index map (one tile) Dr."""
    layout = AccumLayout(90, 64, 256, 1, False, 16, alloc_hdim_multiple_of=32)
    for d, dr, da in ((8, 16, 32), (16, 16, 32), (32, 32, 32), (40, 48, 64), (104, 112, 128), (128, 128, 128)):
        assert (layout.padded_head_dim(d), layout.alloc_head_dim(d)) == (dr, da), d
        assert layout.accum_shape(2, 3, 100, d) == (2, 3, 128 * da)
        assert layout.varlen_accum_shape(4, 3, 100, d) == (3, 384 * da)  # round_up(100 + 4 * 64, 64) rows
    assert layout.tile_index_map(104).shape == (64, 112)
    np.testing.assert_array_equal(layout.tile_index_map(104),
                                  AccumLayout(90, 64, 256, 1, False, 16).tile_index_map(104))
    wide = AccumLayout(None, 64, 256, 1, False, 8, alloc_hdim_multiple_of=256)
    assert (wide.padded_head_dim(8), wide.alloc_head_dim(8)) == (8, 256)
    assert wide.accum_shape(1, 1, 1, 16) == (1, 1, 64 * 256)  # (head dim 8: not a whole 16-byte vector per thread)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(arch=70), ValueError, r"AccumLayout.arch=70 is not an accumulator order"),
    (dict(arch=100, tile_m=64, num_threads=128, two_cta=False, cluster_size=1), ValueError,
     r"AccumLayout.tile_m must be 128 for arch=100, got 64"),
    (dict(arch=100, tile_m=128, num_threads=128, swap_ab=True, two_cta=False, cluster_size=1), ValueError,
     r"swap_ab must be False for arch=100"),
    (dict(arch=100, tile_m=128, num_threads=128), TypeError,
     r"AccumLayout\(arch=100\) needs two_cta= and cluster_size=: the tcgen05 orders"),
    (dict(arch=100, tile_m=128, num_threads=128, two_cta=True), TypeError,
     r"AccumLayout\(arch=100\) needs cluster_size=: "),
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
    (dict(hdim_multiple_of=12), ValueError, r"^AccumLayout.hdim_multiple_of must be a power of two from 8 to 256 "
     r"\(8, 16, 32, 64, 128, 256: a producer's tiles pad the head dim to a multiple of one\), got 12$"),
    (dict(hdim_multiple_of=24), ValueError, r"^AccumLayout.hdim_multiple_of must be a power of two .*, got 24$"),
    (dict(arch=None, hdim_multiple_of=24), ValueError, r"^AccumLayout.hdim_multiple_of must be a power of two .*, "
     r"got 24$"),
    (dict(hdim_multiple_of=48), ValueError, r"^AccumLayout.hdim_multiple_of must be a power of two .*, got 48$"),
    (dict(tile_m=64.0), TypeError, r"AccumLayout.tile_m must be a Python int, got 64.0 \(float\)"),
    (dict(arch=120), ValueError, r"arch=120 is not an accumulator order.*sm120 backward writes the arch=80 order"),
    (dict(arch=110), ValueError, r"sm110 backward writes the arch=100 order"),
    (dict(hdim_multiple_of=512), ValueError, r"hdim_multiple_of must be a power of two from 8 to 256 .*, got 512$"),
    (dict(alloc_hdim_multiple_of=48), ValueError, r"^AccumLayout.alloc_hdim_multiple_of must be a multiple of "
     r"hdim_multiple_of=32 \(the allocated row holds the tiles\) and at most 256, got 48$"),
    (dict(alloc_hdim_multiple_of=16), ValueError, r"alloc_hdim_multiple_of must be a multiple of hdim_multiple_of=32 "
     r".* got 16$"),
    (dict(hdim_multiple_of=16, alloc_hdim_multiple_of=24), ValueError, r"alloc_hdim_multiple_of must be a multiple "
     r"of hdim_multiple_of=16 .* got 24$"),
    (dict(hdim_multiple_of=16, alloc_hdim_multiple_of=512), ValueError, r"^AccumLayout.alloc_hdim_multiple_of must "
     r"be .* and at most 256, got 512$"),
    (dict(alloc_hdim_multiple_of=0), ValueError, r"^AccumLayout.alloc_hdim_multiple_of must be >= 1, got 0$"),
    (dict(alloc_hdim_multiple_of=32.0), TypeError, r"^AccumLayout.alloc_hdim_multiple_of must be a Python int, got "
     r"32.0 \(float\)$"),
    (dict(alloc_hdim_multiple_of=True), TypeError, r"AccumLayout.alloc_hdim_multiple_of must be a Python int"),
])
def test_invalid_fields_are_named(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        AccumLayout(**{**dict(arch=90, tile_m=64, num_threads=256, atom_layout=1, swap_ab=False, hdim_multiple_of=32),
                       **kwargs})


def test_no_field_that_picks_an_order_has_a_default():
    """``AccumLayout()`` or ``AccumLayout(90)`` would be some Hopper order chosen silently: every field is required
    (``two_cta`` and ``cluster_size`` where they pick among orders of one shape, arch=100), and the error names the
    missing fields and the two constructors."""
    import inspect

    params = inspect.signature(AccumLayout).parameters
    fields = ("arch", "tile_m", "num_threads", "atom_layout", "swap_ab", "hdim_multiple_of")
    assert all(params[f].default is inspect.Parameter.empty for f in fields), params
    constructors = (r"AccumLayout.flash_attention\(gpu, head_dim, causal=\.\.\., tensor=.*, version=\.\.\.\) "
                    r".*AccumLayout.row_major\(\)")
    for args, missing in (((), "arch=, tile_m=, num_threads=, atom_layout=, swap_ab= and hdim_multiple_of="),
                          ((90,), "tile_m=, num_threads=, atom_layout=, swap_ab= and hdim_multiple_of="),
                          ((90, 64, 256, 1, False), "hdim_multiple_of=")):
        with pytest.raises(TypeError, match=rf"^AccumLayout\(\) needs {missing}: .*{constructors}"):
            AccumLayout(*args)
    with pytest.raises(TypeError, match=r"AccumLayout\(\): too many positional arguments; the signature is "
                                        r"AccumLayout\(arch, tile_m, .* \*, two_cta=None, cluster_size=None, "
                                        r"alloc_hdim_multiple_of=None, varlen_unreadable=None\)"):
        AccumLayout(90, 64, 256, 1, False, 32, False)
    # Where two_cta and cluster_size cannot change the order they may be left out.
    assert AccumLayout(90, 64, 256, 1, False, 32) == AccumLayout(90, 64, 256, 1, False, 32, two_cta=False,
                                                                 cluster_size=1)
    assert AccumLayout.row_major() == AccumLayout(None, 64, 256, 1, False, 32)
    assert AccumLayout.row_major(tile_m=128, cluster_size=2) == AccumLayout(None, 128, 256, 1, False, 32,
                                                                            cluster_size=2)


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
            dr = round_up(head_dim, mult)
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
            layout = AccumLayout(arch, tile_m, threads, atom, swap, mult, two_cta=two_cta, cluster_size=1)
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
    one = AccumLayout(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=1).tile_index_map(128)
    assert [one[0, 0], one[0, 3], one[0, 4], one[0, 31], one[0, 32], one[1, 0], one[63, 0], one[127, 127]] == \
        [0, 3, 512, 3587, 4096, 4, 252, 16383]
    two = AccumLayout(100, 128, 128, 1, False, 32, two_cta=True, cluster_size=1).tile_index_map(128)
    assert [two[0, 63], two[0, 64], two[0, 127], two[1, 64], two[64, 0]] == [7683, 256, 7939, 260, 8192]
    # The tcgen05 layouts do not depend on how many columns the producer reduced at a time.
    for two_cta in (False, True):
        np.testing.assert_array_equal(oracle.tcgen05_tile_positions(128, two_cta, 8),
                                      oracle.tcgen05_tile_positions(128, two_cta, 32))


RELEASE = "4.0.0b36"


def _dq(arch, head_dim, causal=False, version=RELEASE):
    return AccumLayout.flash_attention(arch, head_dim, causal=causal, tensor="dq", version=version)


def _dkv(arch, head_dim, causal=False, version=RELEASE):
    return AccumLayout.flash_attention(arch, head_dim, causal=causal, tensor="dkv", version=version)


# Where 4.0.0b36's sm90 backward tiles the head dim in multiples of 16 inside accumulators allocated in multiples of
# 32 (its tile_hdim is 16 up to head dim 128): the rule, computed here from the release's numbers, not the package's.
B36_SM90_PADDED = tuple(d for d in range(8, 129, 8) if round_up(d, 16) != round_up(d, 32))
B36_SM90_REFUSED = (104, 112)  # non-causal: its swapped (112, 80) dQ MMA does not compile
B36_REFUSAL = (r"^flash-attn-4 4\.0\.0b36's sm90 backward does not run at head_dim={} with causal=False \(.*\): "
               r"there is no accumulator to read \(Dao-AILab/flash-attention PR #2896\)$")


def _order(layout):
    """A preset's order and padding: every field but varlen_unreadable (whether packed accumulators can be read)."""
    return dataclasses.replace(layout, varlen_unreadable=None)


def test_the_orders_gpus_are_the_kernels():
    """The GPU architectures with accumulator orders (``layout/_presets.py``, which imports nothing of the kernel) are
    those the kernel compiles for."""
    from jax_dqpost._kernel.arch import SUPPORTED_ARCHS, sm_version
    from jax_dqpost.layout._presets import GPU_ARCHS

    assert GPU_ARCHS == tuple(sorted({sm_version(a) for a in SUPPORTED_ARCHS}))


def test_flash_attention_presets():
    assert _dq(90, 64) == AccumLayout(90, 128, 256, 2, False, 32)
    assert _dq(90, 96) == AccumLayout(90, 64, 128, 1, False, 32)
    assert _dq(90, 128) == AccumLayout(90, 80, 256, 1, True, 32)
    assert _dq(90, 128, causal=True) == AccumLayout(90, 64, 256, 1, False, 32)
    assert _dq(90, 192) == _dq(90, 136) == _dq(90, 256) == AccumLayout(90, 64, 256, 1, False, 64)
    assert _dq(90, 136).padded_head_dim(136) == 192
    assert _dq(100, 64) == AccumLayout(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=1)
    assert _dq(100, 128) == _dq(103, 192) == AccumLayout(100, 128, 128, 1, False, 32, two_cta=True, cluster_size=1)
    assert _dq(120, 256) == AccumLayout(80, 64, 128, 4, False, 32)
    with pytest.raises(ValueError, match="dedicated hd256 kernel"):
        _dq(100, 256)
    with pytest.raises(ValueError, match="no dQ postprocess configuration for gpu=80"):
        _dq(80, 128)
    with pytest.raises(ValueError, match="head_dim must be a positive multiple of 8"):
        _dq(90, 100)
    for arch in (90, 100, 120):  # every preset accepts every head dim it is defined for
        for head_dim in range(8, 257, 8):
            if arch == 100 and head_dim > 192:
                continue
            for causal in (False, True):
                if arch == 90 and head_dim in B36_SM90_REFUSED and not causal:
                    with pytest.raises(ValueError, match=B36_REFUSAL.format(head_dim)):
                        _dq(arch, head_dim, causal)
                    continue
                _dq(arch, head_dim, causal).check_head_dim(head_dim)
                _dkv(arch, head_dim, causal).check_head_dim(head_dim)


def test_presets_match_flash_attention_4():
    """FlashAttention-4 b36's dK/dV configurations (interface.py: _tile_size_bwd_sm90 and the postprocess calls);
    the sm90 entries were also observed in its backward on the H200 (test_fa4_producer.py)."""
    sm90 = {64: (128, 256, 2, False, 32), 96: (128, 256, 2, False, 32), 128: (128, 256, 2, False, 32),
            192: (96, 256, 2, True, 64), 256: (48, 256, 1, True, 64)}
    for d, want in sm90.items():
        for causal in (False, True):
            assert _dkv(90, d, causal) == AccumLayout(90, *want)
    for d in (64, 96):
        assert _dkv(100, d) == AccumLayout(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=1)
    for d in (128, 192):
        assert _dkv(100, d) == AccumLayout(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=2)
        assert _dkv(110, d).cluster_size == 2
        assert _dq(100, d).cluster_size == 1 and _dq(100, d).two_cta
    assert _dkv(120, 256) == AccumLayout(80, 64, 128, 4, False, 32)
    with pytest.raises(ValueError, match="dedicated hd256 kernel"):
        _dkv(100, 256)
    with pytest.raises(ValueError, match="tensor must be 'dq' or 'dkv', got 'dk'"):
        AccumLayout.flash_attention(90, 128, causal=False, tensor="dk", version=RELEASE)
    with pytest.raises(ValueError, match="no dK/dV postprocess configuration for gpu=80"):
        _dkv(80, 128)


def test_b36_sm90_tiles_of_16_in_rows_allocated_for_32():
    """flash-attn-4 4.0.0b36's sm90 backward pads the head dim to 16 in its tiles and to 32 in its allocation: at
    exactly the head dims where the two differ (the rule, B36_SM90_PADDED) both presets are their row of the table
    (the row of the head dim rounded up to 32, where the two agree) with ``hdim_multiple_of=16,
    alloc_hdim_multiple_of=32``; everywhere else, and on every other GPU, the allocation is the tiles' padding."""
    assert B36_SM90_PADDED == (8, 16, 40, 48, 72, 80, 104, 112)
    explicit = {(72, "dq"): (64, 128, 1, False), (104, "dq", True): (64, 256, 1, False),  # n_atom 80 and 56
                (16, "dq"): (128, 256, 2, False), (48, "dkv"): (128, 256, 2, False),
                (112, "dkv", True): (128, 256, 2, False)}
    for key, fields in explicit.items():
        d, tensor, causal = (*key, False)[:3]
        got = (_dq if tensor == "dq" else _dkv)(90, d, causal)
        assert _order(got) == AccumLayout(90, *fields, 16, alloc_hdim_multiple_of=32), (key, got)
    for gpu in (90, 100, 101, 103, 110, 120, 121):
        for d in range(8, 257, 8):
            for causal, tensor in itertools.product((False, True), ("dq", "dkv")):
                if gpu // 10 in (10, 11) and d > 192:
                    continue
                if gpu == 90 and d in B36_SM90_REFUSED and not causal:
                    continue  # test_b36_sm90_refuses_what_its_backward_cannot_run
                layout = AccumLayout.flash_attention(gpu, d, causal=causal, tensor=tensor, version=RELEASE)
                where = (gpu, d, causal, tensor, layout)
                if gpu == 90 and d in B36_SM90_PADDED:
                    row = AccumLayout.flash_attention(gpu, round_up(d, 32), causal=causal, tensor=tensor,
                                                      version=RELEASE)
                    assert row.hdim_multiple_of == row.alloc_hdim_multiple_of == 32, where
                    assert _order(layout) == dataclasses.replace(row, hdim_multiple_of=16,
                                                                 alloc_hdim_multiple_of=32), where
                    assert layout.padded_head_dim(d) == round_up(d, 16), where
                    assert layout.alloc_head_dim(d) == round_up(d, 32), where
                    assert layout.accum_shape(2, 3, 100, d) == (2, 3, layout.padded_seqlen(100) * round_up(d, 32))
                    # dQ's packed accumulators are lost (its preprocess zeroes other tiles); dK/dV's are read
                    assert bool(layout.varlen_unreadable) == (tensor == "dq"), where
                    if tensor == "dq":
                        assert "4.0.0b36" in layout.varlen_unreadable, where
                else:
                    assert layout.alloc_hdim_multiple_of == layout.hdim_multiple_of, where
                    assert layout.varlen_unreadable is None, where
                    assert "alloc_hdim_multiple_of" not in repr(layout), where


@pytest.mark.parametrize("tensor", ["dq", "dkv"])
@pytest.mark.parametrize("head_dim", B36_SM90_REFUSED)
def test_b36_sm90_refuses_what_its_backward_cannot_run(tensor, head_dim):
    """At sm90 head dims 104 and 112 without causal 4.0.0b36's backward does not compile: no accumulator, for dQ
    and dK/dV alike; causal ones are presets."""
    with pytest.raises(ValueError, match=B36_REFUSAL.format(head_dim)):
        AccumLayout.flash_attention(90, head_dim, causal=False, tensor=tensor, version=RELEASE)
    AccumLayout.flash_attention(90, head_dim, causal=True, tensor=tensor, version=RELEASE).check_head_dim(head_dim)
    for gpu in (100, 120):  # only sm90's backward
        AccumLayout.flash_attention(gpu, head_dim, causal=False, tensor=tensor, version=RELEASE)


@pytest.mark.parametrize("version", ["4.0.0b35", "4.0.0b37", "4.0.0", "", "b36"])
def test_an_unknown_release_is_refused_naming_the_layouts_to_pass(version):
    """A release the presets do not know may pad otherwise: refused, with the known releases and the two layouts
    its padding could give (4.0.0b36's, and the accumulators' own); where the two agree, the one."""
    import re

    with pytest.raises(ValueError, match=rf"^version={re.escape(repr(version))} is not a flash-attn-4 release these "
                                         r"presets know \(4\.0\.0b36\)") as e:
        _dq(90, 72, causal=True, version=version)
    b36, own = AccumLayout(90, 64, 128, 1, False, 16, alloc_hdim_multiple_of=32), AccumLayout(90, 64, 128, 1, False, 32)
    assert repr(b36) in str(e.value) and repr(own) in str(e.value), str(e.value)
    assert "4.0.0b36's is" in str(e.value) and "PR #2896" in str(e.value), str(e.value)
    for tensor in ("dq", "dkv"):
        with pytest.raises(ValueError, match=rf"not a flash-attn-4 release .*the known releases' is "
                                             rf"{re.escape(repr(AccumLayout(90, 64, 256, 1, False, 64)))}$"
                           if tensor == "dq" else "the known releases' is"):
            AccumLayout.flash_attention(90, 192, causal=False, tensor=tensor, version=version)
        with pytest.raises(ValueError, match="is not a flash-attn-4 release"):
            AccumLayout.flash_attention(100, 64, causal=False, tensor=tensor, version=version)


def test_version_is_required_and_a_str():
    import inspect

    assert inspect.signature(AccumLayout.flash_attention).parameters["version"].default is inspect.Parameter.empty
    for tensor in ("dq", "dkv"):
        with pytest.raises(TypeError, match=r"^AccumLayout\.flash_attention\(\) needs version=: the flash-attn-4 "
                                            r"release whose backward wrote the accumulator, one of '4\.0\.0b36' .*"
                                            r"a wrong guess gives wrong gradients, not an error$"):
            AccumLayout.flash_attention(90, 64, causal=False, tensor=tensor)
    for bad in (4.0, 36, None, b"4.0.0b36", ("4.0.0b36",)):
        with pytest.raises(TypeError, match=r"^version must be a str, a flash-attn-4 release such as '4\.0\.0b36', "
                                            rf"got .*\({type(bad).__name__}\)$"):
            _dq(90, 64, version=bad)
    assert _dq(90, 72, version=" 4.0.0b36 ") == _dq(90, 72)  # (surrounding blanks, as metadata may give them)


FLASH_ATTENTION_GPUS = (90, 100, 101, 103, 110, 120, 121)


def _differing_head_dims(arch, pick_a, pick_b):
    """Head dims at which two choices of the presets' arguments both give a layout and the orders differ, by brute
    force."""
    dims = []
    for d in range(8, 257, 8):
        try:
            a = AccumLayout.flash_attention(arch, d, **pick_a, version=RELEASE)
            b = AccumLayout.flash_attention(arch, d, **pick_b, version=RELEASE)
        except ValueError:  # no postprocess at this head dim (or none for one of the picks)
            continue
        if _order(a) != _order(b):
            dims.append(d)
    return dims


def test_causal_and_tensor_have_no_default_and_the_error_says_where_they_matter():
    """An accumulator in FlashAttention-4's causal hd128 order read with the non-causal one has the same shape at
    S=1280 (both tiles divide it) and comes out wrong: ``causal`` and ``tensor`` are required on every GPU, and the
    error lists the presets that differ (checked here against the presets themselves; at 4.0.0b36's sm90 head dims
    104 and 112 the non-causal pick has no layout, an error)."""
    import inspect

    params = inspect.signature(AccumLayout.flash_attention).parameters
    assert params["causal"].default is params["tensor"].default is params["version"].default is inspect.Parameter.empty
    causal_dq = AccumLayout.flash_attention(90, 128, causal=True, tensor="dq", version=RELEASE)
    plain_dq = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version=RELEASE)
    assert causal_dq != plain_dq and causal_dq.accum_shape(1, 1, 1280, 128) == plain_dq.accum_shape(1, 1, 1280, 128)
    differs = {arch: _differing_head_dims(arch, dict(causal=True, tensor=t), dict(causal=False, tensor=t))
               for arch in FLASH_ATTENTION_GPUS for t in ("dq",)}
    assert differs[90] == [120, 128] and not any(differs[a] for a in FLASH_ATTENTION_GPUS if a != 90)
    # the message's 104..128: where causal=False gives another order, or (4.0.0b36) none
    assert sorted(differs[90] + list(B36_SM90_REFUSED)) == [104, 112, 120, 128]
    for arch in FLASH_ATTENTION_GPUS:
        assert not _differing_head_dims(arch, dict(causal=True, tensor="dkv"), dict(causal=False, tensor="dkv"))
        for tensor in ("dq", "dkv"):
            with pytest.raises(TypeError, match=r"^AccumLayout.flash_attention\(\) needs causal=: True or False .*"
                                                r"differ for sm90 dQ at head dims 104\.\.128, with the same shape"):
                AccumLayout.flash_attention(arch, 64, tensor=tensor, version=RELEASE)
        with pytest.raises(TypeError, match=r"needs tensor=: 'dq' or 'dkv'; .* sm90 at head dims 72\.\.256; sm100, "
                                            r"sm110 at head dims 128\.\.192\)"):
            AccumLayout.flash_attention(arch, 64, causal=False, version=RELEASE)
    # the message's 72..256 on sm90: the dQ and dK/dV orders differ, or neither exists (B36_SM90_REFUSED)
    assert sorted(_differing_head_dims(90, dict(causal=False, tensor="dq"), dict(causal=False, tensor="dkv"))
                  + list(B36_SM90_REFUSED)) == list(range(72, 257, 8))
    assert _differing_head_dims(90, dict(causal=True, tensor="dq"), dict(causal=True, tensor="dkv")) == list(
        range(72, 257, 8))
    assert _differing_head_dims(100, dict(causal=False, tensor="dq"), dict(causal=False, tensor="dkv")) == list(
        range(128, 193, 8))
    with pytest.raises(TypeError, match=r"needs causal=, tensor= and version=\. causal: True or False .* tensor: "
                                        r"'dq' or 'dkv'.* version: the flash-attn-4 release"):
        AccumLayout.flash_attention(90, 128)
    with pytest.raises(TypeError, match=r"flash_attention\(\): too many positional arguments; the signature is "
                                        r"AccumLayout.flash_attention\(gpu, head_dim, \*, causal, tensor, version, "
                                        r"head_dim_v=None\)$"):
        AccumLayout.flash_attention(90, 128, True)


@pytest.mark.parametrize("arch", [0, 7, 75, 91, 99, 102, 130, 1000])
def test_an_unknown_gpu_architecture_is_refused_naming_the_known_ones(arch):
    """An unknown architecture is refused, never given a neighbour's preset."""
    match = r"gpu must be >= 1, got 0" if arch == 0 else (
        rf"^gpu={arch} is not a GPU architecture; the known ones are 80, 86, 87, 89, 90, 100, 101, 103, 110, 120, "
        r"121 \(FlashAttention-4's backward runs on 90, 100, 101, 103, 110, 120, 121\)")
    with pytest.raises(ValueError, match=match):
        AccumLayout.flash_attention(arch, 128, causal=False, tensor="dq", version=RELEASE)
    for known in FLASH_ATTENTION_GPUS:
        AccumLayout.flash_attention(known, 128, causal=False, tensor="dq", version=RELEASE)


def test_cluster_size_pads_rows_in_clusters():
    layout = AccumLayout(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=2)
    assert layout.pad_rows == 256 and layout.padded_seqlen(300) == 512 and layout.num_tiles(300) == 3
    assert layout.varlen_accum_shape(2, 1, 100, 64) == (1, 768 * 64)  # round_up(100 + 2*256, 256)
    assert "cluster_size=2" in repr(layout) and "cluster_size" not in repr(AccumLayout.row_major())
    for bad, err in ((0, ValueError), (16, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(err, match="AccumLayout.cluster_size"):
            AccumLayout(90, 64, 256, 1, False, 32, cluster_size=bad)


def test_repr_round_trips():
    layouts = [AccumLayout(90, 80, 256, 1, True, 32), AccumLayout.row_major(cluster_size=2),
               AccumLayout(100, 128, 128, 1, False, 32, two_cta=True, cluster_size=1),
               AccumLayout(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=2),
               AccumLayout(90, 64, 128, 1, False, 16, alloc_hdim_multiple_of=32), _dq(90, 72), _dkv(90, 104, True)]
    for layout in layouts:
        assert eval(repr(layout), {"AccumLayout": AccumLayout}) == layout


def test_shape_helpers_take_only_sizes_that_exist():
    """accum_shape, varlen_accum_shape and padded_seqlen give shapes for Python ints >= 0 and a head dim the op
    takes with the layout (the rule of check_head_dim); anything else is an error naming the argument and the value,
    never a shape like (-1, 1, 4096)."""
    rm = AccumLayout.row_major()
    sm90 = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version=RELEASE)
    assert rm.accum_shape(0, 0, 0, 64) == (0, 0, 0) and rm.varlen_accum_shape(0, 1, 0, 64) == (1, 0)
    assert rm.accum_shape(2, 1, 100, 64) == (2, 1, 128 * 64)
    assert sm90.varlen_accum_shape(2, 3, 100, 128) == (3, 320 * 128)
    cases = [
        (lambda: rm.accum_shape(-1, 1, 64, 64), ValueError, r"^batch must be >= 0, got -1$"),
        (lambda: rm.accum_shape(1, -2, 64, 64), ValueError, r"^heads must be >= 0, got -2$"),
        (lambda: rm.accum_shape(1, 1, -64, 64), ValueError, r"^seqlen must be >= 0, got -64$"),
        (lambda: rm.accum_shape(1.0, 1, 64, 64), TypeError, r"^batch must be a Python int, got 1.0 \(float\)$"),
        (lambda: rm.varlen_accum_shape(-3, 1, 64, 64), ValueError, r"^batch must be >= 0, got -3$"),
        (lambda: rm.varlen_accum_shape(2, 1, -1, 64), ValueError, r"^total_q must be >= 0, got -1$"),
        (lambda: rm.accum_shape(1, 1, 64, 60), ValueError,
         r"^head_dim must be a positive multiple of 8 and at most 256, got 60$"),
        (lambda: rm.varlen_accum_shape(1, 1, 64, 264), ValueError, r"^head_dim must be .* at most 256, got 264$"),
        (lambda: rm.accum_shape(1, 1, 64, "64"), TypeError, r"^head_dim must be a Python int, got '64' \(str\)$"),
        (lambda: sm90.accum_shape(1, 1, 64, 64), ValueError,
         r"^head_dim=64 \(padded to 64\) with AccumLayout\(arch=90, .* build the layout for head_dim=64$"),
        (lambda: rm.padded_seqlen(-1), ValueError, r"^seqlen must be >= 0, got -1$"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    with pytest.raises(ValueError) as refused:  # the op's own message, for the same head dim
        sm90.check_head_dim(64)
    with pytest.raises(ValueError, match=re.escape(str(refused.value))):
        sm90.varlen_accum_shape(1, 1, 64, 64)


def test_a_row_major_layout_that_cannot_hold_a_head_dim_says_which_fields_do():
    """The row-major order is made for no head dim (row_major() takes none): the error says what the layout holds and
    that row_major()'s defaults hold every head dim, not to build the layout for the head dim."""
    assert all(AccumLayout.row_major()._holds(d) for d in range(8, 257, 8))
    for layout, head_dim, held in ((AccumLayout.row_major(hdim_multiple_of=8), 8, r"head dims 16, 32, .*, 256"),
                                   (AccumLayout(None, 168, 64, 1, False, 128), 72, "no head dim")):
        with pytest.raises(ValueError, match=rf"\. This row-major layout holds {held}; AccumLayout.row_major\(\) with "
                                             r"its default tile_m, num_threads and hdim_multiple_of holds every head "
                                             r"dim$"):
            layout.check_head_dim(head_dim)
