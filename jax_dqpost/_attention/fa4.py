"""FlashAttention-4 through fa4-jax's kernels, its backward finished by jax-dqpost: what
``implementation='fa4'`` (:mod:`jax_dqpost.attention.fa4`) and the public :mod:`jax_dqpost.fa4jax` run.

:func:`flash`: with or without a learnable sink, the ``jax.custom_jvp`` of :mod:`jax_dqpost._attention.autodiff`
around fa4-jax's forward kernel (given the sink), its forward-mode kernel, and its backward's preprocess and main
kernel (:data:`KERNELS`), the backward ending in one jax-dqpost launch. The accumulators' orders come from
fa4-jax's tile plan (:func:`accum_layout`). :func:`register` also registers :data:`BACKEND` with fa4-jax, for
``jax_dqpost.fa4jax.flash_attn`` without a sink, which takes fa4-jax's every argument (a ``mask_mod`` too): fa4-jax's
kernel backend but for its reverse mode's last step, one :func:`~jax_dqpost.flash_attention_postprocess` launch.

Head dims 136..160 on Hopper (sm90) run zero-padded to :data:`PADDED_HEAD_DIM` (:func:`run_padded`): fa4-jax
0.1.0's kernels do not compile there with CuTe DSL 4.8, and its dK/dV order under grouped-query attention is one
our kernel does not take; zero columns add nothing to ``q k^T`` and their outputs and gradients are sliced off.
Where JAX's default backend is not a GPU, :func:`attention` is FlashAttention's attention in jax.numpy
(:func:`jax_dqpost._attention.xla.flash_attention`).

:func:`context_attention`: one device's rows of context parallelism on these kernels, the keys of every device
given (:mod:`jax_dqpost._attention.context`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import autodiff, context, fa4jax_internals, xla
from .._kernel import arch
from ..layout import ORDER_OF_FAMILY, AccumLayout

BACKEND = "jax_dqpost"
"""The name this backend has in fa4-jax's backend registry."""

PADDED_HEAD_DIM = 192
"""The head dim that head dims 136..160 run at on Hopper (see the module docstring)."""
_PADDED = {9: range(136, 161)}  # GPU family (compute capability major) -> the head dims run padded there


def padded_head_dims(head_dim: int, head_dim_v: int, family: int) -> tuple[int, int]:
    """``(head_dim, head_dim_v)`` as fa4-jax's kernels run them on GPUs of compute capability ``family`` (9:
    Hopper): both :data:`PADDED_HEAD_DIM` or the larger where either is one they do not compile for, else as given."""
    padded = _PADDED.get(family, ())
    if head_dim in padded or head_dim_v in padded:
        return (max(PADDED_HEAD_DIM, head_dim, head_dim_v),) * 2
    return head_dim, head_dim_v


@contextlib.contextmanager
def _compiling(q, v):
    """Turn fa4-jax's kernels failing to compile into a ValueError naming the head dims (no compiler traceback)."""
    try:
        yield
    except Exception as e:
        if not fa4jax_internals.is_compile_error(e):
            raise
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ValueError(
            f"jax_dqpost.fa4jax: fa4-jax's FlashAttention-4 kernels do not compile for head_dim={q.shape[-1]}, "
            f"head_dim_v={v.shape[-1]} ({q.dtype}) on {_gpu()} with the installed CuTe DSL: {first}") from None


def _gpu() -> str:
    devices = arch.cuda_devices()
    return f"sm_{str(devices[0].compute_capability).replace('.', '')}" if devices else "this GPU"


