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

or ``fa4_jax.flash_attn(..., backend=fa4jax.BACKEND)`` once :func:`register` has run. The lse that ``return_lse``
returns is differentiable: its cotangent enters the backward as ``dpsum - d_lse`` (:mod:`jax_dqpost._attention.autodiff`).
What fa4-jax does not take (vmap over varlen; the head dims and GPUs its kernels refuse) this backend does not take
either, with fa4-jax's errors.

Learnable sinks (gpt-oss): ``flash_attn(q, k, v, learnable_sink=sink)``, ``sink`` ``(H,)`` floating (float64 is read
as float32), one logit per query head in natural-log units (not multiplied by the softmax scale), in every row's
softmax with no value vector: ``out_i = sum_j P_ij v_j``, ``P_ij = exp(scale * q_i k_j - lse_i)``, ``lse_i =
log(sum_j exp(scale * q_i k_j) + exp(sink_h))``; a row with no key gets ``out = 0``, ``lse = sink_h``. The forward is
FlashAttention-4's kernel given the sink (fa4-jax runs it without); the backward is fa4-jax's preprocess and main
kernel, unchanged, then one jax-dqpost launch for dQ (dK, dV) and dsink; forward mode is fa4-jax's forward-mode
kernel on the sink-including lse, plus the sink's own terms. vmap folds into the batch (a shared sink) or maps (a
mapped sink, or varlen); no ``mask_mod``. On GPUs whose FlashAttention-4 forward takes a sink: Hopper (sm90) and sm100/sm110.

Head dims 136..160 on Hopper (sm90): fa4-jax 0.1.0's kernels do not compile there with CuTe DSL 4.8 (its own backend
fails the same way), and its dK/dV order under grouped-query attention is one our kernel does not take. This backend
runs them padded: where ``head_dim`` or ``head_dim_v`` is in that range, q, k and v are zero-padded to one head dim,
:data:`PADDED_HEAD_DIM` or the larger of the two (a pair fa4-jax's kernels compile for, as they do for every equal
pair outside the range), with the softmax scale of the real head dim, and the output is sliced back. Zero columns
add nothing to ``q k^T``, give zero output columns, and their gradients are sliced off, so the result is the
attention of the real head dims; the cost is the arithmetic of head dim 192 (1.2x that of 160, 1.41x that of 136).
Any other failure of fa4-jax's kernels to compile is a ValueError naming the head dims, the GPU and the compiler's
first line. Where fa4-jax writes an accumulator in an order our kernel does not take, the backward raises ValueError
naming the head dims. Its gradients match plain attention's wherever it runs (fa4-jax pads its sm90 tiles to 32, as
its accumulators; ``tests/test_gradients.py``, docs/gradients.md). On a GPU without fa4-jax each call raises one
line that says how to install it.

Where JAX's default backend is not a GPU, :func:`flash_attn` and :func:`flash_attn_varlen` run the same attention
in jax.numpy (``jax_dqpost._attention.xla.flash_attention``), with and without a sink, differentiable in every mode:
FlashAttention's conventions (causal masks and windows bottom-right aligned on each sequence's used lengths, a row
with no key gives 0 and lse the sink or ``-inf``, rows no sequence uses give 0 and ``-inf``); with ``mask_mod``,
fa4-jax's own jax.numpy backend (``backend='reference'``), which takes it. """

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .postprocess import arguments as _arguments
from ._attention import fa4jax_internals, xla
from ._attention.fa4 import (BACKEND, accum_layout, check_sink_gpu, on_gpu, register, run_padded,  # noqa: F401
                             flash, PADDED_HEAD_DIM)  # (PADDED_HEAD_DIM: the module docstring names it)
from ._kernel import abi
from ._checks import describe

__all__ = ["BACKEND", "accum_layout", "flash_attn", "flash_attn_varlen", "register"]

def _ready(kwargs):
    fa4_jax = register()
    if "backend" in kwargs:
        raise TypeError(f"jax_dqpost.fa4jax sets fa4-jax's backend itself, got backend={kwargs['backend']!r}")
    return fa4_jax


def _with_backend(attention):
    return functools.partial(attention, backend=BACKEND)


_SINK_KEYWORDS = ("causal", "window_size", "scale", "return_lse")
_SINK_VARLEN_KEYWORDS = ("seqused_q", "seqused_k", "defined_padding")


