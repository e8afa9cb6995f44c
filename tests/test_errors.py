"""The public API's argument errors: each names the argument and the value, for dq_postprocess and
flash_attention_postprocess (its q side and its k side); offsets a host can read are validated (static ones here, jax
arrays outside jit: tests/test_varlen.py), traced ones are not (clamped, tests/test_postprocess.py)."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fa4_pair
from jax_dqpost import AccumLayout, dq_accum_from_dq, dq_postprocess, flash_attention_postprocess
from oracle import assert_same_bits, random_offsets

H, H_KV = 4, 2


def test_errors_name_argument_and_value():
    layout = AccumLayout(90, 64, 256, 1, False, 32)
    acc = jnp.zeros(layout.accum_shape(1, 1, 64, 128), jnp.float32)
    call = lambda **kw: dq_postprocess(**{**dict(dq_accum=acc, scale=1.0, seqlen_q=64, head_dim=128,
                                                 layout=layout), **kw})
    cases = [
        (dict(head_dim=100), ValueError, "head_dim .* got 100"),
        (dict(head_dim=264), ValueError, "head_dim .* got 264"),
        (dict(head_dim=128.0), TypeError, "head_dim must be a Python int, got 128.0"),
        (dict(seqlen_q=-1), ValueError, "seqlen_q must be >= 0, got -1"),
        (dict(seqlen_q=jnp.int32(64)), TypeError, "seqlen_q must be a Python int"),
        (dict(seqlen_q=65), ValueError, r"dq_accum.shape\[2\] must be Sr\*Dr = 128\*128"),
        (dict(dq_accum=acc.astype(jnp.bfloat16)), TypeError, "dq_accum must be float32, got bfloat16"),
        (dict(dq_accum=acc[0]), ValueError, r"dq_accum must have shape \(batch, heads, Sr\*Dr\), got shape"),
        (dict(dtype=jnp.float32), ValueError, r"^dtype must be jnp.bfloat16 or jnp.float16 \(or 'bf16', 'bfloat16', "
         r"'fp16', 'f16', 'float16'\), got float32"),
        (dict(dtype="half"), ValueError, r"^dtype must be .*'float16'\), got 'half' \(numpy's name for float16\)"),
        (dict(dtype="e"), ValueError, r"^dtype must be .*'float16'\), got 'e' \(numpy's name for float16\)"),
        (dict(dtype="f32"), ValueError, r"dtype must be jnp.bfloat16 .* got float32"),
        (dict(dtype=None), TypeError, r"dtype must be jnp.bfloat16 or jnp.float16 .*, got None \(NoneType\)"),
        (dict(dtype="bfloat17"), TypeError, r"dtype must be .* got 'bfloat17' \(str\)"),
        (dict(dtype="float64"), ValueError, r"dtype must be .*'float16'\), got float64"),
        (dict(scale=jnp.ones(2)), ValueError, r"scale must be a scalar, got shape \(2,\)"),
        (dict(scale=jnp.int32(1)), TypeError, "scale must be a Python float or a floating-point scalar, got .* int32"),
        (dict(scale=True), TypeError, r"scale must be a Python float .* got True \(bool\)"),
        (dict(scale="0.1"), TypeError, r"scale must be a Python float .* got '0.1' \(str\)"),
        (dict(scale=1j), TypeError, r"scale must be a Python float .* got 1j \(complex\)"),
        (dict(scale=None), TypeError, r"scale must be a Python float .* got None \(NoneType\)"),
        (dict(layout=(90, 64)), TypeError, r"layout must be an AccumLayout, got \(90, 64\) \(tuple\)"),
        (dict(layout=AccumLayout(90, 80, 256, 1, True, 32), head_dim=96), ValueError,
         "head_dim=96 .* 64-row WGMMA atoms"),
    ]
    for kwargs, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call(**kwargs)
        with pytest.raises(exc, match=pattern):  # the same error at trace time under jit
            jax.jit(lambda a: call(**{**kwargs, "dq_accum": kwargs.get("dq_accum", a)}))(acc)


def test_layout_is_required_and_the_error_says_how_to_get_one():
    """No default order: an accumulator read in another order gives wrong values, not an error."""
    import inspect

    from jax_dqpost import dq_accum_from_dq

    hint = (r"AccumLayout.flash_attention\(gpu, head_dim, causal=\.\.\., tensor='dq' or 'dkv', version=\.\.\.\) "
            r".*AccumLayout.row_major\(\)")
    layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
    acc = jnp.zeros(layout.accum_shape(1, 1, 64, 128), jnp.float32)
    dense = dict(seqlen_q=64, head_dim=128)
    calls = [(dq_postprocess, "layout", (acc, 1.0), dense),
             (dq_accum_from_dq, "layout", (jnp.zeros((1, 64, 1, 128), jnp.bfloat16), 1.0), {}),
             (flash_attention_postprocess, "dq_layout", (acc, None, None, 1.0), dense)]
    for fn, name, args, kwargs in calls:
        assert inspect.signature(fn).parameters[name].default is inspect.Parameter.empty, fn.__name__
        with pytest.raises(TypeError, match=rf"{fn.__name__}\(\) needs {name}=: the AccumLayout .*{hint}"):
            fn(*args, **kwargs)
        with pytest.raises(TypeError, match=rf"{name} must be an AccumLayout, got None \(NoneType\); {hint}"):
            fn(*args, **kwargs, **{name: None})


def test_static_validation_names_argument_and_value():
    # FlashAttention-4's hd128 dQ order
    layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
    acc = jnp.zeros((2, 128 * ((100 + 3 * 80 - 1) // 80 * 80)), jnp.float32)
    call = lambda **kw: dq_postprocess(acc, 1.0, **{**dict(head_dim=128, total_q=100, cu_seqlens_q=[0, 50, 100],
                                                           layout=layout), **kw})
    call()  # consistent
    cases = [
        (dict(cu_seqlens_q=[0, 60, 50]), ValueError,
         r"non-decreasing, got cu_seqlens_q\[1\]=60 > cu_seqlens_q\[2\]=50"),
        (dict(cu_seqlens_q=[-1, 50, 100]), ValueError, r"cu_seqlens_q\[0\] must be >= 0, got -1"),
        (dict(cu_seqlens_q=[0, 50, 101]), ValueError, r"cu_seqlens_q\[-1\]=101 exceeds total_q=100"),
        (dict(cu_seqlens_q=[]), ValueError, r"cu_seqlens_q must have batch \+ 1 entries \(at least 1\), got \[\]"),
        (dict(seqused_q=[10, 51]), ValueError, r"seqused_q\[1\]=51 must be in \[0, 50\]"),
        (dict(seqused_q=[10]), ValueError, r"seqused_q must have batch=2 entries, got 1"),
        (dict(cu_seqlens_q=[0.0, 50.0, 100.0]), TypeError, r"cu_seqlens_q must be a 1-D sequence of ints"),
        (dict(total_q=None), ValueError, r"total_q .* is required with cu_seqlens_q"),
        (dict(seqlen_q=100), ValueError, r"seqlen_q=100 is only for dense batches"),
        (dict(cu_seqlens_q=jnp.zeros(3, jnp.float32)), TypeError, r"cu_seqlens_q must be an integer array"),
        (dict(total_q=300, cu_seqlens_q=jnp.asarray([0, 50, 99])), ValueError,
         r"dq_accum of shape \(2, 40960\) is not the packed accumulator of total_q=300 and cu_seqlens_q of 3 "
         r"entries \(batch=2\): that is \(heads, Tp\*Dr\)"),
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


def test_an_accumulator_allocated_for_the_tiles_alone_is_refused_with_alloc_hdim_multiple_of():
    """With ``alloc_hdim_multiple_of`` the rows are ``Sr*Da`` (``Tp*Da`` packed): an accumulator of ``Sr*Dr``, as if
    allocated with the tiles' padding, is refused, the message saying Da; without it the messages say Dr."""
    layout = AccumLayout(90, 64, 128, 1, False, 16, alloc_hdim_multiple_of=32)  # head dim 72: Dr = 80, Da = 96
    tiles_only = jnp.zeros((1, 2, 128 * 80), jnp.float32)
    with pytest.raises(ValueError, match=r"^dq_accum.shape\[2\] must be Sr\*Da = 128\*96 = 12288 for seqlen_q=100, "
                                         r"head_dim=72 and AccumLayout\(.*alloc_hdim_multiple_of=32\); got shape "
                                         r"\(1, 2, 10240\)"):
        dq_postprocess(tiles_only, 1.0, seqlen_q=100, head_dim=72, layout=layout)
    assert dq_postprocess(jnp.zeros(layout.accum_shape(1, 2, 100, 72)), 1.0, seqlen_q=100, head_dim=72,
                          layout=layout).shape == (1, 100, 2, 72)
    with pytest.raises(ValueError, match=r"^dq_accum of shape \(2, 10240\) is not the packed accumulator of total_q=50 "
                                         r"and cu_seqlens_q of 2 entries \(batch=1\): that is \(heads, Tp\*Da\) = "
                                         r"\(heads, 128\*96\) for head_dim=72"):
        dq_postprocess(jnp.zeros((2, 128 * 80), jnp.float32), 1.0, head_dim=72, total_q=50, cu_seqlens_q=[0, 50],
                       layout=layout)
    with pytest.raises(ValueError, match=r"dk_accum.shape\[2\] must be Sr\*Da = 128\*96 "):
        flash_attention_postprocess(jnp.zeros(layout.accum_shape(1, 2, 100, 72)), tiles_only, tiles_only, 1.0,
                                    head_dim=72, seqlen_q=100, seqlen_k=100, dq_layout=layout, dkv_layout=layout)
    plain = AccumLayout(90, 64, 128, 1, False, 16)
    with pytest.raises(ValueError, match=r"^dq_accum.shape\[2\] must be Sr\*Dr = 128\*80 = 10240 "):
        dq_postprocess(jnp.zeros(layout.accum_shape(1, 2, 100, 72)), 1.0, seqlen_q=100, head_dim=72, layout=plain)


