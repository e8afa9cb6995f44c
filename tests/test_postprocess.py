"""Both ops against the independent oracle (tests/oracle.py), as one matrix on every platform present.

The axes: the part of the postprocess (``dq``: dQ alone through ``dq_postprocess``, or with a sink through
``flash_attention_postprocess`` without dK/dV accumulators; ``dqkv``: dQ, dK and dV through
``flash_attention_postprocess``, grouped-query attention) x the learnable sink (none, or one of float32, bfloat16,
float16, with its gradient) x the packing (dense, dense with seqused, varlen, varlen with seqused) x the offsets
(static or traced) x the output dtype (bf16, fp16) x the accumulator layout. dq, dk and dv must have the oracle's
bits (one fp32 multiply, one rounding); dsink must be within tolerance of a float64 reference.

test_matches_oracle runs MATRIX, these axes' products written out: every (part, sink or none, packing, offsets)
combination. Without a sink, dense runs every layout in both dtypes (dQ alone at each of the layout's head dims and at
the tile boundaries); varlen runs each layout of VARLEN_A and VARLEN_B in both dtypes in each part, with seqused and
without, with static offsets and traced ones (all four combinations over the two parts). The layouts whose rows are
allocated wider than their tiles (ALLOC_LAYOUTS: the oracle fills the unread tail with garbage) run dense, dense with
seqused and varlen in both dtypes, dQ alone and with dK and dV. dQ alone runs every packing with every sink dtype.
FlashAttention-4's presets run at every head dim (test_presets_at_every_head_dim); rounding ties, scales, empty
shapes, corrupt traced offsets and many short sequences have their own tests, through both parts.

On CPU this checks the jax.numpy reference; where a CUDA GPU is present the same tests run the kernels, each output
written over a poisoned buffer (run).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FA4_PAIRS, FA_HOPPER_CONFIGS, FA_HOPPER_HEAD_DIM, HAS_GPU, OTHER_ORDERS, PLATFORMS, fa4_layouts
from jax_dqpost import AccumLayout, Gradients, dq_accum_from_dq, dq_postprocess, flash_attention_postprocess
import oracle
from support import cu_seqlens

PARTS = ("dq", "dqkv")
SINK_DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
PACKINGS = ("dense", "dense-seqused", "varlen", "varlen-seqused")
HEADS = {"dq": (3, None), "dq-fused": (3, None), "dqkv": (6, 3)}  # query heads, key/value heads


def _same(layout):
    return layout, layout


@dataclasses.dataclass(frozen=True)
class LayoutCase:
    """A producer's dQ order and dK/dV order, and the head dims to run them with (with dK and dV: dV's head dim
    is the next one of the list)."""
    dq: AccumLayout
    dkv: AccumLayout
    head_dims: tuple[int, ...]


CXX_LAYOUTS = tuple(name for name in FA_HOPPER_CONFIGS if name.startswith("cxx-"))  # FlashAttention-3's C++ Hopper
OTHER_LAYOUTS = ("sm80-swap", "sm80-cxx-hd64", "row-major")
LAYOUTS = {
    # FlashAttention-4's presets (dQ, dK/dV) on each GPU
    **{name: LayoutCase(*fa4_layouts(arch, hds[0], causal), hds) for name, (arch, causal, hds) in FA4_PAIRS.items()},
    # FlashAttention-3's C++ Hopper configurations and other orders (dK/dV in the same order)
    **{name: LayoutCase(*_same(AccumLayout(90, *FA_HOPPER_CONFIGS[name])), (FA_HOPPER_HEAD_DIM[name],))
       for name in CXX_LAYOUTS},
    **{name: LayoutCase(*_same(OTHER_ORDERS[name][0]), OTHER_ORDERS[name][1]) for name in OTHER_LAYOUTS},
    # Tiles of Dr = ceil(D / 16) * 16 in rows allocated for Da = ceil(D / 32) * 32 (flash-attn-4 4.0.0b36's sm90
    # backward), written out: one warpgroup (WGMMA atoms of 80 columns), two along the rows (16 and 48), two along
    # the head dim (56); dK/dV in its order, 128 x Dr over two warpgroups.
    **{name: LayoutCase(AccumLayout(90, *dq, False, 16, alloc_hdim_multiple_of=32),
                        AccumLayout(90, 128, 256, 2, False, 16, alloc_hdim_multiple_of=32), hds)
       for name, (dq, hds) in {"alloc32-hd72": ((64, 128, 1), (72, 80)), "alloc32-hd48": ((128, 256, 2), (16, 48)),
                               "alloc32-hd104": ((64, 256, 1), (104, 112))}.items()},
}
ALLOC_LAYOUTS = tuple(name for name in LAYOUTS if name.startswith("alloc32-"))
assert all(LAYOUTS[n].dq.padded_head_dim(d) < LAYOUTS[n].dq.alloc_head_dim(d) for n in ALLOC_LAYOUTS
           for d in LAYOUTS[n].head_dims)
assert [LAYOUTS[n].dq.mma_geometry(LAYOUTS[n].head_dims[0])["n_atom"] for n in ALLOC_LAYOUTS] == [80, 16, 56]
assert LAYOUTS["sm100-1cta"].dq == OTHER_ORDERS["sm100-1cta"][0] and LAYOUTS["sm120"].dq == OTHER_ORDERS["sm120"][0]
assert LAYOUTS["sm100-2cta"].dq == OTHER_ORDERS["sm100-2cta"][0]
assert {FA_HOPPER_CONFIGS[n] for n in FA_HOPPER_CONFIGS if n.startswith("cute-")} == {
    (c.dq.tile_m, c.dq.num_threads, c.dq.atom_layout, c.dq.swap_ab, c.dq.hdim_multiple_of)
    for n, c in LAYOUTS.items() if n.startswith("sm90-")}

OUT_DTYPES = ("bf16", "f16")

# The layouts every varlen combination runs, in two halves. A: the swapped and the plain Hopper orders (short tiles or
# not), the mma.sync and the row-major orders; B: a single warpgroup, a head dim padded to 64, 2-CTA tcgen05
# (clustered dK/dV) and dV's own head dim.
VARLEN_A = ("sm90-hd128", "sm90-hd64", "sm120", "row-major")
VARLEN_B = ("sm90-hd96", "cxx-hd256-swap", "sm100-2cta", "sm90-hd192-dv128")


def _run(part, sink, packing, offsets, dtype, layout):
    """One of test_matches_oracle's parameters (a sink: a SINK_DTYPES name, or None)."""
    ident = "-".join([part, f"sink_{sink}" if sink else "nosink", packing]
                     + ([offsets] if packing != "dense" else []) + [dtype, layout])
    return pytest.param(part, sink, packing, offsets, dtype, layout, id=ident)