def accum_layout(order: tuple) -> AccumLayout:
    """The :class:`AccumLayout` of an accumulator fa4-jax's backward wrote, from the postprocess configuration
    fa4-jax derives from its tile plan: ``(order_arch, tile_rows, num_threads, atom_layout, swap_ab)`` (its
    ``_bwd_post_params``). ``order_arch`` names the kernel family whose MMA wrote it (9x wgmma; 8x and 12x the
    mma.sync kernel, also where it is the fallback on sm90; 10x/11x tcgen05, one CTA); fa4-jax pads every head
    dim to a multiple of 32."""
    order_arch, rows, threads, atom_layout, swap_ab = order
    family = ORDER_OF_FAMILY.get(int(order_arch) // 10)
    if family is None:
        raise ValueError(f"fa4-jax postprocess configuration {order!r}: no accumulator order for arch {order_arch}")
    return AccumLayout(family, rows, threads, atom_layout, bool(swap_ab), fa4jax_internals.HDIM_MULTIPLE_OF,
                       two_cta=False, cluster_size=1)


def _layouts(cfg, q, k, v):
    """``(dq_layout, dkv_layout or None)`` of the accumulators fa4-jax's backward writes for this call (dK/dV's
    under grouped-query attention alone), each checked against the head dims it holds."""
    dq_order, dkv_order = fa4jax_internals.orders(cfg, q, k, v)
    return layouts(dq_order, dkv_order if q.shape[-2] != k.shape[-2] else None, q.shape[-1], v.shape[-1])


def layouts(dq_order: tuple, dkv_order: tuple | None, head_dim: int, head_dim_v: int):
    """``(dq_layout, dkv_layout or None)`` of fa4-jax's postprocess configurations (:func:`accum_layout`; dkv_order
    None: the main kernel writes dK and dV), each checked against the head dims it holds: ValueError naming them
    where our kernel does not take the order."""
    dq_layout = accum_layout(dq_order)
    dkv_layout = None if dkv_order is None else accum_layout(dkv_order)
    d, d_v = head_dim, head_dim_v
    for what, layout, head_dim in (("dQ", dq_layout, d), ("dK", dkv_layout, d), ("dV", dkv_layout, d_v)):
        try:
            if layout is not None:
                layout.check_head_dim(head_dim)
        except ValueError as e:
            raise ValueError(
                f"jax_dqpost.fa4jax cannot finish fa4-jax's {what} accumulator for head_dim={d}, head_dim_v={d_v} on "
                f"this GPU, written in an order jax-dqpost's kernel does not take: {e}; "
                "fa4_jax.flash_attn(..., backend='cute') runs this configuration with fa4-jax's own postprocess"
            ) from None
    return dq_layout, dkv_layout


@functools.cache
def register():
    """Register :data:`BACKEND` with fa4-jax (once; :func:`flash_attn` and :func:`flash_attn_varlen` do it
    themselves). Returns ``fa4_jax``.
    Raises ImportError when fa4-jax 0.1.0 is not installed."""
    fa4_jax = fa4jax_internals.modules()[0]

    cute = fa4jax_internals.cute_backend_class()

    class Backend(cute):
        """fa4-jax's kernel backend, its kernels shared with fa4-jax's own, and jax-dqpost's postprocess."""

        def fwd(self, cfg, q, k, v, *args, **kwargs):
            with _compiling(q, v):
                return super().fwd(fa4jax_internals.as_cute(cfg), q, k, v, *args, **kwargs)

        def fwd_lse(self, cfg, q, k, v, *args, **kwargs):
            with _compiling(q, v):
                return super().fwd_lse(fa4jax_internals.as_cute(cfg), q, k, v, *args, **kwargs)

        def tangent(self, cfg, q, k, v, *args, **kwargs):
            with _compiling(q, v):
                return super().tangent(fa4jax_internals.as_cute(cfg), q, k, v, *args, **kwargs)

        def vjp(self, cfg, q, k, v, out, lse, d_out, d_lse, aux, seqlens=None):
            dq_layout, dkv_layout = _layouts(cfg, q, k, v)
            delta = None if d_lse is None else autodiff.lse_cotangent_rows(d_lse, dq_layout, seqlens)
            with _compiling(q, v):
                acc = fa4jax_internals.accumulators(cfg, q, k, v, out, lse, d_out, aux, seqlens, delta)
            dq, dk, dv, _ = autodiff.finish(acc, q, k, v, seqlens, scale=cfg.scale, dq_layout=dq_layout,
                                            dkv_layout=dkv_layout)
            return dq, dk, dv

    fa4jax_internals.register_backend(BACKEND, Backend())
    return fa4_jax


def run_padded(attention, q, k, v, *args, **kwargs):
    """``attention(q, k, v, *args, **kwargs)`` at the head dims fa4-jax's kernels compile for (padded where they do
    not: the module docstring)."""
    family = arch.gpu_family()
    d, d_v = q.shape[-1], v.shape[-1]
    to, to_v = padded_head_dims(d, d_v, family)
    if (to, to_v) != (d, d_v):
        def pad(x, n):
            return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])

        q, k, v = pad(q, to), pad(k, to), pad(v, to_v)
        kwargs = {**kwargs, "scale": d ** -0.5 if kwargs.get("scale") is None else kwargs["scale"]}
    result = attention(q, k, v, *args, **kwargs)
    if to_v == d_v:
        return result
    if kwargs.get("return_lse"):
        return result[0][..., :d_v], result[1]
    return result[..., :d_v]


def check_sink_gpu(family: int):
    """ValueError unless FlashAttention-4's forward takes a learnable sink on GPUs of compute capability ``family``."""
    if family not in fa4jax_internals.SINK_FAMILIES:
        raise ValueError(f"learnable_sink: FlashAttention-4's forward on {_gpu()} (compute capability {family}.x) "
                         "takes no learnable sink; the sm90 (Hopper) and sm100/sm110 ones do")


