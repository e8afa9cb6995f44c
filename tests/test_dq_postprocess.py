"""dq_postprocess against the independent oracle, bit for bit, on every platform present.

On CPU this checks the jax.numpy reference; where a CUDA GPU is present the same tests run the CuTe
kernel through our XLA FFI target.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FA_HOPPER_CONFIGS, FA_HOPPER_HEAD_DIM, PLATFORMS, fa_cute_hopper_config
from jax_dqpost import DISABLED_CHECKS, AccumLayout, dq_postprocess
import oracle

DTYPES = [jnp.bfloat16, jnp.float16]


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16)


def assert_same_bits(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    gnan, wnan = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    assert np.array_equal(gnan, wnan), f"{what}: NaN positions differ"
    diff = (_bits(got) != _bits(want)) & ~wnan
    if diff.any():
        idx = np.argwhere(diff)[:5]
        raise AssertionError(f"{what}: {diff.sum()} of {diff.size} elements differ, first at {idx.tolist()}: "
                             f"got {[got[tuple(i)] for i in idx]} want {[want[tuple(i)] for i in idx]}")


def run_case(rng, platform, config, head_dim, seqlen, dtype, *, batch=2, heads=3, scale=None):
    """``config``: an AccumLayout, or a Hopper (tile_m, threads, atom, swap, mult) tuple."""
    layout = config if isinstance(config, AccumLayout) else AccumLayout(90, *config)
    logical = oracle.random_logical(rng, (batch, seqlen, heads, head_dim))
    acc = oracle.build_accumulator(logical, (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab),
                                   hdim_multiple_of=layout.hdim_multiple_of, rng=rng, arch=layout.arch,
                                   two_cta=layout.two_cta)
    scale = float(rng.uniform(0.05, 2.0)) if scale is None else scale
    device = jax.devices(platform)[0]
    fn = jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=seqlen, head_dim=head_dim, dtype=dtype, layout=layout))
    got = fn(jax.device_put(acc, device), jax.device_put(np.float32(scale), device))
    assert got.devices() == {device}
    assert_same_bits(got, oracle.expected_dq(logical, scale, dtype), f"{platform} {layout} D={head_dim} S={seqlen}")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(FA_HOPPER_CONFIGS))
def test_flash_attention_hopper_configs(rng, platform, dtype, name):
    # Partial last tile, exactly one tile, several tiles.
    tile_m = FA_HOPPER_CONFIGS[name][0]
    for seqlen in (1, tile_m, 3 * tile_m - 5):
        run_case(rng, platform, FA_HOPPER_CONFIGS[name], FA_HOPPER_HEAD_DIM[name], seqlen, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("head_dim", range(8, 257, 8))
def test_every_head_dim(rng, platform, dtype, head_dim):
    causal = bool(rng.integers(2))
    run_case(rng, platform, fa_cute_hopper_config(head_dim, causal), head_dim, int(rng.integers(1, 300)), dtype,
             batch=1, heads=2)


OTHER_ORDERS = {
    "sm120": (AccumLayout(80, 64, 128, 4, False, 32), (64, 128, 96, 256)),
    "sm80-swap": (AccumLayout(80, 64, 256, 2, True, 32), (128, 256)),
    "sm80-cxx-hd64": (AccumLayout(80, 128, 256, 4, False, 64), (64, 40)),
    "sm100-1cta": (AccumLayout(100, 128, 128, 1, False, 32), (64, 96, 120)),
    "sm100-2cta": (AccumLayout(100, 128, 128, 1, False, 32, two_cta=True), (128, 192, 160)),
    "row-major": (AccumLayout(None, 64, 256, 1, False, 32), (40, 128, 256)),
}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(OTHER_ORDERS))
def test_other_accumulator_orders(rng, platform, dtype, name):
    layout, head_dims = OTHER_ORDERS[name]
    for head_dim in head_dims:
        for seqlen in (layout.tile_m - 1, 2 * layout.tile_m + 3):
            run_case(rng, platform, layout, head_dim, seqlen, dtype, batch=2, heads=2)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("arch", [90, 100, 120])
def test_flash_attention_presets(rng, platform, dtype, arch):
    for head_dim in (8, 40, 64, 72, 96, 120, 128, 136, 192, 200, 256):
        if arch == 100 and head_dim > 192:
            continue
        layout = AccumLayout.flash_attention(arch, head_dim, causal=bool(rng.integers(2)))
        run_case(rng, platform, layout, head_dim, int(rng.integers(1, 2 * layout.tile_m)), dtype, batch=1, heads=2)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0**-7, 1 / 3])
def test_rounding_ties_and_specials(rng, platform, scale):
    # scale 1 and powers of two keep the constructed bf16/fp16 ties exact ties.
    for dtype in DTYPES:
        run_case(rng, platform, FA_HOPPER_CONFIGS["cute-hd128-causal"], 128, 200, dtype, scale=scale)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_traced_scale_matches_python_float(rng, platform):
    layout = AccumLayout(90, 64, 256, 1, False, 32)
    acc = oracle.build_accumulator(oracle.random_logical(rng, (1, 70, 2, 64)), (64, 256, 1, False),
                                   hdim_multiple_of=32, rng=rng)
    device = jax.devices(platform)[0]
    acc = jax.device_put(acc, device)
    f_traced = jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=70, head_dim=64, layout=layout))
    f_const = jax.jit(lambda a: dq_postprocess(a, 0.1, seqlen_q=70, head_dim=64, layout=layout))
    assert_same_bits(f_traced(acc, jnp.float32(0.1)), f_const(acc), "traced vs static scale")
    # A float64 Python scale is rounded to float32 once, like FlashAttention's kernel argument.
    assert_same_bits(f_const(acc), f_traced(acc, jnp.float32(np.float32(0.1))), "float32(0.1)")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_empty_shapes(platform):
    layout = AccumLayout(90, 64, 256, 1, False, 32)
    device = jax.devices(platform)[0]
    for b, h, s in [(0, 2, 10), (2, 0, 10), (2, 2, 0)]:
        acc = jax.device_put(jnp.zeros(layout.accum_shape(b, h, s, 64), jnp.float32), device)
        out = jax.jit(lambda a: dq_postprocess(a, 1.0, seqlen_q=s, head_dim=64, layout=layout))(acc)
        assert out.shape == (b, s, h, 64)


def test_errors_name_argument_and_value():
    layout = AccumLayout(90, 64, 256, 1, False, 32)
    acc = jnp.zeros(layout.accum_shape(1, 1, 64, 128), jnp.float32)
    call = lambda **kw: dq_postprocess(**{**dict(dq_accum=acc, scale=1.0, seqlen_q=64, head_dim=128,
                                                 layout=layout), **kw})
    cases = [
        (dict(head_dim=100), ValueError, "head_dim .* got 100"),
        (dict(head_dim=264), ValueError, "head_dim .* got 264"),
        (dict(head_dim=128.0), TypeError, "head_dim must be a Python int, got 128.0"),
        (dict(seqlen_q=-1), ValueError, "seqlen_q must be >= 0, got -1"),
        (dict(seqlen_q=jnp.int32(64)), TypeError, "seqlen_q must be a Python int"),
        (dict(seqlen_q=65), ValueError, r"dq_accum.shape\[2\] must be Sr\*Dr = 128\*128"),
        (dict(dq_accum=acc.astype(jnp.bfloat16)), TypeError, "dq_accum must be float32, got bfloat16"),
        (dict(dq_accum=acc[0]), ValueError, r"dq_accum must have shape \(batch, heads, Sr\*Dr\), got shape"),
        (dict(dtype=jnp.float32), ValueError, "dtype must be jnp.bfloat16 or jnp.float16, got float32"),
        (dict(dtype=None), TypeError, r"dtype must be jnp.bfloat16 or jnp.float16, got None \(NoneType\)"),
        (dict(dtype="bfloat17"), TypeError, r"dtype must be .* got 'bfloat17' \(str\)"),
        (dict(scale=jnp.ones(2)), ValueError, r"scale must be a scalar, got shape \(2,\)"),
        (dict(scale=jnp.int32(1)), TypeError, "scale must be a Python float or a floating-point scalar, got .* int32"),
        (dict(scale=True), TypeError, r"scale must be a Python float .* got True \(bool\)"),
        (dict(scale="0.1"), TypeError, r"scale must be a Python float .* got '0.1' \(str\)"),
        (dict(scale=1j), TypeError, r"scale must be a Python float .* got 1j \(complex\)"),
        (dict(scale=None), TypeError, r"scale must be a Python float .* got None \(NoneType\)"),
        (dict(layout=(90, 64)), TypeError, r"layout must be an AccumLayout, got \(90, 64\) \(tuple\)"),
        (dict(layout=AccumLayout(90, 80, 256, 1, True, 32), head_dim=96), ValueError,
         "head_dim=96 .* 64-row WGMMA atoms"),
    ]
    for kwargs, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call(**kwargs)
        with pytest.raises(exc, match=pattern):  # the same error at trace time under jit
            jax.jit(lambda a: call(**{**kwargs, "dq_accum": kwargs.get("dq_accum", a)}))(acc)


def test_layout_is_required_and_the_error_says_how_to_get_one():
    """No default order: an accumulator read in another order gives wrong values, not an error."""
    import inspect

    from jax_dqpost import dq_accum_from_dq, flash_attention_postprocess

    hint = r"AccumLayout.flash_attention\(arch, head_dim\) .*tensor='dkv'.*AccumLayout\(arch=None\) a row-major"
    acc = jnp.zeros(AccumLayout.flash_attention(90, 128).accum_shape(1, 1, 64, 128), jnp.float32)
    dense = dict(seqlen_q=64, head_dim=128)
    calls = [(dq_postprocess, "layout", (acc, 1.0), dense),
             (dq_accum_from_dq, "layout", (jnp.zeros((1, 64, 1, 128), jnp.bfloat16), 1.0), {}),
             (flash_attention_postprocess, "dq_layout", (acc, None, None, 1.0), dense)]
    for fn, name, args, kwargs in calls:
        assert inspect.signature(fn).parameters[name].default is inspect.Parameter.empty, fn.__name__
        with pytest.raises(TypeError, match=rf"{fn.__name__}\(\) needs {name}=, .*{hint}"):
            fn(*args, **kwargs)
        with pytest.raises(TypeError, match=rf"{name} must be an AccumLayout, got None \(NoneType\) \({hint}"):
            fn(*args, **kwargs, **{name: None})


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
