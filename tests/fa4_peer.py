"""FlashAttention-4 (the torch package flash-attn-4) as a producer on a GPU: its backward's postprocess calls caught
with their inputs, and plain attention in torch as the reference of its gradients. Imported by the GPU tests only
(``test_fa4_producer.py``, ``test_gradients.py``, ``test_fa4jax_sinks.py``) and ``attention_judge.py``, their
reference; torch is imported inside the functions.

Every postprocess call of a backward (:func:`backward_calls`) is caught by wrapping
``flash_attn.cute.interface._bwd_postprocess_convert`` (inputs cloned before the call, outputs read after it): dQ's,
and dK's and dV's under grouped-query attention.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import ml_dtypes
import pytest


def fa4():
    """``(torch, flash_attn.cute.interface)``, or the test skips."""
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # FlashAttention-4's own imports
        interface = pytest.importorskip("flash_attn.cute.interface")
    return torch, interface


def fa4_version() -> str:
    from importlib.metadata import version

    return version("flash-attn-4")


@contextlib.contextmanager
def captured(torch, interface):
    """Every postprocess call of FlashAttention-4's backward while inside: a dict per call."""
    original = interface._bwd_postprocess_convert
    signature = inspect.signature(original)
    calls = []

    def clone(t):
        return None if t is None else t.detach().clone()

    def wrapper(*args, **kwargs):
        a = signature.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        call = dict(accum=clone(a["accum"]), scale=float(a["scale"]), cu=clone(a["cu_seqlens"]),
                    seqused=clone(a["seqused"]), hdim=a["hdim"],
                    config=(a["block_size"], a["num_threads"], a["atom_layout"], a["swap_ab"], a["hdim_multiple_of"],
                            a["cluster_size"]))
        sink = a["sink_tensors"]
        if sink is not None:
            call.update(dpsum=clone(sink.dpsum), lse=clone(sink.lse), sink=clone(sink.sink))
        original(*args, **kwargs)
        torch.cuda.synchronize()
        call["output"] = clone(a["output"])
        if sink is not None:
            call["dsink"] = clone(sink.dsink)
        calls.append(call)

    wrapper.compile_cache = original.compile_cache  # the original reads it through the global name
    interface._bwd_postprocess_convert = wrapper
    try:
        yield calls
    finally:
        interface._bwd_postprocess_convert = original


def backward_calls(torch, interface, q, k, v, d_out, *, causal: bool, sink=None, **varlen):
    """FlashAttention-4's forward (``flash_attn_varlen_func`` given the packed offsets ``varlen``, else
    ``flash_attn_func``), then its backward of ``d_out``: the postprocess calls the backward made (:func:`captured`)."""
    forward = interface.flash_attn_varlen_func if varlen else interface.flash_attn_func
    res = forward(q, k, v, causal=causal, learnable_sink=sink, **varlen)
    out = res[0] if isinstance(res, tuple) else res
    with captured(torch, interface) as calls:
        out.backward(d_out)
    torch.cuda.synchronize()
    return calls


def to_numpy(t):
    """A torch tensor as numpy, bf16 as ml_dtypes.bfloat16."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.detach().cpu().numpy()


def attention_grads(q, k, v, d_out, *, causal: bool, scale: float, sink=None, dtype=None, window=(None, None),
                    d_lse=None):
    """Plain attention, ``softmax(scale * q k^T) v`` (with a learnable sink: one more logit per head in the softmax's
    denominator, attending to nothing), and its gradients by torch autograd in ``dtype`` (float32, float64, or the
    inputs' own for the low-precision reference): ``{"out", "lse", "dq", "dk", "dv"[, "dsink"]}``, out and the
    gradients in the inputs' shapes, lse ``(B, H, S)``.

    ``q`` ``(B, S, H, D)``, ``k`` ``(B, Sk, Hkv, D)``, ``v`` ``(B, Sk, Hkv, Dv)``, ``d_out`` ``(B, S, H, Dv)``, and
    ``d_lse`` ``(B, H, S)`` (None: 0) the lse's cotangent; query head ``h`` uses key/value head ``h // (H / Hkv)``.
    FlashAttention's bottom-right alignment: query ``i`` sits at key position ``i + Sk - S`` and sees key ``j`` where
    ``-right <= i + Sk - S - j <= left`` for ``window = (left, right)`` (None: unbounded; ``causal``: right = 0). A
    sink of -inf is taken as -1e4 (the same where a row has a key, and no NaN where it has none)."""
    import torch

    dtype = dtype or q.dtype
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    qq, kk, vv = leaves
    group = q.shape[2] // k.shape[2]
    kk, vv = kk.repeat_interleave(group, dim=2), vv.repeat_interleave(group, dim=2)
    s = torch.einsum("bshd,bthd->bhst", qq, kk) * scale
    seqlen, seqlen_k = q.shape[1], k.shape[1]
    left, right = window
    right = 0 if causal else right
    i = torch.arange(seqlen, device=q.device)[:, None] + seqlen_k - seqlen
    j = torch.arange(seqlen_k, device=q.device)[None, :]
    hidden = torch.zeros((seqlen, seqlen_k), dtype=torch.bool, device=q.device)
    if left is not None:
        hidden |= i - j > left
    if right is not None:
        hidden |= j - i > right
    s = s.masked_fill(hidden, float("-inf"))
    if sink is not None:
        sink_leaf = sink.detach().to(dtype).clamp(min=-1e4).requires_grad_()
        leaves.append(sink_leaf)
        column = sink_leaf.view(1, -1, 1, 1).expand(s.shape[0], s.shape[1], s.shape[2], 1)
        logits = torch.cat([s, column], dim=-1)
    else:
        logits = s
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)[..., :seqlen_k]
    out = torch.einsum("bhst,bthd->bshd", p, vv)
    grads = torch.autograd.grad([out, lse], leaves, [d_out.to(dtype), torch.zeros_like(lse) if d_lse is None
                                                     else d_lse.to(dtype)], allow_unused=True)
    return dict(zip(("dq", "dk", "dv", "dsink"), grads), out=out.detach(), lse=lse.detach())