def _product(parts, sinks, packings, offsets, dtypes, layouts):
    """A run of every combination of the values of each axis."""
    return [_run(*values) for values in itertools.product(parts, sinks, packings, offsets, dtypes, layouts)]


MATRIX = [
    # Dense, no sink: every layout in both dtypes; with dK and dV, FlashAttention-4's pairs in both dtypes and the
    # orders whose dK/dV is their dQ order in one (FlashAttention-3's C++ ones in bf16, the others in fp16).
    *_product(["dq"], [None], ["dense"], ["static"], OUT_DTYPES, LAYOUTS),
    *_product(["dqkv"], [None], ["dense"], ["static"], OUT_DTYPES, FA4_PAIRS),
    *_product(["dqkv"], [None], ["dense"], ["static"], ["bf16"], CXX_LAYOUTS),
    *_product(["dqkv"], [None], ["dense"], ["static"], ["f16"], OTHER_LAYOUTS),
    *_product(["dqkv"], [None], ["dense"], ["static"], OUT_DTYPES, ALLOC_LAYOUTS),
    # Dense with seqused, no sink: both parts with static and traced lengths, in a Hopper and a Blackwell order.
    *_product(PARTS, [None], ["dense-seqused"], ["static", "traced"], ["bf16"], ["sm90-hd128"]),
    *_product(PARTS, [None], ["dense-seqused"], ["static", "traced"], ["f16"], ["sm100-2cta"]),
    # ... and the rows allocated wider than the tiles, in both dtypes, in each part (dQ alone static, dQ, dK and dV
    # traced)
    *_product(["dq"], [None], ["dense-seqused"], ["static"], OUT_DTYPES, ALLOC_LAYOUTS),
    *_product(["dqkv"], [None], ["dense-seqused"], ["traced"], OUT_DTYPES, ALLOC_LAYOUTS),
    # Varlen, no sink: in each part every layout of VARLEN_A and VARLEN_B in both dtypes, once with seqused and once
    # without, once with static offsets and once with traced ones. dQ alone pairs seqused with traced offsets in A and
    # with static ones in B, dQ, dK and dV the other way round: every part runs all four (packing, offsets), every
    # layout meets all four.
    *_product(["dq"], [None], ["varlen"], ["static"], ["bf16"], VARLEN_A),
    *_product(["dq"], [None], ["varlen-seqused"], ["traced"], ["f16"], VARLEN_A),
    *_product(["dq"], [None], ["varlen"], ["traced"], ["bf16"], VARLEN_B),
    *_product(["dq"], [None], ["varlen-seqused"], ["static"], ["f16"], VARLEN_B),
    *_product(["dqkv"], [None], ["varlen"], ["traced"], ["f16"], VARLEN_A),
    *_product(["dqkv"], [None], ["varlen-seqused"], ["static"], ["bf16"], VARLEN_A),
    *_product(["dqkv"], [None], ["varlen"], ["static"], ["f16"], VARLEN_B),
    *_product(["dqkv"], [None], ["varlen-seqused"], ["traced"], ["bf16"], VARLEN_B),
    # The rows allocated wider than the tiles, in both dtypes: dQ alone without seqused, dQ, dK and dV with it.
    *_product(["dq"], [None], ["varlen"], ["static"], OUT_DTYPES, ALLOC_LAYOUTS),
    *_product(["dqkv"], [None], ["varlen-seqused"], ["traced"], OUT_DTYPES, ALLOC_LAYOUTS),
    # A sink: dQ alone with static offsets runs every packing with every sink dtype, ...
    *_product(["dq"], SINK_DTYPES, ["dense"], ["static"], ["bf16"], ["sm90-hd128"]),
    *_product(["dq"], SINK_DTYPES, ["dense-seqused"], ["static"], ["f16"], ["cxx-hd256-swap"]),
    *_product(["dq"], SINK_DTYPES, ["varlen"], ["static"], ["f16"], ["sm90-hd128-causal"]),
    *_product(["dq"], SINK_DTYPES, ["varlen-seqused"], ["static"], ["bf16"], ["sm100-2cta"]),
    # ... and every other (part, packing, offsets) runs once, each in a layout of its own.
    _run("dq", "f32", "dense-seqused", "traced", "bf16", "sm80-swap"),
    _run("dq", "bf16", "varlen", "traced", "f16", "row-major"),
    _run("dq", "f16", "varlen-seqused", "traced", "bf16", "sm90-hd256"),
    _run("dqkv", "f32", "dense", "static", "bf16", "sm90-hd64"),
    _run("dqkv", "f16", "dense-seqused", "static", "f16", "cxx-hd192-3wg"),
    _run("dqkv", "bf16", "dense-seqused", "traced", "bf16", "sm100-1cta"),
    _run("dqkv", "f32", "varlen", "static", "f16", "sm80-cxx-hd64"),
    _run("dqkv", "f16", "varlen", "traced", "bf16", "sm90-hd192-dv128"),
    _run("dqkv", "bf16", "varlen-seqused", "static", "f16", "sm90-hd96"),
    _run("dqkv", "f32", "varlen-seqused", "traced", "bf16", "cxx-hd96"),
    # A sink with rows allocated wider than the tiles (dpsum has Sr or Tp rows, not Sr*Da / Dr).
    _run("dq", "f32", "varlen", "static", "bf16", "alloc32-hd72"),
    _run("dqkv", "bf16", "dense", "static", "f16", "alloc32-hd104"),
]
assert len({p.id for p in MATRIX}) == len(MATRIX), "a run written twice"
assert {(p.values[0], p.values[1] is None, *p.values[2:4]) for p in MATRIX} == {
    (part, no_sink, packing, offsets) for part in PARTS for no_sink in (True, False) for packing in PACKINGS
    for offsets in (("static",) if packing == "dense" else ("static", "traced"))}, "a combination missing"


