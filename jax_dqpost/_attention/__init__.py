"""Attention's machinery, under the public ``attention/`` and ``fa4jax.py``: attention in jax.numpy, in jax.nn's and
FlashAttention's conventions (``xla``), and in blocks of keys (``xla_chunked``); FlashAttention-4 through fa4-jax's
kernels, finished by jax-dqpost (``fa4``); the ``jax.custom_jvp`` around such kernels, forward mode theirs and
reverse mode ending in one jax-dqpost launch, with or without a learnable sink (``autodiff``); and what fa4-jax's
kernels are called with, its private names in one place (``fa4jax_internals``)."""