def test_errors_name_the_argument():
    dq_layout, dkv_layout, d, _ = fa4_pair("sm90-hd128")
    q = jnp.zeros(dq_layout.accum_shape(1, 4, 80, d), jnp.float32)
    k = jnp.zeros(dkv_layout.accum_shape(1, 2, 60, d), jnp.float32)
    base = dict(head_dim=d, dq_layout=dq_layout, dkv_layout=dkv_layout, seqlen_q=80, seqlen_k=60)
    cases = [
        (dict(dk_accum=None), ValueError, "dk_accum and dv_accum must be given together"),
        (dict(dkv_layout=None), TypeError, r"flash_attention_postprocess\(\) needs dkv_layout= with dk_accum and "
         r"dv_accum: the AccumLayout of the producer's accumulator"),
        (dict(dkv_layout="sm90"), TypeError, "dkv_layout must be an AccumLayout, got 'sm90'"),
        (dict(seqlen_k=None), ValueError, "seqlen_k is required"),
        (dict(cu_seqlens_k=[0, 10], seqlen_k=None, total_k=5), ValueError, r"cu_seqlens_k\[-1\]=10 exceeds total_k=5"),
        (dict(dk_accum=k.astype(jnp.bfloat16)), TypeError, "dk_accum must be float32, got bfloat16"),
        (dict(dk_scale="1"), TypeError, r"dk_scale must be a Python float .* got '1' \(str\)"),
        (dict(dv_accum=k[:, :1]), ValueError, "dk_accum and dv_accum disagree on batch, rows or heads"),
        (dict(learnable_sink=jnp.zeros(4)), ValueError, "missing lse, dpsum"),
        (dict(learnable_sink=jnp.zeros(4, jnp.int32), lse=jnp.zeros((1, 4, 80)), dpsum=jnp.zeros((1, 4, 80))),
         TypeError, r"^learnable_sink must be a float32, bfloat16, float16 or float64 \(read as float32\) array, got "
                    r"dtype int32$"),
        (dict(learnable_sink=jnp.zeros(4, jnp.float8_e4m3fn), lse=jnp.zeros((1, 4, 80)),
              dpsum=jnp.zeros((1, 4, 80))), TypeError, r"float64 \(read as float32\) array, got dtype float8_e4m3fn$"),
        (dict(learnable_sink=[0.0] * 4, lse=jnp.zeros((1, 4, 80)), dpsum=jnp.zeros((1, 4, 80))),
         TypeError, r"array, got \[0.0, 0.0, 0.0, 0.0\] \(list\)$"),
        (dict(learnable_sink=jnp.zeros(4), lse=jnp.zeros((1, 4, 79)), dpsum=jnp.zeros((1, 4, 128))),
         ValueError, r"lse must have shape \(1, 4, 80\)"),
        (dict(head_dim_v=100), ValueError, "head_dim_v must be a positive multiple of 8"),
    ]
    for change, err, match in cases:
        kw = dict(base, dk_accum=k, dv_accum=k)
        kw.update(change)
        dk_acc, dv_acc = kw.pop("dk_accum"), kw.pop("dv_accum")
        with pytest.raises(err, match=match):
            flash_attention_postprocess(q, dk_acc, dv_acc, 0.1, **kw)
    k3 = jnp.zeros(dkv_layout.accum_shape(1, 3, 60, d), jnp.float32)
    with pytest.raises(ValueError, match=r"key/value heads \(3\) must divide the query heads \(4\)"):
        flash_attention_postprocess(q, k3, k3, 0.1, **base)
    with pytest.raises(ValueError, match=r"^dkv_layout and seqlen_k apply only with dk_accum and dv_accum"):
        flash_attention_postprocess(q, None, None, 0.1, **base)
    with pytest.raises(ValueError, match=r"^head_dim_v and dk_scale apply only with dk_accum"):
        flash_attention_postprocess(q, None, None, 0.1, head_dim=d, dq_layout=dq_layout, seqlen_q=80, head_dim_v=64,
                                    dk_scale=1.0)


