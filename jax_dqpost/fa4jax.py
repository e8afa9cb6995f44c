"""FlashAttention-4 in JAX with a real producer: fa4-jax's backward, finished by jax-dqpost.

fa4-jax 0.1.0 (FlashAttention-4's CuTe DSL kernels called from JAX) ends its backward with one postprocess launch
per fp32 accumulator: dQ, and dK and dV under grouped-query attention. This module registers a fa4-jax backend,
:data:`BACKEND`, that is fa4-jax's own kernel backend except for that last step: its reverse mode runs fa4-jax's
preprocess and main backward kernel, then one :func:`jax_dqpost.flash_attention_postprocess` launch for every
accumulator. The accumulator orders are fa4-jax's, read from its tile plan for the call's head dims, masking,
grouped-query ratio and GPU (:func:`accum_layout`). Forward, forward mode, masks, windows, vmap and varlen are
fa4-jax's.

Usage (a CUDA GPU, and fa4-jax: ``pip install fa4-jax==0.1.0``, or the ``[fa4-jax]`` extra; Python >= 3.12)::

    from jax_dqpost import fa4jax
    out = fa4jax.flash_attn(q, k, v, causal=True)          # (B, S, H, D) bf16/fp16, as fa4_jax.flash_attn
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)  # the backward ends in one jax-dqpost launch

or ``fa4_jax.flash_attn(..., backend=fa4jax.BACKEND)`` once :func:`register` has run. What fa4-jax does not take
(no cotangent through ``return_lse``; vmap over varlen; the head dims and GPUs its kernels refuse) this backend
does not take either, with fa4-jax's errors. Where fa4-jax writes an accumulator in an order our kernel does not
take (on sm90, dK/dV under grouped-query attention at head dims 136..160: a 64-row WGMMA atom over a head dim padded
to 160), the backward raises ValueError naming the head dims. Its gradients match plain attention's wherever fa4-jax
runs (fa4-jax pads its sm90 tiles to 32, as its accumulators; ``tests/test_gradients.py``, docs/gradients.md).
Without fa4-jax, or without a GPU, each call raises one line that says so.
"""

from __future__ import annotations

import functools

import jax

from . import _fa4jax
from .api import flash_attention_postprocess
from .layout import ORDER_OF_FAMILY, AccumLayout

__all__ = ["BACKEND", "accum_layout", "flash_attn", "flash_attn_varlen", "postprocess", "register"]

BACKEND = "jax_dqpost"
"""The name this backend has in fa4-jax's backend registry."""


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
    return AccumLayout(family, rows, threads, atom_layout, bool(swap_ab), _fa4jax.HDIM_MULTIPLE_OF, two_cta=False,
                       cluster_size=1)


def _layouts(acc, head_dim: int, head_dim_v: int):
    """``(dq_layout, dkv_layout or None)`` of ``acc``, each checked against the head dims it holds."""
    gqa = acc.dk_accum is not None
    dq_layout, dkv_layout = accum_layout(acc.dq_order), (accum_layout(acc.dkv_order) if gqa else None)
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


def postprocess(cfg, q, k, v, acc, seqlens):
    """One :func:`~jax_dqpost.flash_attention_postprocess` launch for what fa4-jax's backward left (``acc``):
    ``(dq, dk, dv)``. Under grouped-query attention it converts all three; otherwise dQ alone, and dK, dV are the
    main kernel's. ValueError where fa4-jax wrote an accumulator in an order our kernel does not take."""
    dq_layout, dkv_layout = _layouts(acc, q.shape[-1], v.shape[-1])
    if seqlens is None:
        q_side, k_side = dict(seqlen_q=q.shape[1]), dict(seqlen_k=k.shape[1])
    else:
        cu_q, cu_k, used_q, used_k = seqlens
        q_side = dict(total_q=q.shape[0], cu_seqlens_q=cu_q, seqused_q=used_q)
        k_side = dict(total_k=k.shape[0], cu_seqlens_k=cu_k, seqused_k=used_k)
    common = dict(head_dim=q.shape[-1], dtype=q.dtype, dq_layout=dq_layout, **q_side)
    if dkv_layout is None:  # the main kernel wrote dK and dV itself
        dq, _, _ = flash_attention_postprocess(acc.dq_accum, None, None, cfg.scale, **common)
        return dq, acc.dk, acc.dv
    return flash_attention_postprocess(acc.dq_accum, acc.dk_accum, acc.dv_accum, cfg.scale, **common, **k_side,
                                       head_dim_v=v.shape[-1], dkv_layout=dkv_layout)