def check_sink(sink, q, kwargs, packed: bool):
    """The arguments of a call with a learnable sink, checked before anything runs (fa4-jax and a GPU needed by
    none of the checks): the sink, an array of one of its dtypes and shape ``(H,)``, as an array; a one-line error
    naming the argument otherwise."""
    allowed = _SINK_KEYWORDS + (_SINK_VARLEN_KEYWORDS if packed else ())
    if kwargs.get("mask_mod") is not None:
        raise ValueError("mask_mod with learnable_sink is not supported by jax_dqpost.fa4jax; pass one or the other")
    unknown = sorted(set(kwargs) - set(allowed) - {"mask_mod", "backend"})
    if unknown:
        raise TypeError(f"{'flash_attn_varlen' if packed else 'flash_attn'}() got unexpected keyword argument(s) "
                        f"{', '.join(unknown)}; with learnable_sink it takes {', '.join(allowed)}")
    dtype = getattr(sink, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):  # numpy's issubdtype calls bfloat16 no float
        raise TypeError("learnable_sink must be a floating-point array of shape (heads,), got "
                        + (describe(sink) if dtype is None else f"dtype {np.dtype(dtype)}"))
    heads = q.shape[-2] if getattr(q, "ndim", 0) >= 2 else None
    if tuple(sink.shape) != (heads,):
        raise ValueError(f"learnable_sink must have shape ({heads},), one logit per query head of q "
                         f"{tuple(getattr(q, 'shape', ()))}, got shape {tuple(sink.shape)}")
    sink = jnp.asarray(sink)
    return sink if sink.dtype in abi.SINK_DTYPES else sink.astype(jnp.float32)  # float64: read as float32


def _check_offsets_dtype(name: str, x) -> None:
    """Offsets and lengths of the sink path as the op takes them (``_arguments.WIDENED_DTYPES``): a jax array of int32
    or of a type int32 holds exactly; a wider integer array only where this host sees values int32 holds (fa4-jax
    casts to int32, which would narrow them silently)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not np.issubdtype(dtype, np.integer) or np.dtype(dtype) == np.int32 \
            or np.dtype(dtype) in _arguments.WIDENED_DTYPES:
        return
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name} must be int32 (int8, int16, uint8 and uint16 are widened), got traced dtype "
                        f"{np.dtype(dtype).name}, which int32 cannot hold exactly: pass int32")
    values = np.asarray(x)
    if values.size and (values.min() < np.iinfo(np.int32).min or values.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} holds {int(values.max())}, beyond int32: offsets and lengths are int32")


def _sink_call(packed: bool, q, k, v, cu_seqlens, sink, kwargs):
    """The checks, then the attention with the sink (``jax_dqpost._attention.fa4.flash``) at the head dims
    fa4-jax's kernels compile for."""
    sink = check_sink(sink, q, kwargs, packed)
    kwargs = {key: value for key, value in kwargs.items() if key != "mask_mod"}
    _ready(kwargs)
    fa4jax_internals.check_qkv(q, k, v, packed)
    check_sink_gpu(fa4jax_internals.device_family())
    if packed:
        for name, x in zip(("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k"),
                           (*cu_seqlens, kwargs.get("seqused_q"), kwargs.get("seqused_k"))):
            _check_offsets_dtype(name, x)
    return run_padded(flash(packed), q, k, v, *cu_seqlens, learnable_sink=sink, **kwargs)


# ---- where there is no GPU: the same attention in jax.numpy ----------------------------------------------------