def unavailable(q, k, v, *, window_size, scale, packed: bool, sink: bool) -> str | None:
    """Why this module's kernels cannot run attention of these shapes on this machine (None: they can), before
    anything compiles: fa4-jax missing, the GPU, or what FlashAttention-4's forward and backward kernels and our
    postprocess take. ``q``, ``k``, ``v``: dense ``(B, S, H, D)`` arrays or shape structs (``packed``: run as one
    packed batch)."""
    try:
        fa4jax_internals.modules()
    except ImportError as e:
        return str(e)
    if not on_gpu():
        return f"fa4-jax's kernels run on NVIDIA GPUs, and JAX's default backend is {jax.default_backend()!r}"
    family = fa4jax_internals.device_family()
    if sink and family not in fa4jax_internals.SINK_FAMILIES:
        return (f"FlashAttention-4's forward on {_gpu()} takes no learnable sink (the sm90 and sm100/sm110 ones "
                "do)")
    d, d_v = padded_head_dims(q.shape[-1], v.shape[-1], family)

    def struct(x, last):
        shape = (x.shape[0] * x.shape[1], *x.shape[2:-1], last) if packed else (*x.shape[:-1], last)
        return jax.ShapeDtypeStruct(shape, x.dtype)

    q, k, v = struct(q, d), struct(k, d), struct(v, d_v)
    cfg = fa4jax_internals.config(q, window_size=window_size, scale=scale, varlen=packed)
    try:
        for kind in ("fwd", "bwd"):
            fa4jax_internals.validate(cfg, kind, q, k, v)
        _layouts(cfg, q, k, v)
    except ValueError as e:
        return str(e)
    return None


def flash(packed: bool):
    """The attention, with or without a learnable sink, as :func:`run_padded` calls it: the ``jax.custom_jvp``
    whose backward ends in one jax-dqpost launch (:mod:`jax_dqpost._attention.autodiff`)."""

    def attention(q, k, v, *cu_seqlens, learnable_sink=None, causal=False, window_size=None, scale=None,
                  return_lse=False, seqused_q=None, seqused_k=None, defined_padding=False):
        seqlens = fa4jax_internals.seqlens(*cu_seqlens, seqused_q, seqused_k) if packed else None
        cfg = fa4jax_internals.config(q, causal=causal, window_size=window_size, scale=scale, varlen=packed,
                                       defined_padding=defined_padding)
        dq_layout, dkv_layout = _layouts(cfg, q, k, v)
        spec = autodiff.AttentionSpec(KERNELS, cfg, cfg.scale, dq_layout, dkv_layout)
        out, lse = autodiff.attention(spec, q, k, v, learnable_sink, seqlens)
        return (out, lse) if return_lse else out

    return attention


class _Kernels:
    """fa4-jax's kernels as :mod:`jax_dqpost._attention.autodiff`'s producer: its forward kernel (given the sink),
    its forward-mode kernel, its backward's preprocess and main kernel, as they are (compile failures as
    :func:`_compiling` words them)."""

    def forward(self, cfg, q, k, v, sink, seqlens):
        with _compiling(q, v):
            return fa4jax_internals.forward(cfg, q, k, v, sink, seqlens)

    def tangent(self, cfg, q, k, v, out, lse, dq, dk, dv, seqlens):
        with _compiling(q, v):
            return fa4jax_internals.tangent(cfg, q, k, v, out, lse, dq, dk, dv, seqlens)

    def accumulators(self, cfg, q, k, v, out, lse, d_out, dpsum_delta, seqlens):
        with _compiling(q, v):
            return fa4jax_internals.accumulators(cfg, q, k, v, out, lse, d_out, (), seqlens, dpsum_delta)

    def context(self, spec, q, k, v):
        """``(call, packed)`` a device runs for its rows ``q`` ``(B, c, N, D)`` of a dense self-attention, every
        key ``k``, ``v`` ``(B, S, K, D|Dv)`` given (``jax.jit`` with the sequence sharded: ``autodiff._own_rows``):
        without a mask ``spec`` itself; under a causal mask or a window ``(left, 0)`` the same on a packed batch,
        each sequence reading its keys up to its own last row; None for another mask, or where the packed kernels
        do not run it."""
        cfg = spec.config
        if cfg.varlen or cfg.mask is not None:
            return None
        if not (cfg.causal or cfg.local):
            return spec, False
        if cfg.local and cfg.window[1] != 0:
            return None
        packed = dataclasses.replace(cfg, varlen=True, defined_padding=True)  # 0 in keys past a sequence's end
        q, k, v = (jax.ShapeDtypeStruct((x.shape[0] * x.shape[1], *x.shape[2:]), x.dtype) for x in (q, k, v))
        try:
            for kind in ("fwd", "bwd"):
                fa4jax_internals.validate(packed, kind, q, k, v)
            dq_layout, dkv_layout = _layouts(packed, q, k, v)
        except ValueError:
            return None
        return autodiff.AttentionSpec(self, packed, spec.scale, dq_layout, dkv_layout), True