# ---- building a call: accumulators of each side from the oracle, the op's keyword arguments, the expected outputs

@dataclasses.dataclass
class Side:
    """One sequence side (q: dQ; k: dK and dV): its accumulators, expected outputs, keyword arguments of the op
    (static ones, and offsets that are operands when traced) and, packed, the rows the sink reads."""
    accs: list
    wants: list
    static: dict
    traced: dict
    rows: dict


def _side(rng, k, layout, heads, head_dims, scales, dtype, packing, offsets, *, batch, seqlen=None, lengths=None,
          given=None):
    """Side ``k`` ("q" or "k"): one accumulator per head dim/scale. Dense: ``batch`` sequences of ``seqlen`` rows
    (with seqused: random lengths, 0 and ``seqlen`` among them); packed: sequences of ``lengths`` rows, some rows
    after the last (with seqused: random lengths, the first whole). ``given``: the offsets and lengths instead,
    ``(cu_seqlens, seqused, total)`` (any values: the oracle clamps them as documented)."""
    used = None if given is None else given[1]
    if packing.startswith("dense"):
        if packing == "dense-seqused" and given is None:
            used = [0, seqlen] + [int(x) for x in rng.integers(0, seqlen + 1, batch - 2)]
        static = {f"seqlen_{k}": seqlen}
        sides = [oracle.dense_case(rng, layout, (batch, seqlen, heads, d), s, dtype, seqused=used)
                 for d, s in zip(head_dims, scales)]
        rows = dict(seqused=used)
        offsets_kw = {}
    else:
        if given is not None:
            cu, used, total = given
        else:
            cu = cu_seqlens(lengths).tolist()
            total = cu[-1] + int(rng.integers(1, 40))  # rows no sequence covers
        if packing == "varlen-seqused" and given is None:
            used = oracle.random_seqused(rng, cu)
            used[0] = lengths[0]
        static = {f"total_{k}": total}
        sides = [oracle.varlen_case(rng, layout, cu, used, total, heads, d, s, dtype)
                 for d, s in zip(head_dims, scales)]
        rows = dict(seqused=used, cu=cu, total=total, pad=layout.pad_rows)
        offsets_kw = {f"cu_seqlens_{k}": cu}
    if used is not None:
        offsets_kw[f"seqused_{k}"] = used
    traced = {}
    for name, value in offsets_kw.items():
        if offsets == "static":
            static[name] = value
        else:
            traced[name] = np.asarray(value, np.int32)
    return Side([a for a, _ in sides], [w for _, w in sides], static, traced, rows)


