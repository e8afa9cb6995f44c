"""``implementation='cudnn'``: ``jax.nn.dot_product_attention(implementation='cudnn')`` as it is, without sinks, on
NVIDIA GPUs (what cuDNN's attention takes beyond that, jax.nn checks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .call import Call, Unsupported


class Cudnn:
    name = "cudnn"

    def plan(self, call: Call) -> None:
        if call.context is not None:
            raise Unsupported(f"context parallelism (context_axis={call.context.axis!r}) is not yet supported on "
                              "implementation 'cudnn'; 'xla' and 'xla_chunked' run it")
        if call.sinks is not None:
            raise Unsupported("cuDNN's attention takes no sinks")
        if jax.default_backend() != "gpu":
            raise Unsupported(f"cuDNN's attention runs on NVIDIA GPUs, and JAX's default backend is "
                              f"{jax.default_backend()!r}")
        if np.issubdtype(call.query.dtype, np.complexfloating):
            raise Unsupported(f"cuDNN's attention takes no {call.query.dtype}")

    def run(self, call: Call, plan: None):
        m = call.mask
        t, s = call.query.shape[1], call.key.shape[1]
        q_lengths, kv_lengths = (None if x is None else jnp.clip(x, 0, n).astype(np.int32)
                                 for x, n in ((m.q_lengths, t), (m.kv_lengths, s)))  # jax.nn takes int32 alone
        return jax.nn.dot_product_attention(
            call.query, call.key, call.value, call.bias, m.array, scale=call.scale, is_causal=m.causal,
            query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths, local_window_size=m.window,
            implementation="cudnn", return_residual=call.return_residual)