def test_kv_errors_name_the_arguments_passed():
    """dK/dV shape and offset errors name dk_accum/dv_accum, the k side's arguments and head_dim_v, never dQ's."""
    dq_layout, dkv_layout, d, _ = fa4_pair("sm90-hd128")
    k = jnp.zeros(dkv_layout.accum_shape(1, 2, 60, d), jnp.float32)
    v64 = jnp.zeros(dkv_layout.accum_shape(1, 2, 60, 64), jnp.float32)
    k_packed = jnp.zeros(dkv_layout.varlen_accum_shape(2, 2, 100, d), jnp.float32)
    v_packed = jnp.zeros(dkv_layout.varlen_accum_shape(2, 2, 100, 64), jnp.float32)
    dense = dict(seqlen_k=60)
    packed = dict(total_k=100, cu_seqlens_k=[0, 40, 100])
    cases = [
        ((k, k), dict(dense, seqlen_k=200), r"dk_accum.shape\[2\] must be Sr\*Dr = 256\*128 = 32768 for seqlen_k=200, "
         r"head_dim=128"),
        ((k, k), dict(dense, head_dim_v=64), r"dv_accum.shape\[2\] must be Sr\*Dr = 128\*64 = 8192 for seqlen_k=60, "
         r"head_dim_v=64"),
        ((k, v64), dict(dense, head_dim_v=96), r"dv_accum.shape\[2\] .* head_dim_v=96 and"),
        ((k[0], k), dense, r"dk_accum must have shape \(batch, heads, Sr\*Dr\), got shape \(2, 16384\)"),
        ((k, k), dict(dense, seqused_k=jnp.zeros(3, jnp.int32)),
         r"seqused_k must have shape \(1,\) \(dk_accum has batch 1\), got \(3,\)"),
        ((k, k), dict(dense, seqused_k=[61]), r"seqused_k\[0\]=61 must be in \[0, seqlen_k=60\]"),
        ((k_packed, k_packed), dict(packed, total_k=300),
         r"dk_accum of shape \(2, 49152\) is not the packed accumulator of total_k=300 and cu_seqlens_k of 3 entries "
         r"\(batch=2\): that is \(heads, Tp\*Dr\) = \(heads, 640\*128\) for head_dim=128"),
        ((k_packed, v_packed), dict(packed, head_dim_v=96),
         r"dv_accum of shape \(2, 24576\) is not the packed accumulator of total_k=100 and cu_seqlens_k of 3 entries "
         r"\(batch=2\): that is \(heads, Tp\*Dr\) = \(heads, 384\*96\) for head_dim_v=96"),
        ((k_packed, k_packed), dict(packed, cu_seqlens_k=jnp.asarray([0, 40, 100, 100])),
         r"dk_accum of shape \(2, 49152\) is not the packed accumulator of total_k=100 and cu_seqlens_k of 4 entries "
         r"\(batch=3\): that is \(heads, Tp\*Dr\) = \(heads, 512\*128\) .*; the shape given is for cu_seqlens_k of 3 "
         r"entries \(batch=2\) at total_k=100"),
        ((k_packed, k_packed), dict(packed, seqused_k=[41, 0]),
         r"seqused_k\[0\]=41 must be in \[0, 40\] .* in cu_seqlens_k"),
    ]
    for (dk_acc, dv_acc), kw, match in cases:
        batch = len(kw["cu_seqlens_k"]) - 1 if "cu_seqlens_k" in kw else 1  # dQ's, matching the k side's
        q = jnp.zeros(dq_layout.accum_shape(batch, 4, 80, d), jnp.float32)
        with pytest.raises(ValueError, match=match) as err:
            flash_attention_postprocess(q, dk_acc, dv_acc, 0.1, head_dim=d, dq_layout=dq_layout, dkv_layout=dkv_layout,
                                        seqlen_q=80, **kw)
        message = str(err.value)
        assert not re.search(r"dq_accum|seqlen_q|total_q|cu_seqlens_q|seqused_q", message), message
        if "dv_accum" in message:
            assert "head_dim=" not in message, message
    # The head dim dV's layout cannot hold is head_dim_v.
    dq_layout = AccumLayout.flash_attention(90, 256, causal=False, tensor="dq", version="4.0.0b36")
    dkv_layout = AccumLayout.flash_attention(90, 256, causal=False, tensor="dkv", version="4.0.0b36")
    q = jnp.zeros(dq_layout.accum_shape(1, 4, 80, 256), jnp.float32)
    k = jnp.zeros(dkv_layout.accum_shape(1, 2, 60, 256), jnp.float32)
    with pytest.raises(ValueError, match=r"^head_dim_v=64 \(padded to 64\) with AccumLayout\(arch=90, tile_m=48"):
        flash_attention_postprocess(q, k, k, 0.1, head_dim=256, head_dim_v=64, dq_layout=dq_layout,
                                    dkv_layout=dkv_layout, seqlen_q=80, seqlen_k=60)


