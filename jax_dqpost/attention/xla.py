"""``implementation='xla'``: jax.nn's ``'xla'`` attention in jax.numpy, with the sinks as one more logit per row
(``jax_dqpost._attention.xla``), on every platform, every dtype of :data:`~jax_dqpost.attention.call.DTYPES`. Its
logits are one ``(B, N, T, S)`` array."""

from __future__ import annotations

import dataclasses

from .._attention import xla as xla_math
from .call import Call, Unsupported


@dataclasses.dataclass(frozen=True)
class Xla:
    """``max_logits``: the most logits (``B * N * T * S``) it plans for (None: any); the order of
    ``implementation=None`` sets it, so that a call whose logits would not fit in memory runs ``'xla_chunked'``."""

    max_logits: int | None = None
    name: str = "xla"

    def plan(self, call: Call) -> None:
        if self.max_logits is not None and call.logits > self.max_logits:
            raise Unsupported(f"its logits would be {call.logits} elements (B * N * T * S), above "
                              f"{self.max_logits}")

    def run(self, call: Call, plan: None):
        return run_jax_nns(xla_math.dot_product_attention, call)


def run_jax_nns(attention, call: Call, **options):
    """``call`` by ``attention``, a function of jax.nn's conventions (``jax_dqpost._attention.xla``'s
    ``dot_product_attention`` or the chunked one, given ``options``)."""
    m = call.mask
    return attention(call.query, call.key, call.value, call.bias, m.array, scale=call.scale, is_causal=m.causal,
                     q_lengths=m.q_lengths, kv_lengths=m.kv_lengths, window=m.window, sinks=call.sinks,
                     return_residual=call.return_residual, precision=call.precision, q_positions=m.q_positions,
                     k_positions=m.k_positions, **options)