@dataclasses.dataclass
class Call:
    """One call of an op: ``fn(*operands)`` must return ``wants`` (arrays: bit for bit; a tuple ``(want, magnitude,
    dtype)``: dsink within tolerance)."""
    fn: Callable
    operands: list
    wants: list
    what: str


def make_call(rng, part, sink, packing, offsets, dtype, layout: LayoutCase, head_dim, head_dim_v=None, *,
              seqlens=(None, None), lengths=(None, None), given=(None, None), batch=2, heads=None, scales=None,
              static_scales=False):
    """A call of ``part`` on random accumulators in ``layout``'s orders: random scales (or ``scales``, dQ's and dK's:
    operands, or Python floats with ``static_scales``), a sink of type ``sink`` (a SINK_DTYPES name) or none;
    ``seqlens``, ``lengths``, ``given``: of the q side and of the k side (:func:`_side`); ``heads``: query and
    key/value heads (default HEADS[part])."""
    dtype = {"bf16": jnp.bfloat16, "f16": jnp.float16}.get(dtype, dtype)
    heads, kv_heads = HEADS[part] if heads is None else heads
    scale, k_scale = (float(rng.uniform(0.05, 2.0)) for _ in range(2)) if scales is None else scales
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q = _side(rng, "q", layout.dq, heads, (head_dim,), (scale,), dtype, packing, offsets, batch=batch,
              seqlen=seqlens[0], lengths=lengths[0], given=given[0])
    sides = [q]
    if part == "dqkv":
        sides.append(_side(rng, "k", layout.dkv, kv_heads, (head_dim, head_dim_v), (k_scale, 1.0), dtype, packing,
                           offsets, batch=batch, seqlen=seqlens[1], lengths=lengths[1], given=given[1]))
    accs = [a for s in sides for a in s.accs]
    wants = [w for s in sides for w in s.wants]
    static = {k: v for s in sides for k, v in s.static.items()}
    traced = {k: v for s in sides for k, v in s.traced.items()}
    names = list(traced)
    operands = accs + [np.float32(scale), np.float32(k_scale)] + [traced[n] for n in names]
    if sink is not None:
        sink_dtype = SINK_DTYPES[sink]
        if packing.startswith("dense"):
            s_q = seqlens[0]
            shapes = (batch, heads, s_q), (batch, heads, layout.dq.padded_seqlen(s_q)), 1
        else:
            total = q.rows["total"]
            tp = layout.dq.varlen_accum_shape(len(q.rows["cu"]) - 1, heads, total, head_dim)[1]
            shapes = (heads, total), (heads, tp // layout.dq.alloc_head_dim(head_dim)), 0
        sink_in = oracle.sink_inputs(rng, heads, sink_dtype, *shapes)
        want, magnitude = oracle.expected_dsink(*sink_in, **q.rows)
        wants.append((want, magnitude, sink_dtype))
        operands += list(sink_in)
    n_acc = len(accs)

    def fn(*ops):
        acc, (s, ks), rest = ops[:n_acc], ops[n_acc:n_acc + 2], ops[n_acc + 2:]
        if static_scales:
            s, ks = scale, k_scale
        kw = dict(static, **dict(zip(names, rest[:len(names)])))
        if sink is not None:
            kw.update(zip(("learnable_sink", "lse", "dpsum"), rest[len(names):]))
        if part == "dq" and sink is None:
            out = dq_postprocess(acc[0], s, head_dim=head_dim, dtype=dtype, layout=layout.dq, **kw)
            assert isinstance(out, jax.Array), type(out)
            return [out]
        if part in ("dq", "dq-fused"):  # no dK/dV accumulators: dQ (and dsink) alone, dk and dv None
            out = flash_attention_postprocess(acc[0], None, None, s, head_dim=head_dim, dtype=dtype,
                                              dq_layout=layout.dq, **kw)
            assert out.dk is None and out.dv is None, out
        else:
            out = flash_attention_postprocess(*acc, s, head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype,
                                              dq_layout=layout.dq, dkv_layout=layout.dkv, dk_scale=ks, **kw)
        assert type(out) is Gradients and (out.dsink is None) == (sink is None), out
        return [x for x in out if x is not None]

    what = (f"{part} sink={sink} {packing} {offsets} {np.dtype(dtype).name} D={head_dim} Dv={head_dim_v} "
            f"S={seqlens} lengths={lengths} {static}")
    return Call(fn, operands, wants, what)


# ---- running calls: one program per test, each output over a poisoned buffer where a kernel writes it



def run(platform, calls: list[Call]):
    """The outputs of ``calls``, computed by one jitted program on ``platform``.

    Where a kernel runs (not on CPU: the reference has no buffer to leave unwritten) every output is aliased to a
    donated buffer of NaN bits: an element the kernel does not write shows."""
    device = jax.devices(platform)[0]
    counts = [len(c.operands) for c in calls]

    def program(*ops):
        outs, at = [], 0
        for c, n in zip(calls, counts):
            outs.append(c.fn(*ops[at:at + n]))
            at += n
        return outs

    operands = [jax.device_put(x, device) for c in calls for x in c.operands]
    if platform == "cpu":
        return jax.jit(program)(*operands)
    avals = jax.tree.leaves(jax.eval_shape(program, *operands))
    poison = [jax.device_put(np.full(a.shape, oracle.POISON_BITS[a.dtype.itemsize],
                                     f"uint{8 * a.dtype.itemsize}").view(a.dtype), device) for a in avals]
    addresses = [p.unsafe_buffer_pointer() for p in poison]
    # keep_unused: jit would drop the unused poison, and with it the aliasing
    outs = jax.jit(lambda poison, *ops: program(*ops), donate_argnums=0, keep_unused=True)(poison, *operands)
    written = [o.unsafe_buffer_pointer() for o in jax.tree.leaves(outs)]
    missed = [j for j, (w, a) in enumerate(zip(written, addresses)) if w != a]
    assert not missed, f"XLA did not write outputs {missed} of {len(avals)} into their donated poisoned buffers"
    return outs


def check(platform, calls: list[Call]):
    for call, outs in zip(calls, run(platform, calls)):
        assert len(outs) == len(call.wants), (call.what, len(outs))
        for j, (got, want) in enumerate(zip(outs, call.wants)):
            what = f"{platform} {call.what} output {j}"
            if isinstance(want, tuple):
                oracle.assert_dsink_close(got, *want, what=what)
            else:
                oracle.assert_same_bits(got, want, what)


def _dense_seqlens(layout: LayoutCase, i, n):
    """Sequence lengths of dense call ``i`` of ``n``: a partial tile, exactly one tile and several tiles (one head
    dim: three calls) or just short of a tile and past two tiles (several head dims: two calls each)."""
    p = layout.dq.pad_rows
    return (1, p, 3 * p - 5)[i % 3] if n == 1 else (p - 1, 2 * p + 3)[i // n], None


def _varlen_lengths(rng, batch):
    """Lengths of a packed batch: empty sequences, one row, a few rows, several tiles, random ones."""
    fixed = [0, 7, 0, 300, 1, 0]
    return ([int(x) for x in rng.integers(0, 301, batch - len(fixed))] + fixed,
            [int(x) for x in rng.permutation(fixed + [int(x) for x in rng.integers(0, 301, batch - len(fixed))])])


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part, sink, packing, offsets, dtype, layout", MATRIX)
def test_matches_oracle(rng, platform, part, sink, packing, offsets, dtype, layout):
    case = LAYOUTS[layout]
    hds = case.head_dims
    call = functools.partial(make_call, rng, part, sink, packing, offsets, dtype, case)
    if packing == "dense" and part == "dq" and sink is None:
        # every head dim of the layout, at the tile boundaries
        n_seq = 3 if len(hds) == 1 else 2
        calls = [call(hds[i % len(hds)], seqlens=_dense_seqlens(case, i, len(hds))) for i in range(len(hds) * n_seq)]
    elif packing.startswith("dense"):
        # one call: random lengths; dQ and dK at the layout's first head dim in bf16, its second in fp16
        i = ("bf16", "f16").index(dtype) % len(hds)
        seqlens = (int(rng.integers(1, 3 * case.dq.pad_rows)), int(rng.integers(1, 3 * case.dkv.pad_rows)))
        calls = [call(hds[i], hds[(i + 1) % len(hds)], seqlens=seqlens, batch=2 if packing == "dense" else 4)]
    else:
        calls = [call(hds[0], hds[-1], lengths=_varlen_lengths(rng, 9), batch=9)]
        if packing == "varlen" and part == "dq":  # a single sequence
            calls.append(call(hds[0], lengths=([2 * case.dq.pad_rows + 3], None), batch=1))
    check(platform, calls)


# FlashAttention-4's presets at every head dim they are defined for (arch 90), or at the head dims its backward
# runs with (100, 120): a random causal flag and length each.
PRESET_HEAD_DIMS = {90: tuple(range(8, 257, 8)), 100: (8, 40, 64, 72, 96, 120, 128, 136, 192),
                    120: (8, 40, 64, 72, 96, 120, 128, 136, 192, 200, 256)}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("arch, dtype, part", [  # dQ, dK and dV: Hopper's presets, in one dtype
    (arch, dtype, part) for arch in sorted(PRESET_HEAD_DIMS) for dtype in ("bf16", "f16") for part in PARTS
    if part == "dq" or (arch, dtype) == (90, "bf16")])
def test_presets_at_every_head_dim(rng, platform, part, dtype, arch):
    """dQ at every head dim; with dK and dV, dK at every head dim and dV at the next one where the preset's dK/dV
    layout takes it (every head dim once). On sm90 this includes 4.0.0b36's tiles of 16-column multiples in rows
    allocated for 32 (head dims 8, 16, 40, 48, 72, 80, 104, 112); at 104 and 112 its backward runs only causal (the
    non-causal presets raise ValueError)."""
    calls, rest, padded = [], list(PRESET_HEAD_DIMS[arch]), []
    while rest:
        d = rest.pop(0)
        causal = bool(rng.integers(2))
        if arch == 90 and d in (104, 112):
            with pytest.raises(ValueError, match=f"does not run at head_dim={d} with causal=False"):
                fa4_layouts(arch, d, causal=False)
            causal = True
        case = LayoutCase(*fa4_layouts(arch, d, causal=causal), (d,))
        dv = d
        if part == "dqkv":
            dv = next((x for x in rest if _takes(case.dkv, x)), d)
            rest.remove(dv) if dv != d else None
        seqlens = (int(rng.integers(1, 2 * case.dq.pad_rows)), int(rng.integers(1, 2 * case.dkv.pad_rows)))
        calls.append(make_call(rng, part, None, "dense", "static", dtype, case, d, dv, seqlens=seqlens, batch=1))
        # the head dims run with rows allocated wider than the tiles (dQ's, dK's and dV's)
        runs = [(case.dq, d)] + ([(case.dkv, d), (case.dkv, dv)] if part == "dqkv" else [])
        padded += [x for layout, x in runs if layout.alloc_head_dim(x) != layout.padded_head_dim(x)]
    assert sorted(set(padded)) == ([8, 16, 40, 48, 72, 80, 104, 112] if arch == 90 else []), padded
    check(platform, calls)


def _takes(layout, head_dim):
    try:
        layout.check_head_dim(head_dim)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0**-7, 1 / 3])