def test_q_and_k_sides_must_have_the_same_batch(rng):
    """Every pairing of dense and packed sides: the batch of a dense accumulator, the sequences of a packed side
    (static or traced offsets); a mismatch names both. Matching batches pass, also under vmap (which folds a dense
    batch but not a packed side's sequences)."""
    dq_layout, dkv_layout, d, _ = fa4_pair("sm90-hd128")
    kw = dict(head_dim=d, dq_layout=dq_layout, dkv_layout=dkv_layout)

    def side(layout, heads, batch, packed, k):
        """(accumulator, keyword arguments) of a side with ``batch`` sequences of random lengths."""
        if not packed:
            acc = rng.standard_normal(layout.accum_shape(batch, heads, 50, d)).astype(np.float32)
            return acc, {f"seqlen_{k}": 50}
        cu = random_offsets(rng, batch, 60)
        acc = rng.standard_normal(layout.varlen_accum_shape(batch, heads, cu[-1], d)).astype(np.float32)
        return acc, {f"total_{k}": cu[-1], f"cu_seqlens_{k}": cu}

    what = {(False, "q"): "dq_accum has batch {0}", (True, "q"): "cu_seqlens_q has {1} entries ({0} sequences)",
            (False, "k"): "dk_accum has batch {0}", (True, "k"): "cu_seqlens_k has {1} entries ({0} sequences)"}
    for q_packed in (False, True):
        for k_packed in (False, True):
            q_batch, k_batch = (int(b) for b in rng.choice(np.arange(1, 5), 2, replace=False))
            q, q_kw = side(dq_layout, H, q_batch, q_packed, "q")
            k, k_kw = side(dkv_layout, H_KV, k_batch, k_packed, "k")
            match = re.escape("the q and k sides must have the same batch: "
                              + what[q_packed, "q"].format(q_batch, q_batch + 1) + " but "
                              + what[k_packed, "k"].format(k_batch, k_batch + 1))
            with pytest.raises(ValueError, match=match):
                flash_attention_postprocess(q, k, k, 0.5, **kw, **q_kw, **k_kw)
            traced = {n: v for n, v in {**q_kw, **k_kw}.items() if n.startswith("cu_")}
            if traced:  # the same error for traced offsets (their shape gives the number of sequences)
                static = {n: v for n, v in {**q_kw, **k_kw}.items() if n not in traced}
                f = jax.jit(lambda q, k, offsets: flash_attention_postprocess(q, k, k, 0.5, **kw, **static, **offsets))
                with pytest.raises(ValueError, match=match):
                    f(q, k, {n: jnp.asarray(v, jnp.int32) for n, v in traced.items()})
            # The same batch on both sides: accepted, and under vmap over the accumulators too.
            k, k_kw = side(dkv_layout, H_KV, q_batch, k_packed, "k")
            g = lambda q, k: flash_attention_postprocess(q, k, k, 0.5, **kw, **q_kw, **k_kw)
            one = g(q, k)
            mapped = jax.vmap(g)(np.stack([q, q]), np.stack([k, k]))
            for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(mapped), strict=True):
                assert_same_bits(b[0], a, f"vmap q_packed={q_packed} k_packed={k_packed}")


