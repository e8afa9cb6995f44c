"""``implementation='xla_chunked'``: ``'xla'``'s attention (within roundings) in memory that grows with ``T`` times
a block of keys, not ``T * S``: key blocks in a ``lax.scan`` with an online softmax, and a backward that recomputes
each block (``jax_dqpost._attention.xla_chunked``). Every platform; reverse-mode differentiation (forward mode:
``'xla'``)."""

from __future__ import annotations

from .._attention import xla_chunked as chunked_math
from .call import Call


class XlaChunked:
    name = "xla_chunked"

    def plan(self, call: Call) -> None:
        return None

    def run(self, call: Call, plan: None):
        m = call.mask
        return chunked_math.dot_product_attention(
            call.query, call.key, call.value, call.bias, m.array, scale=call.scale, is_causal=m.causal,
            q_lengths=m.q_lengths, kv_lengths=m.kv_lengths, window=m.window, sinks=call.sinks,
            return_residual=call.return_residual, precision=call.precision)
