"""Variable-length batches and dense batches with seqused_q, static and traced, against the oracle.

Runs on every platform present (CPU: the reference; CUDA: the kernel through the FFI target).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FA_HOPPER_CONFIGS, PLATFORMS
from jax_dqpost import AccumLayout, dq_postprocess
from test_dq_postprocess import DTYPES, assert_same_bits
import oracle

CONFIGS = ["cute-hd128", "cute-hd64", "cute-hd96-single-wg", "cxx-hd256-swap"]
HEAD_DIMS = {"cute-hd128": 128, "cute-hd64": 64, "cute-hd96-single-wg": 96, "cxx-hd256-swap": 256}


def _layout(name):
    return AccumLayout(90, *FA_HOPPER_CONFIGS[name])


def _random_lengths(rng, batch, mean):
    return [int(x) for x in rng.integers(0, 2 * mean + 1, batch)]


def _varlen_case(rng, name, lengths, *, extra_rows=0, seqused=None, heads=2, dtype=jnp.bfloat16, cu=None):
    tile_m, threads, atom, swap, mult = FA_HOPPER_CONFIGS[name]
    head_dim = HEAD_DIMS[name]
    if cu is None:
        cu = [0] + list(np.cumsum(lengths).astype(int))
    total_q = int(cu[-1]) + extra_rows
    scale = float(rng.uniform(0.05, 2.0))
    acc, expected = oracle.build_varlen(rng, cu, seqused, total_q, heads, head_dim, (tile_m, threads, atom, swap),
                                        hdim_multiple_of=mult, scale=scale, dtype=dtype)
    return acc, expected, [int(v) for v in cu], total_q, head_dim, scale


def _run(platform, acc, scale, *, static, cu, seqused, total_q, head_dim, layout, dtype):
    device = jax.devices(platform)[0]
    acc = jax.device_put(acc, device)
    if static:
        f = jax.jit(lambda a: dq_postprocess(a, scale, head_dim=head_dim, total_q=total_q, cu_seqlens_q=cu,
                                             seqused_q=seqused, dtype=dtype, layout=layout))
        return f(acc)
    f = jax.jit(lambda a, c, u: dq_postprocess(a, scale, head_dim=head_dim, total_q=total_q, cu_seqlens_q=c,
                                               seqused_q=u, dtype=dtype, layout=layout))
    to_dev = lambda x: None if x is None else jax.device_put(np.asarray(x, np.int32), device)
    return f(acc, to_dev(cu), to_dev(seqused))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", CONFIGS)
def test_varlen_static_and_traced_match_oracle(rng, platform, dtype, name):
    layout = _layout(name)
    cases = [
        dict(lengths=_random_lengths(rng, 5, 150), extra_rows=0),
        dict(lengths=[0, 7, 0, 300, 1, 0], extra_rows=37),  # empty sequences, rows past cu[-1]
        dict(lengths=[layout.tile_m * 2 + 3], extra_rows=0),  # B = 1
    ]
    for case in cases:
        for with_seqused in (False, True):
            seqused = None
            if with_seqused:
                seqused = [int(rng.integers(0, n + 1)) if n else 0 for n in case["lengths"]]
                seqused[0] = 0 if case["lengths"][0] == 0 else case["lengths"][0]  # full and shorter both appear
            acc, want, cu, total_q, head_dim, scale = _varlen_case(
                rng, name, case["lengths"], extra_rows=case["extra_rows"], seqused=seqused, dtype=dtype)
            outs = {}
            for static in (True, False):
                outs[static] = _run(platform, acc, scale, static=static, cu=cu, seqused=seqused, total_q=total_q,
                                    head_dim=head_dim, layout=layout, dtype=dtype)
                assert_same_bits(outs[static], want, f"{platform} {name} static={static} cu={cu} used={seqused}")
            assert_same_bits(outs[True], outs[False], "static vs traced")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("layout", [AccumLayout(80, 64, 128, 4, False, 32),
                                    AccumLayout(100, 128, 128, 1, False, 32, two_cta=True),
                                    AccumLayout(None, 64, 256, 1, False, 32)], ids=["sm120", "sm100-2cta", "row-major"])
def test_varlen_other_orders(rng, platform, layout):
    lengths = [0, 5, 300, 130, 1]
    cu = [0] + [int(v) for v in np.cumsum(lengths)]
    seqused = [0, 5, 200, 129, 0]
    total_q, head_dim = cu[-1] + 9, 128
    acc, want = oracle.build_varlen(rng, cu, seqused, total_q, 2, head_dim,
                                    (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab),
                                    hdim_multiple_of=layout.hdim_multiple_of, scale=0.75, dtype=jnp.bfloat16,
                                    arch=layout.arch, two_cta=layout.two_cta)
    for static in (True, False):
        got = _run(platform, acc, 0.75, static=static, cu=cu, seqused=seqused, total_q=total_q, head_dim=head_dim,
                   layout=layout, dtype=jnp.bfloat16)
        assert_same_bits(got, want, f"{layout} static={static}")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_many_short_sequences(rng, platform):
    name = "cute-hd128"
    lengths = _random_lengths(rng, 2000, 6)
    acc, want, cu, total_q, head_dim, scale = _varlen_case(rng, name, lengths, extra_rows=5)
    for static in (True, False):
        got = _run(platform, acc, scale, static=static, cu=cu, seqused=None, total_q=total_q, head_dim=head_dim,
                   layout=_layout(name), dtype=jnp.bfloat16)
        assert_same_bits(got, want, f"B=2000 static={static}")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_corrupt_traced_offsets_are_clamped_not_out_of_bounds(rng, platform):
    """Decreasing offsets, offsets past total_q or negative, seqused longer than its sequence: the result
    is the documented clamped partition (oracle), computed without any out-of-bounds access."""
    name = "cute-hd128"
    layout = _layout(name)
    total_q = 400
    for cu, seqused in [
        ([0, 300, 100, 350], None),  # decreasing
        ([0, 100, 5000, 200000], None),  # past total_q and past the accumulator
        ([-50, 30, 60, 90], [10, 1000, -3]),  # negative start, seqused too long / negative
        ([2**30, 2**31 - 1, 0, 10], [5, 5, 5]),  # huge
        ([400, 0, 0, 0], None),  # everything empty
    ]:
        acc, want = oracle.build_varlen(rng, cu, seqused, total_q, 2, 128, FA_HOPPER_CONFIGS[name][:4],
                                        hdim_multiple_of=32, scale=0.5, dtype=jnp.bfloat16)
        got = _run(platform, acc, 0.5, static=False, cu=cu, seqused=seqused, total_q=total_q, head_dim=128,
                   layout=layout, dtype=jnp.bfloat16)
        assert_same_bits(got, want, f"corrupt cu={cu} seqused={seqused}")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_dense_with_seqused(rng, platform, dtype):
    name = "cute-hd128-causal"
    tile_m, threads, atom, swap, mult = FA_HOPPER_CONFIGS[name]
    layout = _layout(name)
    B, S, H, D = 4, 200, 2, 128
    logical = oracle.random_logical(rng, (B, S, H, D))
    acc = oracle.build_accumulator(logical, (tile_m, threads, atom, swap), hdim_multiple_of=mult, rng=rng)
    seqused = [0, 200, 65, int(rng.integers(0, 201))]
    want = oracle.expected_dense_seqused(logical, seqused, 0.25, dtype)
    device = jax.devices(platform)[0]
    acc = jax.device_put(acc, device)
    static = jax.jit(lambda a: dq_postprocess(a, 0.25, seqlen_q=S, head_dim=D, seqused_q=seqused, dtype=dtype,
                                              layout=layout))(acc)
    traced_f = jax.jit(lambda a, u: dq_postprocess(a, 0.25, seqlen_q=S, head_dim=D, seqused_q=u, dtype=dtype,
                                                   layout=layout))
    traced = traced_f(acc, jax.device_put(np.asarray(seqused, np.int32), device))
    assert_same_bits(static, want, "dense seqused static")
    assert_same_bits(traced, want, "dense seqused traced")
    # Corrupt traced lengths are clamped to [0, S].
    corrupt = np.asarray([-5, 10**6, 3, 2**31 - 1], np.int32)
    got = traced_f(acc, jax.device_put(corrupt, device))
    assert_same_bits(got, oracle.expected_dense_seqused(logical, [0, S, 3, S], 0.25, dtype), "corrupt seqused")


def test_new_traced_values_do_not_retrace_or_recompile(rng):
    from jax_dqpost import kernel_cache

    layout = _layout("cute-hd128")
    traces = []

    @jax.jit
    def f(acc, cu, used):
        traces.append(1)
        return dq_postprocess(acc, 0.5, head_dim=128, total_q=500, cu_seqlens_q=cu, seqused_q=used, layout=layout)

    acc = jnp.zeros((2, 128 * ((500 + 5 * 80 - 1) // 80 * 80)), jnp.float32)
    kernels = None
    for _ in range(4):
        cu = np.concatenate([[0], np.sort(rng.integers(0, 501, 3)), [500]]).astype(np.int32)
        used = rng.integers(0, 200, 4).astype(np.int32)
        f(acc, jnp.asarray(cu), jnp.asarray(used)).block_until_ready()
        kernels = kernel_cache.cache_size() if kernels is None else kernels
        assert kernel_cache.cache_size() == kernels  # no CuTe compile after the first call (on GPU)
    assert len(traces) == 1, f"retraced {len(traces)} times"
    assert f._cache_size() == 1  # one XLA executable


def test_static_validation_names_argument_and_value():
    layout = _layout("cute-hd128")
    acc = jnp.zeros((2, 128 * ((100 + 3 * 80 - 1) // 80 * 80)), jnp.float32)
    call = lambda **kw: dq_postprocess(acc, 1.0, **{**dict(head_dim=128, total_q=100, cu_seqlens_q=[0, 50, 100],
                                                           layout=layout), **kw})
    call()  # consistent
    cases = [
        (dict(cu_seqlens_q=[0, 60, 50]), ValueError, r"non-decreasing, got cu_seqlens_q\[1\]=60 > cu_seqlens_q\[2\]=50"),
        (dict(cu_seqlens_q=[-1, 50, 100]), ValueError, r"cu_seqlens_q\[0\] must be >= 0, got -1"),
        (dict(cu_seqlens_q=[0, 50, 101]), ValueError, r"cu_seqlens_q\[-1\]=101 exceeds total_q=100"),
        (dict(cu_seqlens_q=[0]), ValueError, r"at least 2 entries"),
        (dict(seqused_q=[10, 51]), ValueError, r"seqused_q\[1\]=51 must be in \[0, 50\]"),
        (dict(seqused_q=[10]), ValueError, r"seqused_q must have batch=2 entries, got 1"),
        (dict(cu_seqlens_q=[0.0, 50.0, 100.0]), TypeError, r"cu_seqlens_q must be a 1-D sequence of ints"),
        (dict(total_q=None), ValueError, r"total_q .* is required with cu_seqlens_q"),
        (dict(seqlen_q=100), ValueError, r"seqlen_q=100 is only for dense batches"),
        (dict(cu_seqlens_q=jnp.zeros(3, jnp.float32)), TypeError, r"cu_seqlens_q must be an integer array"),
        (dict(total_q=300, cu_seqlens_q=jnp.asarray([0, 50, 99])), ValueError, r"dq_accum must have shape \(heads, Tp\*Dr\)"),
    ]
    for kwargs, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call(**kwargs)
    with pytest.raises(ValueError, match=r"seqused_q\[1\]=300 must be in \[0, seqlen_q=200\]"):
        dq_postprocess(jnp.zeros(layout.accum_shape(2, 1, 200, 128), jnp.float32), 1.0, seqlen_q=200, head_dim=128,
                       seqused_q=[3, 300], layout=layout)
    with pytest.raises(ValueError, match=r"total_q=5 is only for variable-length batches"):
        dq_postprocess(jnp.zeros(layout.accum_shape(2, 1, 200, 128), jnp.float32), 1.0, seqlen_q=200, head_dim=128,
                       total_q=5, layout=layout)


def test_concrete_arrays_outside_jit_are_validated_like_static_values(rng):
    """A jax array passed outside jit has values this host can read: they are checked as static ones (the same
    error), while the array stays the kernel's operand (the traced work list's bound); traced values are clamped."""
    from jax_dqpost.primitive import postprocess_p
    from jax_dqpost.varlen import WorkList

    layout, D, T = _layout("cute-hd128"), 128, 100
    packed = jnp.asarray(rng.standard_normal(layout.varlen_accum_shape(2, 2, T, D)), jnp.float32)
    dense = jnp.asarray(rng.standard_normal(layout.accum_shape(2, 2, T, D)), jnp.float32)
    varlen = lambda cu, used=None: dq_postprocess(packed, 0.5, head_dim=D, total_q=T, cu_seqlens_q=cu,
                                                  seqused_q=used, layout=layout)
    dense_used = lambda used: dq_postprocess(dense, 0.5, head_dim=D, seqlen_q=T, seqused_q=used, layout=layout)
    cases = [  # (call, its argument, the static path's error)
        (varlen, [0, 100, 50], r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\]=100 > "
                               r"cu_seqlens_q\[2\]=50"),
        (varlen, [0, 50, 101], r"cu_seqlens_q\[-1\]=101 exceeds total_q=100"),
        (varlen, [-1, 50, 100], r"cu_seqlens_q\[0\] must be >= 0, got -1"),
        (lambda u: varlen([0, 50, 100], u), [51, 3], r"seqused_q\[0\]=51 must be in \[0, 50\]"),
        (lambda u: varlen(jnp.asarray([0, 50, 100]), u), [3, -2], r"seqused_q\[1\]=-2 must be in \[0, 50\]"),
        (lambda c: varlen(c, [3, 60]), [0, 50, 100], r"seqused_q\[1\]=60 must be in \[0, 50\]"),
        (dense_used, [200, 50], r"seqused_q\[0\]=200 must be in \[0, seqlen_q=100\]"),
        (dense_used, [5, -1], r"seqused_q\[1\]=-1 must be in \[0, seqlen_q=100\]"),
    ]
    for call, values, match in cases:
        with pytest.raises(ValueError, match=match):
            call(values)  # static
        with pytest.raises(ValueError, match=match):
            call(jnp.asarray(values, jnp.int32))  # concrete, outside jit
        jax.jit(call)(jnp.asarray(values, jnp.int32)).block_until_ready()  # traced: clamped, no error
    # Readable lengths with traced offsets: only their sign can be checked (the bound needs the offsets).
    bad_lengths, lengths_ok = jnp.asarray([500, -7], jnp.int32), jnp.asarray([500, 7], jnp.int32)  # closed over
    with pytest.raises(ValueError, match=r"seqused_q\[1\]=-7 must be >= 0"):
        jax.jit(lambda c: varlen(c, bad_lengths))(jnp.asarray([0, 50, 100], jnp.int32))
    jax.jit(lambda c: varlen(c, lengths_ok))(jnp.asarray([0, 50, 100], jnp.int32)).block_until_ready()
    # Valid values: the concrete array is an operand of the traced path (no exact grid), with the static result.
    lengths = rng.integers(0, 51, 2)
    cu = [0, int(lengths[0]), int(lengths.sum())]
    used = [int(rng.integers(0, n + 1)) for n in lengths]
    concrete = (jnp.asarray(cu, jnp.int32), jnp.asarray(used, jnp.int32))
    assert_same_bits(varlen(*concrete), varlen(cu, used), f"concrete vs static cu={cu} used={used}")
    (eqn,) = [e for e in jax.make_jaxpr(lambda: varlen(*concrete))().eqns if e.primitive is postprocess_p]
    assert eqn.params["plan"].dq.work.num_tiles == WorkList.max_tiles(T, 2, layout)
    assert_same_bits(dense_used(concrete[1]), dense_used(used), "dense seqused concrete vs static")


@pytest.mark.parametrize("layout", [
    AccumLayout.flash_attention(90, 128), AccumLayout.flash_attention(90, 256, tensor="dkv"),
    AccumLayout.flash_attention(90, 128, causal=True), AccumLayout(90, 16, 128, 1, True, 64)],
    ids=["hd128-short", "dkv-hd256-short", "hd128-causal", "tile16-short"])
def test_work_list_slots_take_every_tile_once(rng, layout):
    """The kernel's reading of the work list (kernel.py): long-tile slot i < tile_start[K] converts tile i -
    tile_start[s] of span s = tile_span[i]; with short tiles, span k's short-tile slot converts its last tile when it
    has 1 .. short_rows rows. Together they take every tile of every span exactly once, for static offsets (the exact
    slots) and traced ones (the bound), also where the offsets break the contract (clamped)."""
    from jax_dqpost.varlen import WorkList, short_rows

    tm, short = layout.tile_m, short_rows(layout)
    assert short == (min(16, tm - 1) if layout.swap_ab else 0)
    for case in range(20):
        batch = int(rng.integers(1, 60))
        top = [3, 20, tm + 20, 4 * tm][case % 4]  # many tiny, short-ish, about a tile, long
        lengths = rng.integers(0, top + 1, batch)
        lengths[rng.random(batch) < 0.2] = tm * rng.integers(1, 3)  # whole tiles: no short tile
        T = int(lengths.sum()) + int(rng.integers(0, 2 * tm))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        used = np.minimum(lengths, rng.integers(0, top + 1, batch)).astype(np.int32) if case % 3 == 0 else None
        if case % 5 == 4:  # corrupt traced values: clamped to a partition of the rows
            cu = rng.integers(-50, T + 50, batch + 1).astype(np.int32)
        for traced in (False, True) if case % 5 != 4 else (True,):
            xp = jnp if traced else np
            num_tiles = WorkList.max_tiles(T, batch, layout) if traced else None
            work, meta = WorkList.build(xp, cu, used, total=T, layout=layout, num_tiles=num_tiles)
            s = work.decode(np.asarray(meta))
            K = work.num_spans
            expect = {(k, m) for k in range(K) for m in range(-(-int(s.span_rows[k]) // tm))}
            taken = []
            for i in range(work.num_tiles - work.short_slots):  # long-tile slots
                if i < s.tile_start[K]:
                    k = int(s.tile_span[i])
                    m = i - int(s.tile_start[k])
                    taken.append((k, m))
                    rows = min(int(s.span_rows[k]) - m * tm, tm)
                    assert rows > short or rows == tm, (k, m, rows)
            for k in range(work.short_slots):  # short-tile slots: span k
                assert s.tile_span[work.num_tiles - K + k] == k
                rem = int(s.span_rows[k]) % tm
                if 0 < rem <= short:
                    taken.append((k, int(s.span_rows[k]) // tm))
            assert len(taken) == len(set(taken)) and set(taken) == expect, (case, traced)
            if not traced:
                assert work.num_tiles == s.tile_start[K] + work.short_slots  # exact