def test_rounding_ties_and_specials(rng, platform, part, scale):
    """Both dtypes; scale 1 and powers of two keep the constructed bf16/fp16 ties exact ties (dQ's and dK's scale)."""
    case = LAYOUTS["sm90-hd128-causal"]
    check(platform, [make_call(rng, part, None, "dense", "static", dtype, case, 128, seqlens=(200, 150),
                               scales=(scale, scale)) for dtype in ("bf16", "f16")])


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part", PARTS)
def test_scales_static_or_traced(rng, platform, part):
    """Python float scales and traced float32 ones give the same bits: a float64 Python scale (0.1 is not a float32)
    is rounded to float32 once, like FlashAttention's kernel argument (the oracle multiplies by float32(scale))."""
    case = LAYOUTS["sm90-hd64"]
    check(platform, [make_call(rng, part, None, "dense", "static", "bf16", case, 64, seqlens=(70, 90),
                               scales=(0.1, 0.3), static_scales=static) for static in (False, True)])


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part", PARTS)
def test_empty_shapes(platform, part):
    device = jax.devices(platform)[0]
    q_layout, kv_layout = fa4_layouts(90, 64)
    for b, h, s, h_kv, s_k in [(0, 2, 10, 1, 7), (2, 0, 10, 1, 7), (2, 2, 0, 1, 7), (2, 2, 10, 1, 0)]:
        q = jax.device_put(jnp.zeros(q_layout.accum_shape(b, h, s, 64), jnp.float32), device)
        if part == "dq":
            if s_k == 0:
                continue
            out = jax.jit(lambda a: dq_postprocess(a, 1.0, seqlen_q=s, head_dim=64, layout=q_layout))(q)
            assert out.shape == (b, s, h, 64)
            continue
        k = jax.device_put(jnp.zeros(kv_layout.accum_shape(b, h_kv, s_k, 64), jnp.float32), device)
        out = jax.jit(lambda q, k: flash_attention_postprocess(q, k, k, 1.0, head_dim=64, dq_layout=q_layout,
                                                               dkv_layout=kv_layout, seqlen_q=s, seqlen_k=s_k))(q, k)
        assert [o.shape for o in out[:3]] == [(b, s, h, 64), (b, s_k, h_kv, 64), (b, s_k, h_kv, 64)]
        assert out.dsink is None


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("offsets", ["static", "traced"])
def test_a_packed_batch_of_no_sequences(rng, platform, part, offsets):
    """One rule for both packings: a dense batch of 0 gives an empty result (test_empty_shapes), a packed one
    (``cu_seqlens=[0]``) its ``total`` rows, all zeros (no sequence covers them), and a dsink of 0; with the k side
    packed the same way. Its transpose (``dq_accum_from_dq``, the accumulators' gradient) is all zeros."""
    case = LAYOUTS["sm90-hd128"]
    given = (([0], None, 77), ([0], None, 50))
    calls = [make_call(rng, part, sink, "varlen", offsets, dtype, case, 128, given=given, batch=0)
             for sink, dtype in ((None, "bf16"), ("f32", "f16"))]
    check(platform, calls)
    device = jax.devices(platform)[0]
    plain = calls[0]
    operands = [jax.device_put(x, device) for x in plain.operands]
    n_acc = 1 if part == "dq" else 3
    loss = lambda *accs: sum(jnp.sum(o.astype(jnp.float32)) for o in plain.fn(*accs, *operands[n_acc:]))  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(n_acc))))(*operands[:n_acc])
    for j, grad in enumerate(grads):
        assert grad.shape == operands[j].shape and not np.asarray(grad).any(), f"accumulator {j}'s gradient"
    cu = [0] if offsets == "static" else jnp.asarray([0], jnp.int32)
    acc = jax.jit(lambda x: dq_accum_from_dq(x, 2.0, cu_seqlens_q=cu, layout=case.dq))(
        jax.device_put(jnp.ones((77, 3, 128), jnp.bfloat16), device))
    assert acc.shape == case.dq.varlen_accum_shape(0, 3, 77, 128) and not np.asarray(acc).any()


