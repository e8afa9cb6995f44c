"""``implementation='xla_chunked'``: ``'xla'``'s attention (within roundings) in memory that grows with ``T`` times
a block of keys, not ``T * S``: key blocks in a ``lax.scan`` with an online softmax, and a backward that recomputes
each block (``jax_dqpost._attention.xla_chunked``). Every platform; reverse-mode differentiation (forward mode:
``'xla'``)."""

from __future__ import annotations

import dataclasses

from .._attention import xla_chunked as chunked_math
from .call import Call
from .xla import run_jax_nns


@dataclasses.dataclass(frozen=True)
class XlaChunked:
    """``block_size``: the keys of a block (None: ``jax_dqpost._attention.xla_chunked.default_block_size``)."""

    block_size: int | None = None
    name: str = "xla_chunked"

    def plan(self, call: Call) -> None:
        return None

    def run(self, call: Call, plan: None):
        return run_jax_nns(chunked_math.dot_product_attention, call, block_size=self.block_size)
