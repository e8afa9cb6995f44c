"""The op inside the package: what a FlashAttention backward the package runs itself left in its accumulators,
finished by one bind of the primitive, from geometry the caller already holds checked (nothing is checked again;
the public entry points are ``api.py``'s)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ..._kernel.varlen import WorkList
from ...layout import AccumLayout
from . import rules
from .plan import Operands, Part, Plan


@dataclasses.dataclass(frozen=True)
class Side:
    """One sequence side of the attention: dense, ``rows`` the sequence length; packed, ``rows`` the packed rows,
    with int32 ``cu`` ``(B + 1,)`` offsets and ``used`` ``(B,)`` lengths (device data, traced or not)."""

    rows: int
    cu: object = None
    used: object = None


def _part(layout: AccumLayout, head_dim: int, dtype, side: Side) -> tuple[Part, object]:
    """The tensor's :class:`Part` and its side's aux operand (empty, or the packed work list)."""
    if side.cu is None:
        return Part(layout, head_dim, np.dtype(dtype), seqlen=side.rows), jnp.zeros((0,), jnp.int32)
    batch = side.cu.shape[0] - 1
    work, work_list = WorkList.build(jnp, side.cu, side.used, total=side.rows, layout=layout,
                                     num_tiles=WorkList.max_tiles(side.rows, batch, layout))
    return Part(layout, head_dim, np.dtype(dtype), work=work), work_list


def finish(dq_accum, dk_accum, dv_accum, scale: float, *, dtype, head_dim: int, head_dim_v: int,
           dq_layout: AccumLayout, dkv_layout: AccumLayout | None, q_side: Side, k_side: Side | None = None,
           sink: tuple | None = None) -> tuple:
    """``(dq, dk, dv, dsink)`` as ``flash_attention_postprocess`` defines them, dk and dv None without
    ``dk_accum`` (``dv_accum``, ``dkv_layout``, ``k_side`` likewise), dsink None without ``sink`` = ``(learnable_sink,
    lse, dpsum)`` (a sink of one of the kernel's dtypes; dsink in it). ``scale`` is dQ's and dK's, dV's is 1."""
    q_part, q_aux = _part(dq_layout, head_dim, dtype, q_side)
    sink_dtype = None if sink is None else np.dtype(sink[0].dtype)
    if dk_accum is None:
        plan = Plan((q_part,), sink_dtype=sink_dtype, dsink_dtype=sink_dtype)
        accs, aux, scales = (dq_accum,), (q_aux,), jnp.full((1,), scale, jnp.float32)
    else:
        k_part, k_aux = _part(dkv_layout, head_dim, dtype, k_side)
        plan = Plan((q_part, k_part, dataclasses.replace(k_part, head_dim=head_dim_v)), sink_dtype=sink_dtype,
                    dsink_dtype=sink_dtype)
        accs, aux = (dq_accum, dk_accum, dv_accum), (q_aux, k_aux)
        scales = jnp.asarray([scale, scale, 1.0], jnp.float32)
    outs = rules.bind(plan.join(Operands(accs, aux, scales, *(sink or ()))), plan)
    grads = list(outs[:len(accs)]) + [None] * (3 - len(accs))
    return (*grads, outs[-1] if sink is not None else None)