# Offsets and lengths that break the contract, traced (unchecked): decreasing offsets, offsets past total_q and past
# the accumulator, a negative start, lengths too long or negative, huge values, everything empty.
CORRUPT = [([0, 300, 100, 350], None), ([0, 100, 5000, 200000], None), ([-50, 30, 60, 90], [10, 1000, -3]),
           ([2**30, 2**31 - 1, 0, 10], [5, 5, 5]), ([400, 0, 0, 0], None)]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("packing", ["dense-seqused", "varlen"])
def test_corrupt_traced_offsets_are_clamped(rng, platform, part, packing):
    """The result is the documented clamped partition (the oracle's), computed without touching memory out of
    bounds (on the GPU: poisoned outputs here, compute-sanitizer in tests/gpu_check.sh). With dK and dV the k side
    gets the next case of the list."""
    case = LAYOUTS["sm90-hd128"]
    if packing == "varlen":
        given = [((cu, used, 400), (*CORRUPT[(i + 1) % len(CORRUPT)], 300)) for i, (cu, used) in enumerate(CORRUPT)]
        calls = [make_call(rng, part, None, "varlen", "traced", "bf16", case, 128, given=g, batch=3) for g in given]
    else:  # lengths past the sequence, negative, huge: clamped to [0, S]
        corrupt = [-5, 10**6, 3, 2**31 - 1]
        calls = [make_call(rng, part, None, packing, "traced", "bf16", case, 128, seqlens=(200, 150), batch=4,
                           given=((None, corrupt, None), (None, corrupt[::-1], None)))]
    check(platform, calls)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("part, offsets", [("dq", "static"), ("dq", "traced"), ("dqkv", "traced")])
