"""On the GPU (skipped without one), the kernel itself: outputs poisoned before each run (every element written,
nothing past the end), and the FFI target's refusals of buffers and attributes that do not fit.

The oracle comparisons of test_postprocess.py also run on the GPU through the FFI target (on poisoned outputs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DTYPES, FA_HOPPER_CONFIGS, FA_HOPPER_HEAD_DIM, HAS_GPU, OTHER_ORDERS
from jax_dqpost import AccumLayout, dq_postprocess
import oracle
from oracle import assert_same_bits
from support import cu_seqlens, one_part_kernel

pytestmark = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")

POISON = oracle.POISON_BITS[2]  # a NaN in both bf16 and fp16: any element the kernel leaves unwritten shows
GUARD = 4096  # poisoned elements after the output: any write past its end shows


_EXECUTORS = {}


def _kernels(plan, acc_shape):
    """The kernel of a one-part ``plan`` on an accumulator of ``acc_shape``, with each work unit the package may
    choose: each split of its tiles (``Tuning.shares``: ``tuning.call_shares``, 1 and the finest) and, varlen with
    short tiles, short-tile CTAs of 8 heads and of 1 (``Tuning.short_heads``)."""
    from jax_dqpost._kernel import spec as kernel_spec, tuning, varlen

    spec = plan.kernel([acc_shape])
    t = spec.tensors[0]
    short = t.tiling == kernel_spec.Tiling.VARLEN and varlen.short_rows(t.layout)
    return [dataclasses.replace(spec, tuning=kernel_spec.Tuning(s, h))
            for s in tuning.call_shares(t.layout, t.padded_head_dim)
            for h in sorted({varlen.SHORT_HEADS, 1 if short else varlen.SHORT_HEADS})]


def _run_on_poisoned_output(torch, spec, plan, t_acc, t_aux, t_scale, n, acc_shape, what):
    """Run kernel ``spec`` of ``plan`` directly, its output a poisoned buffer of ``n`` 16-bit elements with a poisoned
    guard zone after it: the output's bits (uint16), once nothing past its end was written."""
    import cuda.bindings.driver as cuda

    from jax_dqpost._kernel import arch, cache as kernel_cache
    from jax_dqpost._kernel.kernel import entry_args

    if spec not in _EXECUTORS:
        _EXECUTORS[spec] = kernel_cache.compile_executor(spec, arch.target_arch())
    executor = _EXECUTORS[spec]

    t_out = torch.full((n + GUARD,), np.uint16(POISON).view(np.int16).item(), dtype=torch.int16, device="cuda")
    # abi.pointers(1, False): dq_accum, q_aux (varlen metadata; unused when dense), scales, dq
    addresses = [t_acc.data_ptr(), t_aux.data_ptr(), t_scale.data_ptr(), t_out.data_ptr()]
    executor(*entry_args(spec.dtype, 1, None, addresses, plan.launch([acc_shape])[0]),
             cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    out = t_out.cpu().numpy().view(np.uint16)
    assert (out[n:] == POISON).all(), f"{what}: kernel wrote past the end of dQ"
    return out[:n]


def _kernel_on_poisoned_output(rng, layout, head_dim, seqlen, dtype, what):
    """Run the compiled module directly on a poisoned buffer with a poisoned guard zone after it."""
    torch = pytest.importorskip("torch")

    from jax_dqpost.postprocess._primitive.plan import Part, Plan

    B, H, D, S = 2, 3, head_dim, seqlen
    logical = oracle.random_logical(rng, (B, S, H, D))
    acc = oracle.build_accumulator(logical, (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab),
                                   hdim_multiple_of=layout.hdim_multiple_of, rng=rng, arch=layout.arch,
                                   two_cta=layout.two_cta)
    scale = float(rng.uniform(0.05, 2.0))
    want = oracle.expected_dq(logical, scale, dtype)
    plan = Plan((Part(layout, D, np.dtype(dtype), seqlen=S),))
    t_acc, t_scale = torch.from_numpy(acc).cuda(), torch.tensor([scale], dtype=torch.float32).cuda()
    for spec in _kernels(plan, acc.shape):
        out = _run_on_poisoned_output(torch, spec, plan, t_acc, t_scale, t_scale, B * S * H * D, acc.shape, what)
        assert_same_bits(out.view(np.dtype(dtype)).reshape(B, S, H, D), want, f"{what} split {spec.tuning.shares}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(FA_HOPPER_CONFIGS))
def test_kernel_on_poisoned_output(rng, name, dtype):
    layout = AccumLayout(90, *FA_HOPPER_CONFIGS[name])
    for seqlen in (layout.tile_m - 3, 5 * layout.tile_m + 1):
        _kernel_on_poisoned_output(rng, layout, FA_HOPPER_HEAD_DIM[name], seqlen, dtype, f"kernel {name} S={seqlen}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(FA_HOPPER_CONFIGS))
def test_varlen_kernel_on_poisoned_output(rng, name, dtype):
    """Packed sequences (an empty one, partial and whole tiles, seqused shorter than some, rows after the last), each
    split of the tiles, static and traced offsets' slots: the module run directly on a poisoned buffer with a
    poisoned guard zone after it."""
    layout, D = AccumLayout(90, *FA_HOPPER_CONFIGS[name]), FA_HOPPER_HEAD_DIM[name]
    tm = layout.tile_m
    lengths = [0, tm - 3, 2 * tm, 3 * tm + 17, 1, 5]
    used = [n if i % 2 else int(rng.integers(0, n + 1)) for i, n in enumerate(lengths)]
    _varlen_on_poisoned_output(rng, layout, D, 3, lengths, used, 9, float(rng.uniform(0.05, 2.0)), dtype,
                               f"varlen {name}")


def _varlen_on_poisoned_output(rng, layout, D, H, lengths, used, rows_after, scale, dtype, what):
    """Sequences of ``lengths`` rows (the first ``used`` of each converted) packed before ``rows_after`` more rows:
    each kernel the package may choose (:func:`_kernels`), with static offsets' slots and traced ones', run directly
    on a poisoned buffer with a poisoned guard zone after it, its bits against the oracle's."""
    torch = pytest.importorskip("torch")

    from jax_dqpost._kernel import varlen
    from jax_dqpost.postprocess._primitive.plan import Part, Plan

    cu = cu_seqlens(lengths).tolist()
    T = cu[-1] + rows_after
    acc, want = oracle.build_varlen(rng, cu, used, T, H, D,
                                    (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab),
                                    hdim_multiple_of=layout.hdim_multiple_of, scale=scale, dtype=dtype)
    t_acc, t_scale = torch.from_numpy(acc).cuda(), torch.tensor([scale], dtype=torch.float32).cuda()
    for num_tiles in (None, varlen.WorkList.max_tiles(T, len(lengths), layout)):  # static offsets' slots, traced ones'
        work, meta = varlen.WorkList.build(np, cu, used, total=T, layout=layout, num_tiles=num_tiles)
        plan = Plan((Part(layout, D, np.dtype(dtype), work=work),))
        t_meta = torch.from_numpy(meta).cuda()
        for spec in _kernels(plan, acc.shape):
            out = _run_on_poisoned_output(torch, spec, plan, t_acc, t_meta, t_scale, T * H * D, acc.shape, what)
            assert_same_bits(out.view(np.dtype(dtype)).reshape(T, H, D), want, f"{what} {work} {spec.label}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(OTHER_ORDERS))
def test_other_orders_on_poisoned_output(rng, name, dtype):
    layout, head_dims = OTHER_ORDERS[name]
    for head_dim in head_dims:
        _kernel_on_poisoned_output(rng, layout, head_dim, 2 * layout.tile_m + 5, dtype, f"kernel {name} D={head_dim}")


SHORT_TILE_LAYOUTS = {  # the swapped Hopper orders, whose short varlen tiles take the kernel's short-tile path
    "dq-hd128": (AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36"), 128),
    "dkv-hd192": (AccumLayout.flash_attention(90, 192, causal=False, tensor="dkv", version="4.0.0b36"), 192),
    "dkv-hd256": (AccumLayout.flash_attention(90, 256, causal=False, tensor="dkv", version="4.0.0b36"), 256),
}


@pytest.mark.parametrize("heads", [6, 44])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", SHORT_TILE_LAYOUTS)
def test_short_varlen_tiles_on_poisoned_output(rng, name, dtype, heads):
    """Many sequences shorter than a tile (0..20 rows, seqused shorter still, rows no sequence covers), long ones
    with short last tiles, 6 or 44 heads (short-tile CTAs of 8 heads: one group, partial, or six, the last partial;
    or of one head) and a negative scale (zeros stay +0): the module run directly on a poisoned buffer with a
    poisoned guard zone after it."""
    layout, D = SHORT_TILE_LAYOUTS[name]
    lengths = [int(n) for n in rng.integers(0, 21, 300)]
    # an empty sequence, long ones (both paths in one launch: short last tiles of 5 and 16 rows, a long last tile of
    # 17, whole tiles), one row
    lengths[:6] = [0, layout.tile_m + 5, 2 * layout.tile_m + 16, layout.tile_m + 17, 2 * layout.tile_m, 1]
    used = [int(rng.integers(0, n + 1)) if i % 3 == 0 else n for i, n in enumerate(lengths)]
    _varlen_on_poisoned_output(rng, layout, D, heads, lengths, used, 7, -float(rng.uniform(0.05, 2.0)), dtype,
                               f"{name} short tiles")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_jax_output_poisoned_by_allocator_reuse(rng, dtype):
    """Through XLA: free a NaN-filled buffer of the output's size right before the call; when XLA's
    allocator hands the same memory to our output (checked by address), unwritten elements show."""
    name = "cute-hd128"
    layout, D, logical, acc, scale, want = oracle.hopper_case(rng, name, dtype, 1000)
    B, S, H, _ = logical.shape
    f = jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=S, head_dim=D, dtype=dtype, layout=layout))
    acc, scale_d = jax.device_put(acc), jax.device_put(np.float32(scale))
    f(acc, scale_d).block_until_ready()
    poisoned = tries = 0
    while poisoned < 3 and tries < 30:
        tries += 1
        poison = jax.lax.bitcast_convert_type(jnp.full((B, S, H, D), POISON, jnp.uint16), dtype).block_until_ready()
        ptr = poison.unsafe_buffer_pointer()
        poison.delete()
        out = f(acc, scale_d)
        poisoned += out.unsafe_buffer_pointer() == ptr
        assert_same_bits(out, want, "jax path")
    print(f"{poisoned}/{tries} runs wrote into the poisoned buffer")
    if not poisoned:  # the allocator's choice, not the kernel's: the kernel-level tests above always poison
        pytest.skip(f"XLA's allocator never handed the freed poisoned buffer to the output in {tries} tries")


def test_ffi_rejects_inconsistent_attributes(rng):
    """The handler validates the buffers against its attributes and returns an error, never launches."""
    from jax_dqpost.postprocess._primitive import ffi as _ffi
    from jax_dqpost._kernel import cache as kernel_cache

    layout = AccumLayout(90, 64, 256, 1, False, 32)
    kernel = kernel_cache.get_kernel(one_part_kernel(jnp.bfloat16, layout, 128))
    _ffi.register()
    acc = jnp.zeros(layout.accum_shape(1, 2, 64, 128), jnp.float32)
    out_bytes = 64 * 2 * 128 * 2

    def call(**attrs):
        base = dict(module=kernel.module, fingerprint=kernel.fingerprint,
                    bytes=np.asarray([acc.size * 4, 0, 4, out_bytes], np.int64),
                    extents=np.asarray([1, 2, 64, 128, 1], np.int64), ctas=np.int64(2))
        return jax.ffi.ffi_call(_ffi.TARGET_NAME, jax.ShapeDtypeStruct((1, 64, 2, 128), jnp.bfloat16))(
            acc, jnp.zeros((0,), jnp.int32), jnp.ones((1,), jnp.float32), **{**base, **attrs})

    call().block_until_ready()  # consistent: runs
    with pytest.raises(Exception, match=r"buffer 0 \(accum\) is int32 of rank 3, not what its role takes"):
        jax.ffi.ffi_call(_ffi.TARGET_NAME, jax.ShapeDtypeStruct((1, 64, 2, 128), jnp.bfloat16))(
            acc.view(jnp.int32), jnp.zeros((0,), jnp.int32), jnp.ones((1,), jnp.float32), module=kernel.module,
            fingerprint=kernel.fingerprint, bytes=np.asarray([acc.size * 4, 0, 4, out_bytes], np.int64),
            extents=np.asarray([1, 2, 64, 128, 1], np.int64), ctas=np.int64(2)).block_until_ready()  # same bytes
    with pytest.raises(Exception, match=r"buffer 3 \(out\) is bfloat16 of rank 3"):  # an output of another rank
        jax.ffi.ffi_call(_ffi.TARGET_NAME, jax.ShapeDtypeStruct((64, 2, 128), jnp.bfloat16))(
            acc, jnp.zeros((0,), jnp.int32), jnp.ones((1,), jnp.float32), module=kernel.module,
            fingerprint=kernel.fingerprint, bytes=np.asarray([acc.size * 4, 0, 4, out_bytes], np.int64),
            extents=np.asarray([1, 2, 64, 128, 1], np.int64), ctas=np.int64(2)).block_until_ready()
    for attrs, msg in [
        ({"bytes": np.asarray([acc.size * 4, 0, 4, out_bytes + 2], np.int64)}, "buffer 3 has"),
        ({"bytes": np.asarray([acc.size * 4, 0, 4], np.int64)}, "bytes does not match"),
        ({"extents": np.asarray([1, 2, 64, 128], np.int64)}, "do not fit the kernel"),
        ({"extents": np.asarray([1, 2, 64, 128, 1] * 4, np.int64)}, "do not fit the kernel"),
        ({"extents": np.asarray([1, 2, 2**31, 128, 1], np.int64)}, "int32 range"),
        ({"ctas": np.int64(2**31)}, "too many CTAs"),
    ]:
        with pytest.raises(Exception, match=msg):
            call(**attrs).block_until_ready()
