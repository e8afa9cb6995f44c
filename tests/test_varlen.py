"""Variable-length batches: the work list (the kernel's reading of it, pinned to varlen.py), values a host can read
(either side's) validated like static ones while staying operands, and new traced values neither retrace nor recompile.

Their results against the oracle: tests/test_postprocess.py; static validation errors: tests/test_errors.py.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from conftest import FA_HOPPER_CONFIGS, fa4_pair
from jax_dqpost import AccumLayout, dq_postprocess, flash_attention_postprocess
from jax_dqpost.postprocess import arguments as _arguments
from oracle import assert_same_bits
from support import cu_seqlens


def _layout(name):
    return AccumLayout(90, *FA_HOPPER_CONFIGS[name])



def test_new_traced_values_do_not_retrace_or_recompile(rng):
    from jax_dqpost._kernel import cache as kernel_cache

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



@pytest.mark.parametrize("layout_name", ["cute-hd128", "cute-hd64"])
def test_traced_offsets_add_no_loop_to_the_program(layout_name):
    """The work list of traced offsets is built without a loop in the program lowered for CUDA: XLA would run it an
    iteration a launch and split its command buffers around it (jax.numpy's default searchsorted is one, and its
    cumsum for CUDA in jax 0.12)."""
    import jax_dqpost

    layout = _layout(layout_name)
    D = 128 if layout_name.endswith("128") else 64
    T, B = 5000, 7
    acc = jax.ShapeDtypeStruct(layout.varlen_accum_shape(B, 4, T, D), jnp.float32)

    def f(a, cu, used):
        return dq_postprocess(a, 0.5, head_dim=D, total_q=T, cu_seqlens_q=cu, seqused_q=used, layout=layout)

    offsets = jax.ShapeDtypeStruct((B + 1,), jnp.int32)
    module = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=jax_dqpost.DISABLED_CHECKS)(
        acc, offsets, jax.ShapeDtypeStruct((B,), jnp.int32)).mlir_module()
    assert "stablehlo.custom_call" in module and "stablehlo.gather" in module  # the kernel, the work list's lookup
    assert "stablehlo.while" not in module
    assert "stablehlo.while" in jax.jit(jnp.searchsorted).lower(offsets, offsets).as_text()  # what a loop looks like


@pytest.mark.parametrize("side", ["q", "k"])
def test_concrete_arrays_outside_jit_are_validated_like_static_values(rng, side, monkeypatch):
    """A jax array passed outside jit has values this host can read: they are checked as static ones (the same
    error, naming the side's arguments), while the array stays the kernel's operand (the traced work list's bound);
    traced values are clamped. The q side through dq_postprocess, the k side through flash_attention_postprocess
    (with a dense q side)."""
    from jax_dqpost.postprocess._primitive.rules import postprocess_p
    from jax_dqpost._kernel.varlen import WorkList

    dq_layout, dkv_layout, D, _ = fa4_pair("sm90-hd128")
    layout, T, s = (dq_layout if side == "q" else dkv_layout), 100, side
    packed = jnp.asarray(rng.standard_normal(layout.varlen_accum_shape(2, 2, T, D)), jnp.float32)
    dense = jnp.asarray(rng.standard_normal(layout.accum_shape(2, 2, T, D)), jnp.float32)
    if side == "q":
        op = lambda acc, **kw: [dq_postprocess(acc, 0.5, head_dim=D, layout=layout, **kw)]
    else:
        q = jnp.asarray(rng.standard_normal(dq_layout.accum_shape(2, 4, 80, D)), jnp.float32)
        op = lambda acc, **kw: list(flash_attention_postprocess(q, acc, acc, 0.5, head_dim=D, dq_layout=dq_layout,
                                                                dkv_layout=dkv_layout, seqlen_q=80, **kw)[:3])
    varlen = lambda cu, used=None: op(packed, **{f"total_{s}": T, f"cu_seqlens_{s}": cu, f"seqused_{s}": used})
    dense_used = lambda used: op(dense, **{f"seqlen_{s}": T, f"seqused_{s}": used})
    cases = [  # (call, its argument, the static path's error)
        (varlen, [0, 100, 50], rf"cu_seqlens_{s} must be non-decreasing, got cu_seqlens_{s}\[1\]=100 > "
                               rf"cu_seqlens_{s}\[2\]=50"),
        (varlen, [0, 50, 101], rf"cu_seqlens_{s}\[-1\]=101 exceeds total_{s}=100"),
        (varlen, [-1, 50, 100], rf"cu_seqlens_{s}\[0\] must be >= 0, got -1"),
        (lambda u: varlen([0, 50, 100], u), [51, 3], rf"seqused_{s}\[0\]=51 must be in \[0, 50\] .* in cu_seqlens_{s}"),
        (lambda u: varlen(jnp.asarray([0, 50, 100]), u), [3, -2], rf"seqused_{s}\[1\]=-2 must be in \[0, 50\]"),
        (lambda c: varlen(c, [3, 60]), [0, 50, 100], rf"seqused_{s}\[1\]=60 must be in \[0, 50\]"),
        (dense_used, [200, 50], rf"seqused_{s}\[0\]=200 must be in \[0, seqlen_{s}=100\]"),
        (dense_used, [5, -1], rf"seqused_{s}\[1\]=-1 must be in \[0, seqlen_{s}=100\]"),
    ]
    monkeypatch.setattr(_arguments, "device_checks", lambda: True)  # JAX_DQPOST_CHECKIFY=1
    for call, values, match in cases:
        with pytest.raises(ValueError, match=match):
            call(values)  # static
        with pytest.raises(ValueError, match=match):
            call(jnp.asarray(values, jnp.int32))  # concrete, outside jit
        jax.block_until_ready(jax.jit(call)(jnp.asarray(values, jnp.int32)))  # traced: clamped, no error
        error, _ = checkify.checkify(jax.jit(call))(jnp.asarray(values, jnp.int32))  # checked on the device
        assert re.match(match, error.get() or ""), (values, error.get())
    # Readable lengths with traced offsets: only their sign can be checked (the bound needs the offsets).
    bad_lengths, lengths_ok = jnp.asarray([500, -7], jnp.int32), jnp.asarray([500, 7], jnp.int32)  # closed over
    with pytest.raises(ValueError, match=rf"seqused_{s}\[1\]=-7 must be >= 0"):
        jax.jit(lambda c: varlen(c, bad_lengths))(jnp.asarray([0, 50, 100], jnp.int32))
    jax.block_until_ready(jax.jit(lambda c: varlen(c, lengths_ok))(jnp.asarray([0, 50, 100], jnp.int32)))
    # Valid values: the concrete array is an operand of the traced path (no exact grid), with the static result.
    lengths = rng.integers(0, 51, 2)
    cu = [0, int(lengths[0]), int(lengths.sum())]
    used = [int(rng.integers(0, n + 1)) for n in lengths]
    concrete = (jnp.asarray(cu, jnp.int32), jnp.asarray(used, jnp.int32))
    for j, (got, want) in enumerate(zip(varlen(*concrete), varlen(cu, used), strict=True)):
        assert_same_bits(got, want, f"output {j}: concrete vs static cu={cu} used={used}")
    (eqn,) = [e for e in jax.make_jaxpr(lambda: varlen(*concrete))().eqns if e.primitive is postprocess_p]
    assert eqn.params["plan"].side_parts[("q", "k").index(side)].work.num_tiles == WorkList.max_tiles(T, 2, layout)
    for j, (got, want) in enumerate(zip(dense_used(concrete[1]), dense_used(used), strict=True)):
        assert_same_bits(got, want, f"output {j}: dense seqused concrete vs static")
    error, checked = checkify.checkify(jax.jit(varlen))(*concrete)  # valid traced values: no error, the same bits
    assert error.get() is None
    for j, (got, want) in enumerate(zip(checked, varlen(cu, used), strict=True)):
        assert_same_bits(got, want, f"output {j}: checked traced vs static")


def test_traced_scales_are_checked_under_checkify_and_the_checks_cost_nothing_without_it(rng, monkeypatch):
    """With ``JAX_DQPOST_CHECKIFY=1`` (here set after ``import jax_dqpost``: the flag is read when a call is traced)
    a traced NaN or infinite scale is reported under checkify; outside checkify
    the compiled program is the one without the checks (XLA removes their predicates). Off (the default), nothing
    is traced: no effect, so jax.export serializes the function."""
    layout, T, D = _layout("cute-hd128"), 100, 128
    acc = jnp.asarray(rng.standard_normal(layout.varlen_accum_shape(2, 2, T, D)), jnp.float32)
    args = (acc, jnp.asarray([0, 40, 100], jnp.int32), jnp.asarray([40, 7], jnp.int32))

    def op():  # a new function each time: jax caches traces by the function, and the flag is read at trace time
        return lambda a, cu, used, s: flash_attention_postprocess(
            a, None, None, s, head_dim=D, dq_layout=layout, total_q=T, cu_seqlens_q=cu, seqused_q=used)

    def compiled_ops():
        text = jax.jit(op()).lower(*args, jnp.float32(0.5)).compile().as_text()
        return sorted(re.findall(r"= (\S+) ([\w-]+)\(", text))

    checks = lambda: [e for e in jax.make_jaxpr(op())(*args, jnp.float32(0.5)).eqns if "check" in e.primitive.name]
    monkeypatch.delenv(_arguments.CHECKIFY_ENV, raising=False)
    without = compiled_ops()
    assert not checks() and len(without) > 100
    error, _ = checkify.checkify(jax.jit(op()))(*args, jnp.float32(np.nan))
    assert error.get() is None  # off: nothing checked
    monkeypatch.setenv(_arguments.CHECKIFY_ENV, "1")  # set after import: read when the next call is traced
    assert checks() and compiled_ops() == without
    for scale, shown in ((np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")):
        error, _ = checkify.checkify(jax.jit(op()))(*args, jnp.float32(scale))
        assert error.get() == f"softmax_scale must be finite in float32, got {shown} (`check` failed)"
    gqa_layout, dkv_layout, _, _ = fa4_pair("sm90-hd128")
    k = jnp.zeros(dkv_layout.accum_shape(1, 1, 64, D), jnp.float32)
    error, _ = checkify.checkify(jax.jit(lambda s: flash_attention_postprocess(
        jnp.zeros(gqa_layout.accum_shape(1, 2, 64, D), jnp.float32), k, k, 0.5, dk_scale=s, head_dim=D,
        dq_layout=gqa_layout, dkv_layout=dkv_layout, seqlen_q=64, seqlen_k=64)))(jnp.float32(np.nan))
    assert error.get() == "dk_scale must be finite in float32, got nan (`check` failed)"



@pytest.mark.parametrize("layout", [
    AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36"),
    AccumLayout.flash_attention(90, 256, causal=False, tensor="dkv", version="4.0.0b36"),
    AccumLayout.flash_attention(90, 128, causal=True, tensor="dq", version="4.0.0b36"),
    AccumLayout(90, 16, 128, 1, True, 64)],
    ids=["hd128-short", "dkv-hd256-short", "hd128-causal", "tile16-short"])
def test_work_list_slots_take_every_tile_once(rng, layout):
    """The kernel's reading of the work list (kernel.py): long-tile slot i < tile_start[K] converts tile i -
    tile_start[s] of span s = tile_span[i]; with short tiles, span k's short-tile slot converts its last tile when it
    has 1 .. short_rows rows. Together they take every tile of every span exactly once, for static offsets (the exact
    slots) and traced ones (the bound, built under jit as a call builds it), also where the offsets break the
    contract (clamped)."""
    from jax_dqpost._kernel.varlen import WorkList, short_rows

    def traced_build(cu, used, **kw):
        """(WorkList, its int32 array) from offsets traced by jit."""
        works = []

        def build(cu, used):
            work, meta = WorkList.build(jnp, cu, used, **kw)
            works.append(work)  # static: made of the shapes and the layout alone
            return meta

        meta = jax.jit(build)(cu, used)
        return works[0], meta

    tm, short = layout.tile_m, short_rows(layout)
    assert short == (min(16, tm - 1) if layout.swap_ab else 0)
    for case in range(20):
        batch = int(rng.integers(1, 60))
        top = [3, 20, tm + 20, 4 * tm][case % 4]  # many tiny, short-ish, about a tile, long
        lengths = rng.integers(0, top + 1, batch)
        lengths[rng.random(batch) < 0.2] = tm * rng.integers(1, 3)  # whole tiles: no short tile
        T = int(lengths.sum()) + int(rng.integers(0, 2 * tm))
        cu = cu_seqlens(lengths)
        used = np.minimum(lengths, rng.integers(0, top + 1, batch)).astype(np.int32) if case % 3 == 0 else None
        if case % 5 == 4:  # corrupt traced values: clamped to a partition of the rows
            cu = rng.integers(-50, T + 50, batch + 1).astype(np.int32)
        for traced in (False, True) if case % 5 != 4 else (True,):
            if traced:
                build = functools.partial(traced_build, cu, used, total=T, layout=layout,
                                          num_tiles=WorkList.max_tiles(T, batch, layout))
            else:
                build = functools.partial(WorkList.build, np, cu, used, total=T, layout=layout)
            work, meta = build()
            assert len(meta) == work.size
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



def _op_on(argument):
    """(call on an offsets or lengths array, its valid int32 values): ``argument`` of the q side through
    dq_postprocess, of the k side through flash_attention_postprocess (dense q side), on row-major accumulators."""
    layout, side, D = AccumLayout.row_major(), argument[-1], 64
    packed = jnp.zeros(layout.varlen_accum_shape(2, 2, 50, D), jnp.float32)
    dense = jnp.zeros(layout.accum_shape(2, 2, 50, D), jnp.float32)
    cu, used = [0, 5, 50], [5, 40]
    if argument.startswith("cu_seqlens"):
        kw, acc, values = lambda v: {f"total_{side}": 50, f"cu_seqlens_{side}": v}, packed, cu
    else:
        kw, acc, values = lambda v: {f"seqlen_{side}": 50, f"seqused_{side}": v}, dense, used
    if side == "q":
        return (lambda v: dq_postprocess(acc, 0.5, head_dim=D, layout=layout, **kw(v))), values
    q = jnp.zeros(layout.accum_shape(2, 4, 50, D), jnp.float32)
    return (lambda v: flash_attention_postprocess(q, acc, acc, 0.5, head_dim=D, dq_layout=layout, dkv_layout=layout,
                                                  seqlen_q=50, **kw(v))), values


def test_a_packed_call_takes_one_head_per_short_tile_cta_where_eight_make_few_ctas(rng):
    """The plan's choice for a varlen kernel of its own grid (``tuning.short_heads``): short-tile CTAs of 8 heads
    where that makes at least SHORT_CTAS (128) of them, else of 1 (one head: 8, the same grid); the launch counts
    its CTAs with that choice, and the split (``tuning.shares_for``) counts short-tile CTAs at 8 heads whatever
    the choice. A fused kernel keeps 8."""
    from jax_dqpost._kernel import spec as kernel_spec, tuning, varlen
    from jax_dqpost.postprocess._primitive.plan import Part, Plan

    layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")  # short tiles
    assert kernel_spec.tile_shares(layout, 128)
    for batch, heads in [(1, 8 * 42), (1, 8 * 43), (126, 8), (126, 1), (2, 1), (30, 33), (30, 32), (2, 21)] + \
            [(2, 64)] + [(int(b), int(h)) for b in rng.integers(1, 200, 6) for h in rng.integers(1, 70, 2)]:
        lengths = rng.integers(0, 3 * layout.tile_m, batch)
        if (batch, heads) == (2, 64):  # splits counted at 8 heads a short CTA, would not at 1
            lengths = np.array([90, 90])
        work, _ = varlen.WorkList.build(np, cu_seqlens(lengths), None, total=int(lengths.sum()), layout=layout)
        shape = (heads, work.padded_total * 128)
        want = 8 if heads == 1 or (batch + 2) * -(-heads // 8) >= 128 else 1
        part = Part(layout, 128, np.dtype(jnp.bfloat16), work=work)
        spec = Plan((part,)).kernel([shape])
        t = spec.tuning
        assert t.short_heads == want == tuning.short_heads(batch + 2, heads), (batch, heads)
        at_eight = varlen.grid_ctas(heads, work.num_tiles, batch + 2, work.short_rows)
        assert t.shares == tuning.shares_for(layout, 128, at_eight), (batch, heads, at_eight)
        if (batch, heads) == (2, 64):
            at_one = varlen.grid_ctas(heads, work.num_tiles, batch + 2, work.short_rows, short_heads=1)
            assert t.shares > 1 == tuning.shares_for(layout, 128, at_one) and want == 1, (t, at_one)
        ctas = Plan((part,)).launch([shape])[1]
        assert ctas == (batch + 2) * -(-heads // want) + t.shares * heads * (work.num_tiles - batch - 2)
        fused = Plan((part,) * 3).kernel([shape] * 3)
        assert fused.tuning == kernel_spec.Tuning() and fused.tuning.short_heads == 8


@pytest.mark.parametrize("argument", ["cu_seqlens_q", "seqused_q", "cu_seqlens_k", "seqused_k"])
def test_a_jax_array_of_offsets_is_int32_or_widened_exactly(argument):
    """A jax array's dtype is known when the call is traced: int8, int16, uint8 and uint16 are widened to int32 (the
    bits of int32), and a type int32 cannot hold exactly (uint32; int64 and uint64 under jax_enable_x64) is a
    TypeError naming the argument, the dtype and int32, traced or not, never narrowed: int64 offsets [0, 2**32 + 5,
    2**32 + 50] read as [0, 5, 50], a uint32 length of 2**32 - 1 read as -1."""
    call, values = _op_on(argument)
    want = jax.jit(call)(jnp.asarray(values, jnp.int32))
    for dtype in (jnp.int8, jnp.int16, jnp.uint8, jnp.uint16):
        for got in (jax.jit(call)(jnp.asarray(values, dtype)), call(jnp.asarray(values, dtype))):
            for j, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
                assert_same_bits(a, b, f"{argument} of {np.dtype(dtype).name}: output {j}")
    wrapped = [0, 2**32 + 5, 2**32 + 50] if argument.startswith("cu") else [2**32 - 1, 40]  # read as [0, 5, 50], -1
    refused = [(jnp.uint32, values)] + [(t, v) for t in (jnp.int64, jnp.uint64) for v in (values, wrapped)]
    with jax.enable_x64(True):
        for dtype, v in refused:
            name = np.dtype(dtype).name
            match = (rf"^{argument} must be a jax array of int32 \(int8, int16, uint8 and uint16 are widened\), got "
                     rf"dtype {name}, which int32 cannot hold exactly: pass int32")
            array = jnp.asarray(v, dtype)
            assert array.dtype == dtype
            with pytest.raises(TypeError, match=match):
                jax.jit(call)(array)
            with pytest.raises(TypeError, match=match):
                call(array)  # concrete: refused too, as it was by its values
        with pytest.raises(TypeError, match=rf"^{argument} must be a jax array of int32 .* got dtype uint32"):
            jax.jit(call)(jnp.asarray([2**32 - 1, 40], jnp.uint32))
    # static values of any integer type are read exactly and checked
    for j, (a, b) in enumerate(zip(jax.tree.leaves(call(np.asarray(values, np.uint64))), jax.tree.leaves(want),
                                   strict=True)):
        assert_same_bits(a, b, f"static uint64 {argument}: output {j}")
    with pytest.raises(ValueError, match=rf"^{argument}"):
        call(np.asarray(wrapped, np.uint64))


@pytest.mark.parametrize("side", ["q", "k"])
def test_offsets_of_the_wrong_length_name_their_length(side):
    """Offsets with one entry too many or too few, traced or not: the error names them, their length and the length
    the accumulator was made for (or the other side's batch), never only the accumulator's batch."""
    layout, D = AccumLayout.row_major(), 64
    packed = jnp.zeros(layout.varlen_accum_shape(2, 2, 50, D), jnp.float32)  # (2, 12288): 3 entries at total 50
    for cu, entries, batch in (([0, 5, 50, 50], 4, 3), ([0, 50], 2, 1)):
        if side == "q":
            call = lambda c: dq_postprocess(packed, 0.5, head_dim=D, total_q=50, cu_seqlens_q=c, layout=layout)
            match = (rf"^dq_accum of shape \(2, 12288\) is not the packed accumulator of total_q=50 and cu_seqlens_q "
                     rf"of {entries} entries \(batch={batch}\): that is \(heads, Tp\*Dr\) = .*; the shape given is "
                     r"for cu_seqlens_q of 3 entries \(batch=2\) at total_q=50")
        else:  # beside a dense q side of batch 2, whose batch the k side must have
            q = jnp.zeros(layout.accum_shape(2, 4, 50, D), jnp.float32)
            call = lambda c: flash_attention_postprocess(q, packed, packed, 0.5, head_dim=D, dq_layout=layout,
                                                         dkv_layout=layout, seqlen_q=50, total_k=50, cu_seqlens_k=c)
            match = (rf"^the q and k sides must have the same batch: dq_accum has batch 2 but cu_seqlens_k has "
                     rf"{entries} entries \({batch} sequences\)")
        for offsets in (cu, jnp.asarray(cu, jnp.int32)):
            with pytest.raises(ValueError, match=match):
                call(offsets)
        with pytest.raises(ValueError, match=match):
            jax.jit(call)(jnp.asarray(cu, jnp.int32))
        call([0, 5, 50])  # the length the accumulator was made for
    # traced lengths beside traced offsets: their shape is checked against the offsets' length
    used = jnp.asarray([5, 5, 5], jnp.int32)
    with pytest.raises(ValueError, match=r"^seqused_q must have shape \(2,\) to match cu_seqlens_q of 3 entries, got "
                                         r"\(3,\)"):
        jax.jit(lambda c, u: dq_postprocess(packed, 0.5, head_dim=D, total_q=50, cu_seqlens_q=c, seqused_q=u,
                                            layout=layout))(jnp.asarray([0, 5, 50], jnp.int32), used)
