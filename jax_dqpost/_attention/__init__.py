"""Attention's machinery, under the public ``attention.py`` and ``fa4jax.py``: attention in jax.numpy, in jax.nn's and
FlashAttention's conventions (``xla``); the ``jax.custom_vjp`` whose backward ends in one jax-dqpost launch, for a
learnable sink and the lse's cotangent (``vjp``); and what fa4-jax's kernels are called with, its private names in
one place (``fa4jax_internals``)."""
