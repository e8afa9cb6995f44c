"""Context parallelism: how a sequence lies over the devices of one mesh axis, and the positions of a device's rows.

A sequence of ``L`` rows sharded over ``n`` devices gives each device ``L / n`` of them, laid out one of two ways
(:data:`LAYOUTS`):

- ``'contiguous'``: device ``i`` holds rows ``[i L/n, (i + 1) L/n)``.
- ``'zigzag'``: the sequence cut into ``2n`` chunks of ``c = L / (2n)`` rows; device ``i`` holds chunk ``i`` then
  chunk ``2n - 1 - i`` (rows ``[i c, (i + 1) c)`` then ``[(2n - 1 - i) c, (2n - i) c)``), so that under a causal
  mask every device holds one early and one late chunk and does the same work. :func:`zigzag` puts a sequence in
  this order (sharding its result evenly over the axis gives each device its two chunks), :func:`unzigzag` back.

Attention gathers every device's keys in device order (``jax.lax.all_gather(..., tiled=True)``): their global
positions are :func:`gathered_positions`, a device's queries' :func:`positions`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .._checks import describe, static_int

LAYOUTS = ("contiguous", "zigzag")
"""The layouts of a sequence over the devices (module docstring)."""


def _order(n: int) -> np.ndarray:
    """The zigzag order of the ``2n`` chunks: ``0, 2n-1, 1, 2n-2, ..., n-1, n``."""
    return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def _permute(x, n, axis, order, name):
    x = jnp.asarray(x)
    n = static_int("n", n, minimum=1)
    axis = static_int("axis", axis)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis must name one of the array's {x.ndim} dimensions (shape {tuple(x.shape)}), got "
                         f"{axis}")
    axis %= x.ndim
    length = x.shape[axis]
    if length % (2 * n):
        raise ValueError(f"{name} cuts axis {axis} into 2 * n = {2 * n} chunks: its length must be a multiple of "
                         f"{2 * n}, got {describe(x)}")
    chunks = x.reshape(*x.shape[:axis], 2 * n, length // (2 * n), *x.shape[axis + 1:])
    return jnp.take(chunks, jnp.asarray(order(n)), axis=axis).reshape(x.shape)


def zigzag(x: ArrayLike, n: int, axis: int = 1) -> jax.Array:
    """A sequence in the zigzag order of ``n`` devices, the layout ``context_layout='zigzag'`` of
    :func:`~jax_dqpost.dot_product_attention` reads.

    ``x``'s axis ``axis`` (a sequence of length ``L``, a multiple of ``2 n``; e.g. ``(B, T, N, H)`` with
    ``axis=1``) is cut into ``2 n`` chunks of ``L / (2 n)`` rows, and chunks ``i`` and ``2 n - 1 - i`` are put
    together, ``i = 0 .. n - 1``: the result, of ``x``'s shape and dtype, sharded evenly over ``n`` devices along
    that axis, holds chunks ``i`` and ``2 n - 1 - i`` on device ``i``. An exact permutation; :func:`unzigzag` undoes
    it.

    Args:
      x: an array (or anything ``jnp.asarray`` takes).
      n: the devices, a positive Python int.
      axis: the sequence axis.

    Returns:
      ``x`` permuted along ``axis``.

    Raises:
      ValueError: ``axis``'s length is not a multiple of ``2 n``, or ``n`` is below 1.
      TypeError: ``n`` or ``axis`` is not a Python int.
    """
    return _permute(x, n, axis, _order, "zigzag")


def unzigzag(x: ArrayLike, n: int, axis: int = 1) -> jax.Array:
    """:func:`zigzag`'s inverse: a sequence in the zigzag order of ``n`` devices (as each device's output of
    ``context_layout='zigzag'`` attention, gathered in device order) back in its own order. Arguments, result and
    errors as :func:`zigzag`'s."""
    return _permute(x, n, axis, lambda n: np.argsort(_order(n)), "unzigzag")


def positions(layout: str, length: int, devices: int, index) -> jax.Array:
    """int32 ``(length,)``: the global positions of the ``length`` rows device ``index`` (an int or a traced
    ``axis_index``) of ``devices`` holds in ``layout`` (for ``'zigzag'``, ``length`` is even)."""
    rows = jnp.arange(length, dtype=jnp.int32)
    index = jnp.asarray(index, jnp.int32)
    if layout == "contiguous":
        return index * length + rows
    c = length // 2
    chunk = jnp.where(rows < c, index, 2 * devices - 1 - index)
    return chunk * c + rows % c


def gathered_positions(layout: str, length: int, devices: int) -> np.ndarray:
    """int32 ``(devices * length,)``: the global positions of every device's ``length`` rows, in device order (as
    ``jax.lax.all_gather(..., tiled=True)`` puts them)."""
    rows = np.arange(length)
    if layout == "contiguous":
        return np.arange(devices * length, dtype=np.int32)
    c = length // 2
    return np.concatenate([np.where(rows < c, i, 2 * devices - 1 - i) * c + rows % c
                           for i in range(devices)]).astype(np.int32)


def gather(x, axis_name):
    """``x`` ``(B, S, ...)`` of every device of ``axis_name``, concatenated along ``S`` in device order."""
    return jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