def _gqa_call(**kw):
    """flash_attention_postprocess on zero accumulators (FlashAttention-4's sm90 hd128 orders), keywords changed."""
    dq_layout, dkv_layout, d, _ = fa4_pair("sm90-hd128")
    args = dict(dq_accum=jnp.zeros(dq_layout.accum_shape(1, H, 80, d), jnp.float32),
                dk_accum=jnp.zeros(dkv_layout.accum_shape(1, H_KV, 60, d), jnp.float32), softmax_scale=0.5,
                head_dim=d, dq_layout=dq_layout, dkv_layout=dkv_layout, seqlen_q=80, seqlen_k=60)
    args.update(kw)
    args.setdefault("dv_accum", args["dk_accum"])
    return flash_attention_postprocess(args.pop("dq_accum"), args.pop("dk_accum"), args.pop("dv_accum"),
                                       args.pop("softmax_scale"), **args)


NOT_FINITE = [float("nan"), float("inf"), -float("inf"), 1e40, -3.5e38, 10**400, np.float64(1e39), np.float32("nan"),
              np.array(np.inf), jnp.asarray(jnp.nan), jnp.float32(-jnp.inf)]


@pytest.mark.parametrize("value", NOT_FINITE, ids=lambda v: repr(v)[:24])
def test_a_scale_the_host_sees_must_be_finite_in_float32(value):
    """nan, infinities and values that overflow float32 (a Python float, a numpy or a concrete jax scalar) are a
    ValueError naming the argument and the value, before any computation and with no numpy warning."""
    layout, _, d, _ = fa4_pair("sm90-hd128")
    acc = jnp.zeros(layout.accum_shape(1, H, 80, d), jnp.float32)
    if isinstance(value, (np.ndarray, jax.Array)):
        value_shown = repr(np.asarray(value).item())  # an array's value, read back
    else:
        value_shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    shown = re.escape(value_shown)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy overflow warning would fail here
        with pytest.raises(ValueError, match=rf"^scale must be finite in float32, got {shown}$"):
            dq_postprocess(acc, value, seqlen_q=80, head_dim=d, layout=layout)
        with pytest.raises(ValueError, match=rf"^softmax_scale must be finite in float32, got {shown}$"):
            _gqa_call(softmax_scale=value)
        with pytest.raises(ValueError, match=rf"^dk_scale must be finite in float32, got {shown}$"):
            _gqa_call(dk_scale=value)
        with pytest.raises(ValueError, match=rf"^scale must be finite in float32, got {shown}$"):
            dq_accum_from_dq(jnp.zeros((1, 80, H, d), jnp.bfloat16), value, layout=layout)
        jax.jit(lambda a: dq_postprocess(a, 3.4028234e38, seqlen_q=80, head_dim=d, layout=layout))(acc)  # finite