@functools.cache
def register():
    """Register :data:`BACKEND` with fa4-jax (once; :func:`flash_attn` and :func:`flash_attn_varlen` do it
    themselves). Returns ``fa4_jax``.
    Raises ImportError when fa4-jax 0.1.0 is not installed."""
    fa4_jax = _fa4jax.modules()[0]

    cute = _fa4jax.cute_backend_class()

    class Backend(cute):
        """fa4-jax's kernel backend, its kernels shared with fa4-jax's own, and jax-dqpost's postprocess."""

        def fwd(self, cfg, *args, **kwargs):
            return super().fwd(_fa4jax.as_cute(cfg), *args, **kwargs)

        def fwd_lse(self, cfg, *args, **kwargs):
            return super().fwd_lse(_fa4jax.as_cute(cfg), *args, **kwargs)

        def tangent(self, cfg, *args, **kwargs):
            return super().tangent(_fa4jax.as_cute(cfg), *args, **kwargs)

        def vjp(self, cfg, q, k, v, out, lse, d_out, d_lse, aux, seqlens=None):
            acc = _fa4jax.accumulators(cfg, q, k, v, out, lse, d_out, d_lse, aux, seqlens)
            return postprocess(cfg, q, k, v, acc, seqlens)

    _fa4jax.register_backend(BACKEND, Backend())
    return fa4_jax


def _ready(kwargs):
    fa4_jax = register()
    if "backend" in kwargs:
        raise TypeError(f"jax_dqpost.fa4jax sets fa4-jax's backend itself, got backend={kwargs['backend']!r}")
    if jax.default_backend() != "gpu":
        raise RuntimeError(f"jax_dqpost.fa4jax runs fa4-jax's CUDA kernels and needs a GPU; JAX's backend is "
                           f"{jax.default_backend()!r} (fa4_jax.flash_attn(..., backend='reference') runs anywhere)")
    return fa4_jax


def flash_attn(q, k, v, **kwargs):
    """``fa4_jax.flash_attn(q, k, v, **kwargs)`` on this backend: q ``(B, S, H, D)``, k ``(B, Sk, Hkv, D)``,
    v ``(B, Sk, Hkv, Dv)`` in bf16/fp16, ``Hkv`` dividing ``H``; returns ``(B, S, H, Dv)`` (and the lse
    ``(B, H, S)`` with ``return_lse=True``). Keywords as fa4-jax's (``causal``, ``window_size``, ``scale``,
    ``mask_mod``, ``return_lse``), except ``backend``."""
    return _ready(kwargs).flash_attn(q, k, v, backend=BACKEND, **kwargs)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """``fa4_jax.flash_attn_varlen`` on this backend: packed q ``(T, H, D)``, k ``(Tk, Hkv, D)``, v ``(Tk, Hkv,
    Dv)``, int32 ``cu_seqlens_q``/``cu_seqlens_k`` ``(B + 1,)`` (traced or not); returns ``(T, H, Dv)``. Keywords
    as fa4-jax's (``seqused_q``, ``seqused_k``, ``defined_padding``, ...), except ``backend``. Rows of dq (and of
    dk, dv under grouped-query attention) that no sequence uses are 0 whatever ``defined_padding`` says; fa4-jax
    leaves them unspecified without it."""
    return _ready(kwargs).flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, backend=BACKEND, **kwargs)
