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

A causal window of ``left`` keys before each row, ``left`` at most a run's length (:func:`halo`), reaches no key
but its own rows' and the ``left`` before each run: those are all a device receives (:func:`neighbours`, a
``jax.lax.ppermute`` from the device holding the previous run), each run's keys laid out as
``[the left before it, its own]``, the sequence's first run's as ``[its own, left zeros]`` (:func:`arrange`), their
positions :func:`neighbour_positions`.

FlashAttention's kernels count a causal mask and a window from the end of the keys they read (bottom-right), with
no positions: :func:`flash_chunks` gives them a device's rows as one packed sequence per chunk (``'contiguous'``
one, ``'zigzag'`` two), each reading the gathered keys in sequence order (:func:`in_sequence_order`) up to its own
last row, so that the keys' end is the chunk's end and the kernel's mask is the global one.
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


def chunks(layout: str) -> int:
    """How many runs of consecutive positions a device's rows are in ``layout``: 1 (``'contiguous'``), 2
    (``'zigzag'``)."""
    return 1 if layout == "contiguous" else 2


def flash_chunks(layout: str, length: int, devices: int, index) -> jax.Array:
    """int32 ``(chunks(layout),)``: for each run of consecutive positions among the ``length`` rows of device
    ``index`` (an int or a traced ``axis_index``), how many keys of the sequence come up to its last row (that
    row's position plus one), the keys a causal kernel reads for it."""
    return positions(layout, length, devices, index).reshape(chunks(layout), -1)[:, -1] + 1


def in_sequence_order(x, layout: str, devices: int):
    """``x`` ``(B, n L, ...)``, every device's rows gathered in device order (:func:`gather`), in sequence order
    (for ``'zigzag'`` :func:`unzigzag`; for ``'contiguous'`` ``x`` itself)."""
    return x if layout == "contiguous" else unzigzag(x, devices, axis=1)


def reach(causal: bool, window) -> tuple:
    """``(left, right)``: the keys a row sees before and after its own under a causal mask and a window (None
    sides unbounded; causal: ``right`` 0)."""
    left, right = window if window is not None else (None, None)
    return left, 0 if causal else right


NOWHERE = -(2 ** 30)
"""The position of a key that is not there (before the sequence's first row): no row's window reaches it."""


def halo(causal: bool, window, layout: str, length: int, lengths: bool = False) -> int | None:
    """The keys before each run of a device's ``length`` rows that a mask reaches, where it reaches no other key
    than those and the run's own: the left side of a window whose right side is 0 (or that is causal), when it is
    at most a run's length; None where the mask reaches further, or where there are ``lengths`` (a row they leave
    no key averages every value, as jax.nn's does: all of them gathered)."""
    left, right = reach(causal, window)
    if lengths or left is None or right != 0 or left > length // chunks(layout):
        return None
    return left


def _check_halo(left: int, length: int, layout: str):
    if not 0 <= left <= length // chunks(layout):
        raise ValueError(f"a halo of {left} keys before each run of {length // chunks(layout)} rows ({layout!r}): "
                         "context.halo gives none longer than a run")


def arrange(own, before, first):
    """Each run's keys ``(B, m (left + c), ...)``: ``own`` ``(B, m c, ...)`` a device's rows (``m`` runs of ``c``),
    ``before`` ``(B, m, left, ...)`` the ``left`` rows before each run; run ``r`` as ``[before[r], own run r]``, but
    where ``first`` (a traced bool: the device holds the sequence's first run, its first) as ``[own run 0,
    before[0]]``: there is nothing before it, and what stands in ``before[0]`` is read by no row."""
    b, rows = own.shape[:2]
    m, left = before.shape[1:3]
    runs = own.reshape(b, m, rows // m, *own.shape[2:])
    keys = jnp.concatenate([before, runs], axis=2)
    if left:
        head = jnp.concatenate([runs[:, 0], before[:, 0]], axis=1)
        keys = keys.at[:, 0].set(jnp.where(first, head, keys[:, 0]))
    return keys.reshape(b, m * (left + rows // m), *own.shape[2:])


def neighbours(x, axis_name: str, layout: str, devices: int, index, left: int):
    """:func:`arrange` of ``x`` ``(B, L, ...)``, the rows of device ``index`` (its ``axis_index``), and the
    ``left`` rows before each of its runs, received from the devices that hold them (``jax.lax.ppermute``): in
    ``'contiguous'`` from the previous device; in ``'zigzag'`` the first run's from the previous device's first run,
    the second's from the next device's second (the last device's: its own first run's)."""
    b, rows = x.shape[:2]
    _check_halo(left, rows, layout)
    m = chunks(layout)
    c = rows // m
    runs = x.reshape(b, m, c, *x.shape[2:])
    tails = runs[:, :, c - left:]
    forward = [(i, i + 1) for i in range(devices - 1)]
    if left == 0:
        before = tails
    elif layout == "contiguous":
        before = jax.lax.ppermute(tails, axis_name, forward)
    else:
        first = jax.lax.ppermute(tails[:, :1], axis_name, forward)
        second = jax.lax.ppermute(tails[:, 1:], axis_name, [(j, i) for i, j in forward])
        second = jnp.where(index == devices - 1, tails[:, :1], second)
        before = jnp.concatenate([first, second], axis=1)
    return arrange(x, before, index == 0)


def neighbour_positions(layout: str, length: int, devices: int, index, left: int) -> jax.Array:
    """int32 ``(m (left + c),)``: the positions of :func:`neighbours`' keys on device ``index``, each position
    once, as a mask over all of them reads them: :data:`NOWHERE` for those that are not there, and for the keys
    before zigzag's second run on the last device, which are its first run's own."""
    _check_halo(left, length, layout)
    own = positions(layout, length, devices, index)
    m = chunks(layout)
    starts = own.reshape(m, length // m)[:, :1]
    before = starts - left + jnp.arange(left, dtype=jnp.int32)
    before = jnp.where(before < 0, NOWHERE, before)
    if m == 2:
        before = before.at[1].set(jnp.where(jnp.asarray(index) == devices - 1, NOWHERE, before[1]))
    return arrange(own[None], before[None], jnp.asarray(index) == 0)[0]