def test_a_traced_scale_is_used_as_it_is(rng):
    """The host cannot see a traced scale: a NaN one gives a NaN gradient (documented), no error."""
    layout, _, d, _ = fa4_pair("sm90-hd128")
    acc = jnp.asarray(rng.standard_normal(layout.accum_shape(1, H, 80, d)), jnp.float32)
    out = jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=80, head_dim=d, layout=layout))(acc, jnp.float32(jnp.nan))
    assert np.isnan(np.asarray(out, np.float32)).all()


def test_sizes_past_the_kernels_limits_are_refused_at_trace_time():
    """Rows that overflow the kernel's int32 offsets, dense or packed, on either side, and launches larger than
    CUDA's grid: a ValueError naming the argument from jax.eval_shape, on every platform (not at CUDA lowering)."""
    dq_layout, dkv_layout, d, _ = fa4_pair("sm90-hd128")
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    big = 2**31
    too_many = r"is too large: the accumulator's \d+ rows \(with padding\) do not fit the kernel's int32 row offsets"
    cases = [
        (lambda a: dq_postprocess(a, 1.0, seqlen_q=big, head_dim=d, layout=dq_layout),
         f32(dq_layout.accum_shape(1, 1, big, d)), rf"^seqlen_q=2147483648 {too_many}"),
        (lambda a: dq_postprocess(a, 1.0, total_q=big - 100, cu_seqlens_q=[0, 10], head_dim=d, layout=dq_layout),
         f32(dq_layout.varlen_accum_shape(1, 1, big - 100, d)), rf"^total_q=2147483548 {too_many}"),
        (lambda a: dq_postprocess(a, 1.0, total_q=big - 100, cu_seqlens_q=jnp.zeros(3, jnp.int32), head_dim=d,
                                  layout=dq_layout),
         f32(dq_layout.varlen_accum_shape(2, 1, big - 100, d)), rf"^total_q=2147483548 {too_many}"),
        (lambda a: _gqa_call(dk_accum=a, seqlen_k=big), f32(dkv_layout.accum_shape(1, H_KV, big, d)),
         rf"^seqlen_k=2147483648 {too_many}"),
        (lambda a: _gqa_call(dk_accum=a, seqlen_k=None, total_k=big, cu_seqlens_k=[0, 5], seqlen_q=None, total_q=80,
                             cu_seqlens_q=[0, 80], dq_accum=jnp.zeros(dq_layout.varlen_accum_shape(1, H, 80, d))),
         f32(dkv_layout.varlen_accum_shape(1, H_KV, big, d)), rf"^total_k=2147483648 {too_many}"),
        (lambda a: dq_postprocess(a, 1.0, seqlen_q=64, head_dim=d, layout=dq_layout),
         f32(dq_layout.accum_shape(70000, 1, 64, d)), r"^jax_dqpost: the batch .* must be at most 65535, CUDA's grid "
                                                      r"limit, got 70000"),
        (lambda a: dq_postprocess(a, 1.0, seqlen_q=2**24, head_dim=d, layout=dq_layout),
         f32(dq_layout.accum_shape(1, 2**14, 2**24, d)), r"^jax_dqpost: heads \* ceil\(rows / tile_m\) must be below "
                                                         r"2\^31, CUDA's grid limit, got heads=16384"),
    ]
    for fn, acc, match in cases:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(fn, acc)
    # vmap folds its axis into the batch: the folded call is checked too (2 x 40000 > 65535)
    dense = lambda a: dq_postprocess(a, 1.0, seqlen_q=64, head_dim=d, layout=dq_layout)  # noqa: E731
    jax.eval_shape(jax.vmap(dense), f32((2,) + dq_layout.accum_shape(30000, 1, 64, d)))
    with pytest.raises(ValueError, match=r"the batch \(with any vmapped axes folded in\) must be at most 65535, "
                                         r"CUDA's grid limit, got 80000"):
        jax.eval_shape(jax.vmap(dense), f32((2,) + dq_layout.accum_shape(40000, 1, 64, d)))
    # the largest dense side that fits: its padded rows are 2^31 - 32 (80-row tiles)
    fits = dq_layout.padded_seqlen(big - 100)
    assert fits <= big - 1
    jax.eval_shape(lambda a: dq_postprocess(a, 1.0, seqlen_q=big - 100, head_dim=d, layout=dq_layout),
                   f32(dq_layout.accum_shape(1, 1, big - 100, d)))


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "fp16", "f16", "float16"])
def test_dtype_names_in_either_spelling(rng, spelling):
    """The API takes a dtype or one of its names (``_arguments.OUT_DTYPE_SPELLINGS``: the README's bf16 and fp16, the
    kernel cache's f16, numpy's): the same bits."""
    layout, _, d, _ = fa4_pair("sm90-hd128")
    acc = jnp.asarray(rng.standard_normal(layout.accum_shape(1, H, 80, d)), jnp.float32)
    dtype = jnp.bfloat16 if spelling.startswith("b") else jnp.float16
    got = dq_postprocess(acc, 0.3, seqlen_q=80, head_dim=d, layout=layout, dtype=spelling)
    assert_same_bits(got, dq_postprocess(acc, 0.3, seqlen_q=80, head_dim=d, layout=layout, dtype=dtype), spelling)