def _check_shapes(q, k, v, packed: bool) -> None:
    """The shapes and dtypes fa4-jax takes, with its messages (needing no fa4-jax)."""
    name = "flash_attn_varlen" if packed else "flash_attn"
    what = "packed (total_tokens, heads, head_dim)" if packed else "(batch, seqlen, heads, head_dim)"
    if any(getattr(x, "ndim", None) != 3 + (not packed) for x in (q, k, v)):
        raise ValueError(f"{name} takes {what} arrays, got q {getattr(q, 'shape', q)}, k {getattr(k, 'shape', k)}, "
                         f"v {getattr(v, 'shape', v)}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"batch mismatch: q {q.shape[0]} vs kv {k.shape[0]}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q/k/v dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"{name} takes floating-point q, k and v, got {q.dtype}")
    if k.shape[-3] != v.shape[-3] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k/v seqlen+heads must match, got {k.shape} vs {v.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q/k head_dim mismatch: {q.shape[-1]} vs {k.shape[-1]}")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"q heads {q.shape[-2]} not a multiple of kv heads {k.shape[-2]}")


def _without_gpu(packed: bool, q, k, v, cu_seqlens, sink, kwargs):
    """A call of :func:`flash_attn` or :func:`flash_attn_varlen` where no GPU is: FlashAttention's attention in
    jax.numpy (``jax_dqpost._attention.xla.flash_attention``), the sink's too; with a ``mask_mod``, fa4-jax's own
    jax.numpy backend (``backend='reference'``), which takes it."""
    if "backend" in kwargs:
        raise TypeError(f"jax_dqpost.fa4jax sets fa4-jax's backend itself, got backend={kwargs['backend']!r}")
    if sink is not None:
        sink = check_sink(sink, q, kwargs, packed)
    if kwargs.get("mask_mod") is not None:
        fa4_jax = fa4jax_internals.modules()[0]
        call = fa4_jax.flash_attn_varlen if packed else fa4_jax.flash_attn
        return call(q, k, v, *cu_seqlens, backend="reference", **kwargs)
    allowed = _SINK_KEYWORDS + (_SINK_VARLEN_KEYWORDS if packed else ())
    unknown = sorted(set(kwargs) - set(allowed) - {"mask_mod"})
    if unknown:
        raise TypeError(f"{'flash_attn_varlen' if packed else 'flash_attn'}() got unexpected keyword argument(s) "
                        f"{', '.join(unknown)}; it takes {', '.join(allowed + ('mask_mod',))}")
    _check_shapes(q, k, v, packed)
    if packed:
        for name, x in zip(("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k"),
                           (*cu_seqlens, kwargs.get("seqused_q"), kwargs.get("seqused_k"))):
            _check_offsets_dtype(name, x)
    seqlens = fa4jax_internals.seqlens(*cu_seqlens, kwargs.get("seqused_q"), kwargs.get("seqused_k")) \
        if packed else None
    scale = kwargs.get("scale")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    window = xla.flash_window(bool(kwargs.get("causal", False)), kwargs.get("window_size"))
    out, lse = xla.flash_attention(q, k, v, scale=scale, window=window, sinks=sink, seqlens=seqlens)
    return (out, lse) if kwargs.get("return_lse") else out


def flash_attn(q, k, v, *, learnable_sink=None, **kwargs):
    """``fa4_jax.flash_attn(q, k, v, **kwargs)`` on this backend: q ``(B, S, H, D)``, k ``(B, Sk, Hkv, D)``,
    v ``(B, Sk, Hkv, Dv)`` in bf16/fp16, ``Hkv`` dividing ``H``; returns ``(B, S, H, Dv)`` (and the lse
    ``(B, H, S)``, float32 natural log, with ``return_lse=True``). Keywords as fa4-jax's (``causal``,
    ``window_size``, ``scale``, ``mask_mod``, ``return_lse``), except ``backend``. Head dims 136..160 run padded on
    Hopper (module docstring).

    ``learnable_sink``: ``(H,)`` floating (float64 read as float32), one logit per query head in every softmax row
    (module docstring); its gradient comes from the same launch as dQ's. With it: no ``mask_mod``, reverse-mode
    differentiation only, GPUs sm90 and sm100/sm110."""
    if not on_gpu():
        return _without_gpu(False, q, k, v, (), learnable_sink, kwargs)
    if learnable_sink is not None:
        return _sink_call(False, q, k, v, (), learnable_sink, kwargs)
    return run_padded(_with_backend(_ready(kwargs).flash_attn), q, k, v, **kwargs)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, learnable_sink=None, **kwargs):
    """``fa4_jax.flash_attn_varlen`` on this backend: packed q ``(T, H, D)``, k ``(Tk, Hkv, D)``, v ``(Tk, Hkv,
    Dv)``, int32 ``cu_seqlens_q``/``cu_seqlens_k`` ``(B + 1,)`` (traced or not); returns ``(T, H, Dv)`` (and the lse
    ``(H, T)`` with ``return_lse=True``). Keywords as fa4-jax's (``seqused_q``, ``seqused_k``,
    ``defined_padding``, ...), except ``backend``; ``learnable_sink`` as in :func:`flash_attn`. Rows of dq (and of dk,
    dv under grouped-query attention) that no sequence uses are 0 whatever ``defined_padding`` says; fa4-jax
    leaves them unspecified without it. Head dims 136..160 run padded on Hopper (module docstring)."""
    if not on_gpu():
        return _without_gpu(True, q, k, v, (cu_seqlens_q, cu_seqlens_k), learnable_sink, kwargs)
    if learnable_sink is not None:
        return _sink_call(True, q, k, v, (cu_seqlens_q, cu_seqlens_k), learnable_sink, kwargs)
    return run_padded(_with_backend(_ready(kwargs).flash_attn_varlen), q, k, v, cu_seqlens_q, cu_seqlens_k,
                      **kwargs)
