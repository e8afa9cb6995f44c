"""Everything :mod:`jax_dqpost.fa4jax` takes from fa4-jax that is not its public API, in one place.

fa4-jax (https://github.com/nshepperd/fa4-jax, MIT) runs FlashAttention-4's CuTe DSL kernels from JAX through
cutejax. Its reverse mode is ``fa4_jax.kernels.CuteBackend.vjp``: a preprocess (``dpsum``, ``lse * log2 e`` and the
zeroed fp32 dQ accumulator), the main backward kernel (dQ accumulated with atomics; dK and dV written directly, or
for grouped-query attention accumulated in fp32 buffers zeroed by XLA), then one postprocess launch per
accumulator. :func:`accumulators` runs the first two steps exactly as fa4-jax does and stops there; the
postprocess is ours. :func:`forward` is fa4-jax's forward launch (``CuteBackend.fwd_lse``), with a learnable sink
one argument more, which the vendored forward kernels take (``learnable_sink=``) and fa4-jax's wrappers never pass;
:func:`tangent` its forward-mode kernel (``CuteBackend.tangent``) as it is.
Read from fa4-jax 0.1.0 (``src/fa4_jax/kernels.py``, ``attention.py``); any other version is refused, because these
names and the kernels' accumulator geometry are private to it.

The private names used, all of fa4-jax 0.1.0:

- ``fa4_jax.attention``: ``register_backend``, ``_make_config`` (its ``AttnConfig`` from the public arguments),
  ``_check_qkv`` (its shape and dtype checks).
- ``fa4_jax.kernels``: ``CuteBackend`` (subclassed; its ``_tree``, ``_in_specs``, ``_tree_aliases``,
  ``_out_struct``, ``_lse_struct`` build a launch; ``fwd_lse`` and ``tangent`` launch its kernels), ``_validate``
  (dtype, head dims, GPU: :func:`validate`), ``_device_arch``, ``_bwd_plan`` and ``_bwd_post_params`` (the tile plan and the postprocess orders), ``_get_static``,
  ``_aux_static``, ``_windows``, ``_aux_data`` (a launch's static tree), the ``@cute.jit`` entries
  ``_fa4_bwd_pre[_varlen]``, ``_fa4_bwd[_varlen][_dp]``, ``_fa4_bwd_gqa[_varlen]`` and the postprocess ones (which
  tests/test_fa4jax.py launches as fa4-jax does), and the specs ``_QKV_SPEC``, ``_QKV3_SPEC``, ``_F32_SPEC``, ``_LSE_SPEC``.
- The vendored forward kernel objects' ``__call__(..., learnable_sink=...)`` (``fa4_jax/cute/flash_fwd_sm90.py``,
  ``flash_fwd_sm100.py``): the sink in natural-log units, one per query head, not multiplied by the softmax scale;
  ``lse = log(sum_j exp(scale * s_j) + exp(sink))``, and a row with no key gets ``out = 0``, ``lse = sink``. The
  SM80 and SM120 forwards refuse a sink (:data:`SINK_FAMILIES`).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .._jax_internals import vary_as, varying_axes
from ..layout import padded_total

FA4JAX_VERSION = "0.1.0"
INSTALL_HINT = ("pip install fa4-jax==0.1.0 (Python >= 3.12 and a CUDA GPU; from this package's source tree: pip "
                "install '.[fa4-jax]')")


@functools.cache
def modules():
    """``(fa4_jax, fa4_jax.attention, fa4_jax.kernels, cutejax)``; ImportError naming the fix when fa4-jax is
    missing or another version."""
    try:
        import fa4_jax
    except ImportError as e:
        raise ImportError(f"jax_dqpost.fa4jax needs fa4-jax {FA4JAX_VERSION}, which is not installed ({e}): "
                          f"{INSTALL_HINT}") from None
    if fa4_jax.__version__ != FA4JAX_VERSION:
        raise ImportError(f"jax_dqpost.fa4jax is written against fa4-jax {FA4JAX_VERSION}'s internals, found "
                          f"fa4-jax {fa4_jax.__version__}: {INSTALL_HINT}")
    import cutejax
    from fa4_jax import attention, kernels
    return fa4_jax, attention, kernels, cutejax


def register_backend(name: str, backend) -> None:
    modules()[1].register_backend(name, backend)


def as_cute(cfg):
    """``cfg`` (fa4-jax's ``AttnConfig``) as fa4-jax's own kernel backend has it. fa4-jax keys its compiled kernels
    by the identity of a static tree cached per config, so every launch made with this config reuses the kernels
    fa4-jax compiled (or will compile) for its own backend."""
    return dataclasses.replace(cfg, backend="cute")


def config(q, *, causal=False, window_size=None, scale=None, varlen=False, defined_padding=False):
    """The ``AttnConfig`` fa4-jax's ``flash_attn``/``flash_attn_varlen`` build for its kernel backend from their
    arguments (no mask mod): causal and the window canonicalized as FlashAttention's interface does, the scale
    ``1/sqrt(head_dim)`` by default."""
    return modules()[1]._make_config(q, causal, window_size, scale, None, "cute", varlen,
                                     defined_padding=defined_padding)


def check_qkv(q, k, v, packed: bool) -> None:
    """fa4-jax's own checks of q, k, v (ranks, dtypes, heads, head dims), with its messages."""
    A = modules()[1]
    what = "packed (total_tokens, heads, head_dim)" if packed else "(batch, seqlen, heads, head_dim)"
    if q.ndim != 3 + (not packed) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"{'flash_attn_varlen' if packed else 'flash_attn'} takes {what} arrays, got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"batch mismatch: q {q.shape[0]} vs kv {k.shape[0]}")
    A._check_qkv(q, k, v)


def seqlens(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
    """The varlen operands as fa4-jax's ``flash_attn_varlen`` makes them, with its checks and messages:
    ``(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)``, int32, the used lengths the slots' where not given."""
    cu_q, cu_k = (jnp.asarray(cu) for cu in (cu_seqlens_q, cu_seqlens_k))
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be a 1D (batch + 1,) array with batch >= 1, got shape {cu.shape}")
        if not jnp.issubdtype(cu.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {cu.dtype}")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q/k batch mismatch: {cu_q.shape} vs {cu_k.shape}")
    cu_q, cu_k = cu_q.astype(jnp.int32), cu_k.astype(jnp.int32)
    batch = cu_q.shape[0] - 1
    used = []
    for name, su, cu in (("seqused_q", seqused_q, cu_q), ("seqused_k", seqused_k, cu_k)):
        if su is None:
            used.append(cu[1:] - cu[:-1])
            continue
        su = jnp.asarray(su)
        if su.ndim != 1 or su.shape[0] != batch:
            raise ValueError(f"{name} must be a 1D (batch,) array matching cu_seqlens (batch={batch}), got shape "
                             f"{su.shape}")
        if not jnp.issubdtype(su.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {su.dtype}")
        used.append(su.astype(jnp.int32))
    return cu_q, cu_k, *used


def validate(cfg, kind: str, q, k, v) -> None:
    """fa4-jax's own check that its ``kind`` (``"fwd"`` or ``"bwd"``) kernels run ``q``, ``k``, ``v`` (arrays or
    shape structs) on this GPU: dtype, head dims, the GPU, the tile's fit (``_validate``); ValueError with its
    message where they do not."""
    modules()[2]._validate(as_cute(cfg), kind, q, k, v)


def device_family() -> int:
    """The compute capability's major of the GPU fa4-jax runs on (9: Hopper), as fa4-jax reads it."""
    return modules()[2]._device_arch() // 10


SINK_FAMILIES = (9, 10, 11)
"""GPU families (compute capability majors) whose fa4-jax forward kernel takes a learnable sink: the wgmma (sm90)
and tcgen05 (sm100, sm110) ones; the SM80-MMA forward of sm80 and sm120 asserts that there is none."""


def _forward_with_sink(stream, tree, mO, mLSE):
    """fa4-jax's forward launch (its ``_fa4_fwd_lse``) with the sink: a ``@cute.jit`` entry once
    :func:`_forward_entry` wraps it."""
    K = modules()[2]
    wl, wr = K._windows(tree)
    tree["fa"](
        tree["q"], tree["k"], tree["v"], mO, mLSE, tree["scale"],
        mCuSeqlensQ=tree.get("cu_q"), mCuSeqlensK=tree.get("cu_k"),
        mSeqUsedQ=tree.get("su_q"), mSeqUsedK=tree.get("su_k"),
        window_size_left=wl, window_size_right=wr, learnable_sink=tree["sink"],
        aux_data=K._aux_data(tree), stream=stream,
    )


@functools.cache
def _forward_entry():
    """The ``@cute.jit`` entry of :func:`forward`, one object (cutejax keys its compiled kernels by it)."""
    from cutlass import cute

    return cute.jit(_forward_with_sink)


def forward(cfg, q, k, v, sink, seqlens):
    """fa4-jax's forward kernel, ``(out, lse)``, the natural-log lse: without a sink (``sink`` None) its
    ``CuteBackend.fwd_lse`` as it is; with a learnable sink ``sink`` (H,) the same launch (shapes, specs,
    ``defined_padding`` fills) given the sink, the lse including it."""
    _, _, K, cutejax = modules()
    backend = K.CuteBackend()
    cfg = as_cute(cfg)
    if sink is None:
        results = backend.fwd_lse(cfg, q, k, v, (), seqlens)
        return type(results)(_varying_as((q, k, v, *(seqlens or ())), *results))
    tree, specs = backend._tree(cfg, "fwd", q, k, v, (), seqlens, sink=sink)
    out_struct, lse_struct = backend._out_struct(q, v), backend._lse_struct(q, seqlens)
    aliases = None
    if cfg.defined_padding and seqlens is not None:  # donated: rows no sequence uses keep 0 and -inf
        tree["out0"] = jnp.zeros(out_struct.shape, out_struct.dtype)
        tree["lse0"] = jnp.full(lse_struct.shape, -jnp.inf, lse_struct.dtype)
        specs.update(out0=specs["q"], lse0=K._LSE_SPEC)
        aliases = backend._tree_aliases(tree, out0=0, lse0=1)
    results = cutejax.call(_forward_entry(), [out_struct, lse_struct], tree, in_specs=backend._in_specs(tree, specs),
                           out_specs=[specs["q"], K._LSE_SPEC], input_output_aliases=aliases,
                           name="jax_dqpost_fa4_fwd_sink" + ("_dp" if aliases else ""))
    return type(results)(_varying_as((q, k, v, sink, *(seqlens or ())), *results))


def tangent(cfg, q, k, v, out, lse, dq, dk, dv, seqlens):
    """fa4-jax's forward-mode kernel (``CuteBackend.tangent``) as it is: ``(t_out, t_lse)`` for the tangents
    ``dq``, ``dk``, ``dv``, the probabilities read from the forward's ``lse``."""
    _, _, K, _ = modules()
    results = K.CuteBackend().tangent(as_cute(cfg), q, k, v, out, lse, dq, dk, dv, (), seqlens)
    return type(results)(_varying_as((q, k, v, out, lse, dq, dk, dv, *(seqlens or ())), *results))


def _varying_as(inputs, *results) -> list:
    """``results`` of a cutejax call, which types them without ``jax.shard_map``'s varying manual axes, typed with
    the union of its ``inputs``' (``jax.lax.pcast``): what the kernel computes from varying inputs varies as they
    do, and ``jax_dqpost._attention.autodiff`` gives its tangents and cotangents its primals' types. Outside
    ``shard_map``, ``results`` as they are."""
    axes = frozenset().union(*(varying_axes(x) for x in inputs if x is not None))
    return [vary_as(r, axes) for r in results]


def cute_backend_class():
    """fa4-jax's kernel backend: ours reuses its forward, forward-mode tangent and validation."""
    return modules()[2].CuteBackend


class Accumulators(NamedTuple):
    """What fa4-jax's backward leaves for the postprocess (a pytree).

    ``dq_accum``: (B, H, Sr*Dr) dense or (H, Tp*Dr) packed. Without grouped-query attention the main kernel
    wrote ``dk``/``dv`` itself and ``dk_accum``/``dv_accum`` are None; with it, the reverse. ``dpsum``: the
    preprocess's ``rowsum(out * d_out)`` as the main kernel read it, (B, H, Sr) or (H, Tp). The head dim is padded to
    a multiple of 32 on every path (``_round_up(d, 32)``); the accumulators' orders are :func:`orders`'.
    """

    dq_accum: object
    dk: object
    dv: object
    dk_accum: object
    dv_accum: object
    dpsum: object


HDIM_MULTIPLE_OF = 32


def is_compile_error(error: BaseException) -> bool:
    """Whether ``error`` is the CuTe DSL failing to compile one of fa4-jax's kernels (an ``MLIRError``, or one of
    the DSL's own errors), which cutejax lets through as it is."""
    common = sys.modules.get("cutlass.base_dsl.common")
    dsl_error = getattr(common, "DSLBaseError", ())
    return type(error).__name__ == "MLIRError" or (bool(dsl_error) and isinstance(error, dsl_error))


def orders(cfg, q, k, v) -> tuple[tuple, tuple]:
    """The postprocess configurations fa4-jax derives from its tile plan for this call, ``(dq_order, dkv_order)``
    (``_bwd_post_params``)."""
    K = modules()[2]
    dtype, hd, hdv, ratio, arch = K._validate(as_cute(cfg), "bwd", q, k, v)
    plan = K._bwd_plan(dtype, hd, hdv, ratio, cfg.causal, cfg.local, arch)
    return K._bwd_post_params(plan, arch, "dq"), K._bwd_post_params(plan, arch, "dkv")


def accumulators(cfg, q, k, v, out, lse, d_out, aux, seqlens, dpsum_delta=None) -> Accumulators:
    """fa4-jax's preprocess and main backward kernel for ``(cfg, q, k, v, out, lse, d_out)``: the same calls,
    shapes, specs and buffer aliases as its ``CuteBackend.vjp``, without the postprocess. ``dpsum_delta`` (the
    preprocess's ``dpsum`` shape) is subtracted from ``dpsum`` before the main kernel reads it: the lse's cotangent
    (:func:`jax_dqpost._attention.autodiff.lse_cotangent_rows`)."""
    _, _, K, cutejax = modules()
    d_out = d_out.astype(q.dtype)
    # XLA's dynamic-slice fusion hands a custom call a view into the array an operand was sliced from (keys cut
    # inside the same jit: dot_product_attention with T < S). Around the main kernel, whose zero-filled
    # accumulators are donated, that fused call wrote dK and dV wrong under grouped-query attention (jax 0.11.2,
    # H100 and H200; fa4-jax's own backend alike). A barrier keeps each operand a whole array (one each: jax 0.10
    # asks the operands of one barrier to vary over the same manual axes).
    q, k, v, d_out = (jax.lax.optimization_barrier(x) for x in (q, k, v, d_out))
    inputs = (q, k, v, out, lse, d_out, *(seqlens or ()), dpsum_delta)  # the kernels' results vary as these do
    cfg = as_cute(cfg)
    dtype, hd, hdv, ratio, arch = K._validate(cfg, "bwd", q, k, v)
    plan = K._bwd_plan(dtype, hd, hdv, ratio, cfg.causal, cfg.local, arch)
    static = K._get_static(cfg, dtype, hd, hdv, ratio, arch, "bwd")
    pre = K._aux_static("pre", static["pre"], static["scale"])

    def struct(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype)

    def pad(x, to):
        return -(-x // to) * to

    packed = seqlens is not None
    qkv_spec = K._QKV3_SPEC if packed else K._QKV_SPEC
    if packed:
        total_q, h, d = q.shape
        total_k, h_kv, _ = k.shape
        batch = seqlens[0].shape[0] - 1
        rows_q, rows_k = padded_total(total_q, batch, plan.tile_m), padded_total(total_k, batch, plan.tile_n)
        lead_q, lead_k = (h,), (h_kv,)
    else:
        b, s_q, h, d = q.shape
        _, s_k, h_kv, _ = k.shape
        rows_q, rows_k = pad(s_q, plan.tile_m), pad(s_k, plan.tile_n)
        lead_q, lead_k = (b, h), (b, h_kv)
    d_v = v.shape[-1]
    dr, dvr = pad(d, HDIM_MULTIPLE_OF), pad(d_v, HDIM_MULTIPLE_OF)

    pre_outs = [struct((*lead_q, rows_q)), struct((*lead_q, rows_q)), struct((*lead_q, rows_q * dr))]
    if packed:
        cu_q, cu_k, su_q, su_k = seqlens
        dpsum, lse_log2, dq_accum = cutejax.call(
            K._fa4_bwd_pre_varlen, pre_outs, pre, out, d_out, lse, cu_q, su_q,
            in_specs=[qkv_spec, qkv_spec, K._LSE_SPEC, None, None], out_specs=K._F32_SPEC,
            name="fa4_bwd_pre_varlen")
    else:
        dpsum, lse_log2, dq_accum = cutejax.call(
            K._fa4_bwd_pre, pre_outs, pre, out, d_out, lse,
            in_specs=[qkv_spec, qkv_spec, K._LSE_SPEC], out_specs=K._F32_SPEC, name="fa4_bwd_pre")
    dpsum, lse_log2, dq_accum = _varying_as(inputs, dpsum, lse_log2, dq_accum)
    if dpsum_delta is not None:
        dpsum = dpsum - dpsum_delta

    tail = (*seqlens, tuple(aux)) if packed else (tuple(aux),)
    tail_specs = [None] * ((4 if packed else 0) + len(aux))
    suffix = "_varlen" if packed else ""
    if ratio == 1:
        if packed and cfg.defined_padding:  # dK/dV donated zero-filled: rows no sequence uses stay 0
            fn, name, given = K._fa4_bwd_varlen_dp, "fa4_bwd_varlen_dp", (jnp.zeros(k.shape, k.dtype),
                                                                          jnp.zeros(v.shape, v.dtype))
            aliases, given_specs = {6: 0, 7: 1, 8: 2}, [qkv_spec] * 2
        else:
            fn = K._fa4_bwd_varlen if packed else K._fa4_bwd
            name, given, aliases, given_specs = "fa4_bwd" + suffix, (), {6: 0}, []
        dq_accum, dk, dv = cutejax.call(
            fn, [struct(dq_accum.shape), struct(k.shape, k.dtype), struct(v.shape, v.dtype)],
            static, q, k, v, d_out, lse_log2, dpsum, dq_accum, *given, *tail,
            in_specs=[qkv_spec] * 4 + [K._F32_SPEC] * 3 + given_specs + tail_specs,
            out_specs=[K._F32_SPEC, qkv_spec, qkv_spec], input_output_aliases=aliases, name=name)
        dq_accum, dk, dv = _varying_as(inputs, dq_accum, dk, dv)
        return Accumulators(dq_accum, dk, dv, None, None, dpsum)
    dk_accum = jnp.zeros((*lead_k, rows_k * dr), jnp.float32)
    dv_accum = jnp.zeros((*lead_k, rows_k * dvr), jnp.float32)
    dq_accum, dk_accum, dv_accum = cutejax.call(
        K._fa4_bwd_gqa_varlen if packed else K._fa4_bwd_gqa,
        [struct(dq_accum.shape), struct(dk_accum.shape), struct(dv_accum.shape)],
        static, q, k, v, d_out, lse_log2, dpsum, dq_accum, dk_accum, dv_accum, *tail,
        in_specs=[qkv_spec] * 4 + [K._F32_SPEC] * 5 + tail_specs, out_specs=[K._F32_SPEC] * 3,
        input_output_aliases={6: 0, 7: 1, 8: 2}, name="fa4_bwd_gqa" + suffix)
    dq_accum, dk_accum, dv_accum = _varying_as(inputs, dq_accum, dk_accum, dv_accum)
    return Accumulators(dq_accum, None, None, dk_accum, dv_accum, dpsum)