# ---- first contact: the mistakes a new user makes, each refused with what to do -------------------
def test_export_for_cuda_needs_the_disabled_checks():
    """jax refuses to export our custom call for CUDA unless ``disabled_checks`` allow its target (jax tells a
    lowering nothing of the checks, so the refusal is jax's, naming the target); with
    ``jax_dqpost.DISABLED_CHECKS`` the export works, alone or beside other platforms."""
    from jax_dqpost import DISABLED_CHECKS
    from jax_dqpost.postprocess._primitive import ffi as _ffi

    layout = AccumLayout.row_major()
    spec = jax.ShapeDtypeStruct(layout.accum_shape(2, H, 64, 64), jnp.float32)
    op = lambda a: dq_postprocess(a, 0.5, head_dim=64, seqlen_q=64, layout=layout)
    for platforms, checks in ((["cuda"], ()), (["cpu", "cuda"], ()), (["cuda"], [c for c in DISABLED_CHECKS[1:]])):
        with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees") as caught:
            jax.export.export(jax.jit(op), platforms=platforms, disabled_checks=checks)(spec)
        assert _ffi.TARGET_NAME in str(caught.value)
    for platforms in (["cuda"], ["cpu", "cuda"]):
        exported = jax.export.export(jax.jit(op), platforms=platforms, disabled_checks=DISABLED_CHECKS)(spec)
        assert exported.platforms == tuple(platforms)


@pytest.mark.parametrize("argument", ["cu_seqlens_q", "seqused_q", "cu_seqlens_k"])
def test_a_list_of_traced_offsets_names_the_argument_and_what_to_do(argument):
    """A Python list passed through ``jax.jit`` arrives with traced items: the error names the argument and the two
    ways out, instead of jax's TracerArrayConversionError about an ``int32[]``."""
    dq_layout, dkv_layout, d, _ = fa4_pair("sm90-hd64")
    values = {"cu_seqlens_q": [0, 50, 100], "seqused_q": [40, 64], "cu_seqlens_k": [0, 30, 100]}[argument]

    def op(listed):
        q = (dict(total_q=100, cu_seqlens_q=listed) if argument == "cu_seqlens_q" else
             dict(seqlen_q=64, seqused_q=listed) if argument == "seqused_q" else dict(seqlen_q=64))
        k = dict(total_k=100, cu_seqlens_k=listed) if argument == "cu_seqlens_k" else dict(seqlen_k=64)
        q_shape = (dq_layout.varlen_accum_shape(2, H, 100, d) if "total_q" in q else dq_layout.accum_shape(2, H, 64, d))
        k_shape = (dkv_layout.varlen_accum_shape(2, H_KV, 100, d) if "total_k" in k
                   else dkv_layout.accum_shape(2, H_KV, 64, d))
        dk = jnp.zeros(k_shape, jnp.float32)
        return flash_attention_postprocess(jnp.zeros(q_shape, jnp.float32), dk, dk, 0.5, head_dim=d,
                                           dq_layout=dq_layout, dkv_layout=dkv_layout, **q, **k)

    op(values)  # outside jit the list is static
    with pytest.raises(TypeError, match=rf"^{argument} is a Python list of traced values .* pass a jax int32 array "
                                        r".*static_argnums or static_argnames of jax.jit"):
        jax.jit(op)(values)
    # beside a jax array on the same side (the other argument traced or concrete): the same error
    with pytest.raises(TypeError, match=r"^cu_seqlens_q is a Python list of traced values"):
        jax.jit(lambda cu: dq_postprocess(jnp.zeros(dq_layout.varlen_accum_shape(2, H, 100, d), jnp.float32), 0.5,
                                          head_dim=d, total_q=100, cu_seqlens_q=cu, seqused_q=jnp.asarray([5, 5]),
                                          layout=dq_layout))([0, 50, 100])
    with pytest.raises(TypeError, match=r"^seqused_q is a Python list of traced values"):
        jax.jit(lambda used: dq_postprocess(jnp.zeros(dq_layout.varlen_accum_shape(2, H, 100, d), jnp.float32), 0.5,
                                            head_dim=d, total_q=100, cu_seqlens_q=jnp.asarray([0, 50, 100]),
                                            seqused_q=used, layout=dq_layout))([5, 5])


