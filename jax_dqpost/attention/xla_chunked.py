"""``implementation='xla_chunked'``: ``'xla'``'s attention (within roundings) in memory that grows with ``T`` times
a block of keys, not ``T * S``: key blocks in a ``lax.scan`` with an online softmax, and a backward that recomputes
each block (``jax_dqpost._attention.xla_chunked``). Every platform; reverse-mode differentiation (forward mode:
``'xla'``)."""

from __future__ import annotations

from .._attention import xla_chunked as chunked_math
from .call import Call
from .xla import run_jax_nns


class XlaChunked:
    name = "xla_chunked"

    def plan(self, call: Call) -> None:
        return None

    def run(self, call: Call, plan: None):
        return run_jax_nns(chunked_math.dot_product_attention, call)
