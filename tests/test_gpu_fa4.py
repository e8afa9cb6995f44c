"""On the GPU (skipped without one), bit-for-bit agreement with upstream FlashAttention-4's postprocess on the same
accumulators: dense and packed Hopper orders, and the sm80 order (tests/test_fa4_producer.py: its real backward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DTYPES, FA_HOPPER_CONFIGS, FA_HOPPER_HEAD_DIM, HAS_GPU
from jax_dqpost import AccumLayout, dq_postprocess
import oracle
from oracle import assert_same_bits
from support import cu_seqlens

pytestmark = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


# FlashAttention-4 4.0.0b36 uses names that CuTe DSL 4.8.1 deprecates: its warnings, not ours, in the tests that run it.
_PEER_DEPRECATIONS = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _flash_attn_postprocess():
    try:
        from flash_attn.cute.interface import _bwd_postprocess_convert
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is absent
        pytest.skip(f"flash_attn.cute not importable: {e}")
    return _bwd_postprocess_convert


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(FA_HOPPER_CONFIGS))
@_PEER_DEPRECATIONS
def test_bit_identical_to_flash_attention_4(rng, name, dtype):
    torch = pytest.importorskip("torch")
    import cutlass

    postprocess = _flash_attn_postprocess()
    tile_m, threads, atom, swap, mult = FA_HOPPER_CONFIGS[name]
    for seqlen in (tile_m + 7, 1000):
        layout, D, logical, acc, scale, want = oracle.hopper_case(rng, name, dtype, seqlen)
        B, S, H, _ = logical.shape
        ours = jax.jit(lambda a, s: dq_postprocess(a, s, seqlen_q=S, head_dim=D, dtype=dtype, layout=layout))(
            acc, np.float32(scale))
        t_dtype = {np.dtype(jnp.bfloat16): torch.bfloat16, np.dtype(jnp.float16): torch.float16}[np.dtype(dtype)]
        out = torch.full((B, S, H, D), float("nan"), dtype=t_dtype, device="cuda")
        cdt = cutlass.BFloat16 if t_dtype == torch.bfloat16 else cutlass.Float16
        try:
            postprocess(torch.from_numpy(acc).cuda(), out, scale, None, None, 90, cdt, D, tile_m, threads,
                        atom, swap, fake_mode=False, hdim_multiple_of=mult)
        except Exception as e:  # noqa: BLE001 - report configurations the peer cannot run
            pytest.skip(f"FlashAttention-4 cannot run {name}: {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.synchronize()
        theirs = out.view(torch.int16).cpu().numpy().view(np.uint16).view(np.dtype(dtype))
        assert_same_bits(ours, want, f"ours vs oracle {name} S={seqlen}")
        try:
            assert_same_bits(theirs, want, f"FlashAttention-4 vs oracle {name} S={seqlen}")
        except AssertionError as e:
            if name.startswith("cxx-"):  # a C++ FA3 configuration FlashAttention-4's CuTe code never uses
                pytest.xfail(f"FlashAttention-4's CuTe postprocess does not implement {name}: {e}")
            raise
        assert_same_bits(ours, theirs, f"ours vs FlashAttention-4 {name} S={seqlen}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", ["cute-hd64", "cute-hd96-single-wg", "cute-hd128-causal", "cute-hd128",
                                  "cute-hd192", "cute-hd256"])
@_PEER_DEPRECATIONS
def test_varlen_bit_identical_to_flash_attention_4(rng, name, dtype):
    torch = pytest.importorskip("torch")
    import cutlass

    postprocess = _flash_attn_postprocess()
    tile_m, threads, atom, swap, mult = FA_HOPPER_CONFIGS[name]
    D, H = FA_HOPPER_HEAD_DIM[name], 3
    layout = AccumLayout(90, tile_m, threads, atom, swap, mult)
    for batch, mean in ((7, 200), (300, 20)):  # 300 > FlashAttention's binary-search threshold
        lengths = [int(x) for x in rng.integers(0, 2 * mean + 1, batch)]
        cu = cu_seqlens(lengths).tolist()
        used = [int(rng.integers(0, n + 1)) for n in lengths] if batch == 7 else None
        T, scale = cu[-1] + 11, float(rng.uniform(0.05, 2.0))
        acc, want = oracle.build_varlen(rng, cu, used, T, H, D, (tile_m, threads, atom, swap), hdim_multiple_of=mult,
                                        scale=scale, dtype=dtype)
        ours = np.asarray(jax.jit(lambda a: dq_postprocess(a, scale, head_dim=D, total_q=T, cu_seqlens_q=cu,
                                                            seqused_q=used, dtype=dtype, layout=layout))(acc))
        assert_same_bits(ours, want, f"ours vs oracle {name} B={batch}")
        t_dtype = {np.dtype(jnp.bfloat16): torch.bfloat16, np.dtype(jnp.float16): torch.float16}[np.dtype(dtype)]
        out = torch.full((T, H, D), float("nan"), dtype=t_dtype, device="cuda")
        cdt = cutlass.BFloat16 if t_dtype == torch.bfloat16 else cutlass.Float16
        t_cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
        t_used = None if used is None else torch.tensor(used, dtype=torch.int32, device="cuda")
        postprocess(torch.from_numpy(acc).cuda(), out, scale, t_cu, t_used, 90, cdt, D, tile_m, threads, atom, swap,
                    fake_mode=False, hdim_multiple_of=mult)
        torch.cuda.synchronize()
        theirs = out.view(torch.int16).cpu().numpy().view(np.uint16).view(np.dtype(dtype))
        covered = np.zeros(T, bool)  # FlashAttention-4 leaves other rows as they were
        for b in range(batch):
            covered[cu[b]: cu[b] + (lengths[b] if used is None else used[b])] = True
        assert_same_bits(ours[covered], theirs[covered], f"ours vs FlashAttention-4 varlen {name} B={batch}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("layout, head_dim", [
    (AccumLayout(80, 64, 128, 4, False, 32), 64), (AccumLayout(80, 64, 128, 4, False, 32), 128),
    (AccumLayout(80, 64, 128, 4, False, 32), 256), (AccumLayout(80, 128, 256, 4, False, 64), 64),
    (AccumLayout(80, 64, 256, 2, True, 32), 128)], ids=["sm120-hd64", "sm120-hd128", "sm120-hd256", "sm80-hd64",
                                                        "sm80-swap-hd128"])
@_PEER_DEPRECATIONS
def test_sm80_order_bit_identical_to_flash_attention_4(rng, layout, head_dim, dtype):
    """FlashAttention-4's sm80/sm120 postprocess path runs on the H200: same bits on the same accumulators."""
    torch = pytest.importorskip("torch")
    import cutlass

    postprocess = _flash_attn_postprocess()
    B, S, H, D = 2, 3 * layout.tile_m + 7, 3, head_dim
    logical = oracle.random_logical(rng, (B, S, H, D))
    acc = oracle.build_accumulator(logical, (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab),
                                   hdim_multiple_of=layout.hdim_multiple_of, rng=rng, arch=80)
    scale = float(rng.uniform(0.05, 2.0))
    ours = jax.jit(lambda a: dq_postprocess(a, scale, seqlen_q=S, head_dim=D, dtype=dtype, layout=layout))(acc)
    assert_same_bits(ours, oracle.expected_dq(logical, scale, dtype), "ours vs oracle")
    t_dtype = {np.dtype(jnp.bfloat16): torch.bfloat16, np.dtype(jnp.float16): torch.float16}[np.dtype(dtype)]
    out = torch.full((B, S, H, D), float("nan"), dtype=t_dtype, device="cuda")
    cdt = cutlass.BFloat16 if t_dtype == torch.bfloat16 else cutlass.Float16
    try:
        postprocess(torch.from_numpy(acc).cuda(), out, scale, None, None, 80, cdt, D, layout.tile_m,
                    layout.num_threads, layout.atom_layout, layout.swap_ab, fake_mode=False,
                    hdim_multiple_of=layout.hdim_multiple_of)
    except Exception as e:  # noqa: BLE001 - report configurations the peer cannot run
        pytest.skip(f"FlashAttention-4 cannot run {layout} D={D}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()
    theirs = out.view(torch.int16).cpu().numpy().view(np.uint16).view(np.dtype(dtype))
    assert_same_bits(ours, theirs, f"ours vs FlashAttention-4 sm80 path {layout} D={D}")