def test_errors_under_vmap_speak_of_the_shapes_the_user_wrote():
    """vmap folds its axis into the batch; a mistake is still reported in one element's shapes."""
    layout = AccumLayout.row_major()
    acc = jnp.zeros((3,) + layout.accum_shape(2, H, 64, 64), jnp.float32)  # vmapped over 3, inner batch 2
    op = lambda a, used: dq_postprocess(a, 0.5, head_dim=64, seqlen_q=64, seqused_q=used, layout=layout)
    for used, axes in ((jnp.full((3, 3), 8, jnp.int32), (0, 0)), (jnp.full((3,), 8, jnp.int32), (0, None))):
        with pytest.raises(ValueError, match=r"seqused_q must have shape \(2,\) \(dq_accum has batch 2\), got \(3,\)"):
            jax.vmap(op, in_axes=axes)(acc, used)
    wrong = jnp.zeros((3, 2, H, 65 * 64), jnp.float32)
    with pytest.raises(ValueError, match=r"dq_accum.shape\[2\] must be Sr\*Dr = 64\*64 .* got shape \(2, 4, 4160\)"):
        jax.vmap(lambda a: dq_postprocess(a, 0.5, head_dim=64, seqlen_q=64, layout=layout))(wrong)


def test_a_layout_made_for_another_head_dim_says_so():
    """FlashAttention-4's sm90 dQ preset for head dim 128 used at 64: the error says which head dims the layout
    holds and whose preset it is."""
    for_128 = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
    acc = jnp.zeros((1, H, for_128.padded_seqlen(64) * 64), jnp.float32)
    with pytest.raises(ValueError, match=r"64-row WGMMA atoms .*\. This layout holds head dims 104\.\.128, 232\.\.256, "
                                         r"so it was probably made for another head dim \(it is FlashAttention-4's "
                                         r"preset for sm90 dQ at head dims 120\.\.128\): build the layout for "
                                         r"head_dim=64$"):
        dq_postprocess(acc, 1.0, head_dim=64, seqlen_q=64, layout=for_128)
    dkv_256 = AccumLayout.flash_attention(90, 256, causal=False, tensor="dkv", version="4.0.0b36")
    with pytest.raises(ValueError, match=r"holds head dims 72\.\.128, 200\.\.256, .* preset for sm90 dK/dV at "
                                         r"head dims 200\.\.256\): build the layout for head_dim_v=64$"):
        dkv_256.check_head_dim(64, "head_dim_v")
    with pytest.raises(ValueError, match=r"holds head dims 72\.\.128, 200\.\.256, so it was probably made for another "
                                         r"head dim: build the layout for head_dim=64$"):  # no preset's
        AccumLayout(90, 80, 256, 1, True, 64).check_head_dim(64)


@pytest.mark.parametrize("args, taken, shown", [
    ((0.125,), "dk_accum", r"0\.125 \(float\)"),
    ((0.125, None, None), "dk_accum", r"0\.125 \(float\)"),
    ((1,), "dk_accum", r"1 \(int\)"),
    ((np.float32(0.5),), "dk_accum", r"(np\.float32\()?0\.5\)? \(float32\)"),  # numpy 2's repr, or 1's
    ((jnp.float32(0.5),), "dk_accum", "a scalar of dtype float32"),
    ((None, 0.125, 0.125), "dv_accum", r"0\.125 \(float\)"),
])
def test_a_scale_where_an_accumulator_goes_says_what_it_was_taken_for(args, taken, shown):
    """``flash_attention_postprocess(dq_accum, 0.125, ...)``, meant for dQ alone: the error says the scale was taken
    as dk_accum (or dv_accum) and shows the call for dQ alone, instead of asking for dv_accum= and softmax_scale=."""
    layout = AccumLayout.row_major()
    acc = jnp.zeros(layout.accum_shape(1, H, 64, 64), jnp.float32)
    match = (rf"^flash_attention_postprocess\(\) took {shown} as {taken}, where an accumulator \(a float32 array, or "
             r"None\) goes: the accumulators come first, then softmax_scale; for dQ alone call "
             r"flash_attention_postprocess\(dq_accum, None, None, softmax_scale, \.\.\.\) or "
             r"dq_postprocess\(dq_accum, scale, \.\.\.\)")
    with pytest.raises(TypeError, match=match):
        flash_attention_postprocess(acc, *args, head_dim=64, seqlen_q=64, dq_layout=layout)
    with pytest.raises(TypeError, match=match):  # traced, the same
        jax.jit(lambda a: flash_attention_postprocess(a, *args, head_dim=64, seqlen_q=64, dq_layout=layout))(acc)
    dq = flash_attention_postprocess(acc, None, None, 0.125, head_dim=64, seqlen_q=64, dq_layout=layout).dq
    assert_same_bits(dq, dq_postprocess(acc, 0.125, head_dim=64, seqlen_q=64, layout=layout), "the call shown")
