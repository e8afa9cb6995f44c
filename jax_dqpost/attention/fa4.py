"""``implementation='fa4'``: FlashAttention-4's kernels through fa4-jax (``jax_dqpost._attention.fa4``), forward
and backward, the backward finished by one jax-dqpost launch for dQ, dK, dV and the sinks' gradient. It runs a call
its kernels express exactly: bf16 or fp16 on a GPU where they run (Hopper and Blackwell; with sinks sm90 and
sm100/sm110), fa4-jax installed, no bias or mask array, a scale known when tracing, and jax.nn's top-left causal
mask and window as FlashAttention's bottom-right ones (:meth:`~jax_dqpost.attention.call.Mask.flash`). Lengths run
its packed (varlen) kernels on the batch as it is, reshaped (no copy). Context parallelism (a :class:`Context`)
runs without a mask or with a causal one (and a window of keys before each row), without lengths:
:func:`jax_dqpost._attention.fa4.context_attention`. Under ``jax.jit`` with sharded operands the kernels' rules run
each device's batch, heads and (for those masks) rows (:mod:`jax_dqpost._attention.autodiff`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._attention import context as cp
from .._attention import fa4 as kernels
from .call import Call, FlashMask, Unsupported


def translate(call: Call) -> FlashMask:
    """What of ``call`` the kernels cannot express, as :class:`Unsupported`, before looking at the machine; else
    its mask in FlashAttention's terms."""
    if call.bias is not None:
        raise Unsupported("it takes no bias")
    if isinstance(call.scale, jax.core.Tracer):
        raise Unsupported("its kernels are compiled for a scale known when tracing, and this one is traced")
    if call.context is not None:
        return FlashMask(call.key.shape[1], _context_window(call))
    return call.mask.flash(call.query.shape[1], call.key.shape[1])


def _context_window(call: Call) -> tuple:
    """The window :func:`~jax_dqpost._attention.fa4.context_attention` takes for a context-parallel call's mask:
    ``(None, None)`` without one, ``(left, 0)`` causal (``left`` None or a window's left side)."""
    m, axis = call.mask, call.context.axis
    if m.lengths:
        raise Unsupported(f"with context_axis={axis!r} it takes no query_seq_lengths or key_value_seq_lengths")
    left, right = cp.reach(m.causal, m.window)
    if right not in (None, 0) or (right is None and left is not None):
        raise Unsupported(f"with context_axis={axis!r} it takes a causal mask, a window (left, 0) or no mask, not "
                          f"the window {m.window} (which reaches keys after a row's own)")
    return left, right


class Fa4:
    name = "fa4"

    def plan(self, call: Call) -> FlashMask:
        """The call's :class:`FlashMask`, or :class:`Unsupported`: what it asks (:func:`translate`), then the
        platform, the dtype, fa4-jax, the GPU and what its kernels compile for."""
        flash = translate(call)
        if jax.default_backend() != "gpu":
            raise Unsupported(f"it runs on NVIDIA GPUs and JAX's default backend is {jax.default_backend()!r}")
        if call.query.dtype not in (jnp.bfloat16, jnp.float16):
            raise Unsupported(f"its kernels take bfloat16 and float16, and the query is {call.query.dtype}")
        q, k, v = call.query, call.key[:, :flash.keys], call.value[:, :flash.keys]
        packed = flash.used_q is not None or flash.used_k is not None
        if call.context is not None and flash.window != (None, None):  # context_attention's packed batch
            m = cp.chunks(call.context.layout)
            b, t = q.shape[:2]
            q = jax.ShapeDtypeStruct((b * m, t // m, *q.shape[2:]), q.dtype)
            s = k.shape[1] if call.context.halo is None else k.shape[1] // m
            k, v = (jax.ShapeDtypeStruct((b * m, s, *x.shape[2:]), x.dtype) for x in (k, v))
            packed = True
        reason = kernels.unavailable(q, k, v, window_size=flash.window, scale=call.scale, packed=packed,
                                     sink=call.sinks is not None)
        if reason is not None:
            raise Unsupported(reason)
        return flash

    def run(self, call: Call, plan: FlashMask):
        """``call`` by ``plan`` on FlashAttention-4's kernels (``jax_dqpost._attention.fa4``): context-parallel
        (``context_attention``), dense, or packed where there are lengths, the batch reshaped to one packed batch (no
        copy) with offsets ``b * T`` and ``defined_padding`` (rows past a length are 0, as jax.nn zeroes them).
        Without a GPU, the same attention in jax.numpy in FlashAttention's conventions: what the tests compare with
        jax.nn's."""
        q, k, v = call.query, call.key[:, :plan.keys], call.value[:, :plan.keys]
        options = dict(scale=float(call.scale), window=plan.window, sink=call.sinks, return_lse=call.return_residual)
        b, t, n, h = q.shape
        if call.context is not None:
            c = call.context
            result = kernels.context_attention(q, k, v, layout=c.layout, devices=c.devices,
                                               index=c.index, halo=c.halo, **options)
            out, lse = result if call.return_residual else (result, None)
        elif plan.used_q is None and plan.used_k is None:
            result = kernels.attention(q, k, v, **options)
            out, lse = result if call.return_residual else (result, None)
        else:
            s = k.shape[1]
            cu_q, cu_k = (jnp.arange(b + 1, dtype=jnp.int32) * length for length in (t, s))
            try:
                result = kernels.attention(q.reshape(b * t, n, h), k.reshape(b * s, *k.shape[2:]),
                                           v.reshape(b * s, *v.shape[2:]),
                                           seqlens=(cu_q, cu_k, plan.used_q, plan.used_k), **options)
            except NotImplementedError as e:  # fa4-jax's packed kernels under jax.vmap
                raise ValueError(f"implementation='fa4' with sequence lengths cannot run under jax.vmap ({e}); fold "
                                 "the mapped axis into the batch, or use implementation='xla'") from None
            out, lse = result if call.return_residual else (result, None)
            out = out.reshape(b, t, n, -1)
            if lse is not None:
                lse = lse.reshape(n, b, t).transpose(1, 0, 2)
        if not call.return_residual:
            return out
        return out, jax.lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)).astype(call.key.dtype))