def test_many_short_sequences(rng, platform, part, offsets):
    """2000 sequences of 0..12 rows (more than FlashAttention's binary-search threshold), rows after the last."""
    case = LAYOUTS["sm90-hd128"]
    lengths = ([int(x) for x in rng.integers(0, 13, 2000)], [int(x) for x in rng.integers(0, 13, 2000)])
    check(platform, [make_call(rng, part, None, "varlen", offsets, "bf16", case, 128, lengths=lengths, batch=2000,
                               heads=(2, 1))])


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("sink", [None, "f32"])
@pytest.mark.parametrize("packing", ["dense", "varlen"])
def test_without_dk_and_dv_the_fused_op_is_dq_alone(rng, platform, sink, packing):
    """flash_attention_postprocess with no dK/dV accumulators (no grouped-query attention): dq (and dsink) as the
    oracle has them, dk and dv None."""
    case = LAYOUTS["sm90-hd96"]
    kw = dict(seqlens=(150, None)) if packing == "dense" else dict(lengths=(_varlen_lengths(rng, 9)[0], None), batch=9)
    check(platform, [make_call(rng, "dq-fused", sink, packing, "static", "f16", case, 96, **kw)])


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("packing", ["dense", "varlen"])
def test_dsink_same_bits_in_every_launch(rng, packing):
    """The GPU reduces dsink in an order that does not depend on the launch: the same bits with dQ alone, with dK and
    dV, and run again. (On CPU a float32 sum of the same jnp function: nothing to check.)"""
    case, d = LAYOUTS["sm90-hd64"], 64
    heads, kv_heads = HEADS["dqkv"]
    if packing == "dense":
        q_acc, _ = oracle.dense_case(rng, case.dq, (2, 300, heads, d), 1.0, jnp.bfloat16)
        k_acc, _ = oracle.dense_case(rng, case.dkv, (2, 200, kv_heads, d), 1.0, jnp.bfloat16)
        sink = oracle.sink_inputs(rng, heads, np.float32, (2, heads, 300), (2, heads, case.dq.padded_seqlen(300)), 1)
        q_kw, k_kw = dict(seqlen_q=300), dict(seqlen_k=200)
    else:
        cu_q, cu_k = oracle.random_offsets(rng, 9, 300), oracle.random_offsets(rng, 9, 300)
        q_acc, _ = oracle.varlen_case(rng, case.dq, cu_q, None, cu_q[-1], heads, d, 1.0, jnp.bfloat16)
        k_acc, _ = oracle.varlen_case(rng, case.dkv, cu_k, None, cu_k[-1], kv_heads, d, 1.0, jnp.bfloat16)
        tp = case.dq.varlen_accum_shape(9, heads, cu_q[-1], d)[1] // case.dq.alloc_head_dim(d)
        sink = oracle.sink_inputs(rng, heads, np.float32, (heads, cu_q[-1]), (heads, tp), 0)
        q_kw = dict(total_q=cu_q[-1], cu_seqlens_q=cu_q)
        k_kw = dict(total_k=cu_k[-1], cu_seqlens_k=cu_k)
    sk = dict(zip(("learnable_sink", "lse", "dpsum"), sink))
    alone = jax.jit(lambda q: flash_attention_postprocess(q, None, None, 0.5, head_dim=d, dq_layout=case.dq,
                                                          **q_kw, **sk).dsink)
    fused = jax.jit(lambda q, k: flash_attention_postprocess(q, k, k, 0.5, head_dim=d, dq_layout=case.dq,
                                                             dkv_layout=case.dkv, **q_kw, **k_kw, **sk).dsink)
    runs = [alone(q_acc), fused(q_acc, k_acc), fused(q_acc, k_acc)]
    bits = [np.asarray(x).view(np.uint32) for x in runs]
    assert all(np.array_equal(bits[0], b) for b in bits[1:]), bits
