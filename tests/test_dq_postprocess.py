"""dq_postprocess's kernel configurations: scales, values and shapes are run-time arguments of one compiled kernel.

Its results against the oracle: tests/test_postprocess.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dqpost import DISABLED_CHECKS, AccumLayout, dq_postprocess


def test_scale_and_values_do_not_recompile(rng):
    from jax_dqpost import kernel_cache

    layout = AccumLayout(90, 64, 256, 1, False, 32)
    f = jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=100, head_dim=128, layout=layout))
    exported = lambda: jax.export.export(f, platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(
        jax.ShapeDtypeStruct(layout.accum_shape(2, 2, 100, 128), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))
    exported()
    n = kernel_cache.cache_size()
    for scale in (0.5, 0.25):
        f(jnp.asarray(rng.standard_normal(layout.accum_shape(2, 2, 100, 128)), jnp.float32), jnp.float32(scale))
    # Other shapes of the same binary configuration reuse the compiled kernel.
    jax.export.export(jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=7, head_dim=120, layout=layout)),
                      platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(
        jax.ShapeDtypeStruct(layout.accum_shape(5, 1, 7, 120), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))
    assert kernel_cache.cache_size() == n