KERNELS = _Kernels()


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU, where fa4-jax's kernels run; elsewhere the calls of this module run
    FlashAttention's attention in jax.numpy."""
    return jax.default_backend() == "gpu"


def attention(q, k, v, *, scale: float, window: tuple, sink=None, return_lse: bool = False, seqlens=None):
    """FlashAttention's attention of checked operands: dense q ``(B, S, H, D)``, k ``(B, Sk, Hkv, D)``, v ``(B, Sk,
    Hkv, Dv)``, or packed (``seqlens`` = ``(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)``, int32, a used
    length None for all) q ``(T, H, D)``, k and v ``(Tk, Hkv, D|Dv)``; ``window`` ``(left, right)`` bottom-right
    (None sides unbounded); ``sink`` float32 ``(H,)`` or None. Returns out (and the float32 lse ``(B, H, S)`` or
    ``(H, T)`` with ``return_lse``): on a GPU fa4-jax's kernels (the caller has checked that they run the call:
    :func:`unavailable`), elsewhere the same attention in jax.numpy."""
    packed = seqlens is not None
    if not on_gpu():
        out, lse = xla.flash_attention(q, k, v, scale=scale, window=xla.flash_window(False, window), sinks=sink,
                                       seqlens=fa4jax_internals.seqlens(*seqlens) if packed else None)
        return (out, lse) if return_lse else out
    options = dict(window_size=window, scale=scale, return_lse=return_lse)
    cu = seqlens[:2] if packed else ()
    if packed:
        options.update(seqused_q=seqlens[2], seqused_k=seqlens[3], defined_padding=True)
    return run_padded(flash(packed), q, k, v, *cu, learnable_sink=sink, **options)


def context_attention(q, k, v, *, layout: str, devices: int, index, scale: float, window: tuple, sink=None,
                      return_lse: bool = False, halo: int | None = None):
    """Device ``index``'s (an int or a traced ``axis_index``) rows of context-parallel attention over ``devices``
    devices: q ``(B, T, N, D)`` its rows laid out as ``layout`` says; ``window`` ``(None, None)`` (no mask) or
    ``(left, 0)`` (causal, ``left`` None or the keys a row sees before its own), counted in the whole sequence;
    ``sink`` and ``return_lse`` as :func:`attention`'s. k ``(B, n T, K, D)`` and v ``(B, n T, K, Dv)``: every
    device's rows gathered in device order; or, with ``halo`` (``left``, at most a run's length), each run's
    ``halo`` keys before it and its own, ``(B, m (halo + T / m), K, D|Dv)`` as
    :func:`~jax_dqpost._attention.context.neighbours` lays them out. Returns out ``(B, T, N, Dv)`` (and the float32
    lse ``(B, N, T)``).

    Without a mask: the dense kernel on every key. Causal: each run of consecutive positions among the rows (one,
    or zigzag's two) is one sequence of a packed batch whose keys end at its own last row, so that FlashAttention's
    bottom-right mask is the global one: every key in sequence order up to that row (``seqused_k``,
    :func:`~jax_dqpost._attention.context.flash_chunks`; zigzag's two runs read copies of their own, whose
    gradients the backward sums), or with ``halo`` the run's keys as given (the sequence's first run reads its own
    alone)."""
    if window == (None, None):
        return attention(q, k, v, scale=scale, window=window, sink=sink, return_lse=return_lse)
    b, t, n, _ = q.shape
    m = context.chunks(layout)
    c = t // m
    if halo is None:
        s = k.shape[1]
        k, v = (jnp.broadcast_to(context.in_sequence_order(x, layout, devices)[:, None], (b, m, *x.shape[1:]))
                .reshape(b * m * s, *x.shape[2:]) for x in (k, v))
        used_k = jnp.tile(context.flash_chunks(layout, t, devices, index), b)
    else:
        s = halo + c
        k, v = (x.reshape(b * m * s, *x.shape[2:]) for x in (k, v))
        first = jnp.arange(m) == 0
        used_k = jnp.tile(jnp.where(first & (jnp.asarray(index) == 0), c, s).astype(jnp.int32), b)
    cu_q, cu_k = (jnp.arange(b * m + 1, dtype=jnp.int32) * length for length in (c, s))
    result = attention(q.reshape(b * t, n, q.shape[-1]), k, v, scale=scale, window=window, sink=sink,
                       return_lse=return_lse, seqlens=(cu_q, cu_k, None, used_k))
    out, lse = result if return_lse else (result, None)
    out = out.reshape(b, t, n, -1)
    return (out, lse.reshape(n, b, t).transpose(1, 0, 2)) if return_lse else out
