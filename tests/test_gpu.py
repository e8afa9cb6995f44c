"""GPU-only checks (skipped without a CUDA GPU): the kernel on poisoned outputs, the FFI target's
errors, and bit-for-bit agreement with upstream FlashAttention-4's postprocess on the same accumulators.

The oracle comparisons of test_postprocess.py also run on the GPU through the FFI target (on poisoned outputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DTYPES, FA_HOPPER_CONFIGS, FA_HOPPER_HEAD_DIM, HAS_GPU, OTHER_ORDERS
from jax_dqpost import AccumLayout, dq_postprocess
import oracle
from oracle import assert_same_bits

pytestmark = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")

POISON = 0xFFFF  # a NaN in both bf16 and fp16: any element the kernel leaves unwritten shows
GUARD = 4096  # poisoned elements after the output: any write past its end shows


def _torch():
    return pytest.importorskip("torch")


def _case(rng, name, dtype, seqlen, batch=2, heads=3):
    tile_m, threads, atom, swap, mult = FA_HOPPER_CONFIGS[name]
    head_dim = FA_HOPPER_HEAD_DIM[name]
    layout = AccumLayout(90, tile_m, threads, atom, swap, mult)
    logical = oracle.random_logical(rng, (batch, seqlen, heads, head_dim))
    acc = oracle.build_accumulator(logical, (tile_m, threads, atom, swap), hdim_multiple_of=mult, rng=rng)
    scale = float(rng.uniform(0.05, 2.0))
    return layout, head_dim, logical, acc, scale, oracle.expected_dq(logical, scale, dtype)


def _kernel_on_poisoned_output(rng, layout, head_dim, seqlen, dtype, what):
    """Run the compiled module directly on a poisoned buffer with a poisoned guard zone after it."""
    torch = _torch()
    import cuda.bindings.driver as cuda

    from jax_dqpost import arch, kernel_cache
    from jax_dqpost.kernel import entry_args
    from jax_dqpost.plan import Part, Plan

    B, H, D, S = 2, 3, head_dim, seqlen
    logical = oracle.random_logical(rng, (B, S, H, D))
    acc = oracle.build_accumulator(logical, (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab),
                                   hdim_multiple_of=layout.hdim_multiple_of, rng=rng, arch=layout.arch,
                                   two_cta=layout.two_cta)
    scale = float(rng.uniform(0.05, 2.0))
    want = oracle.expected_dq(logical, scale, dtype)
    plan = Plan((Part(layout, D, np.dtype(dtype), seqlen=S),))
    executor = kernel_cache.compile_executor(plan.kernel, arch.target_arch())
    t_acc = torch.from_numpy(acc).cuda()
    t_out = torch.full((B * S * H * D + GUARD,), np.uint16(POISON).view(np.int16).item(), dtype=torch.int16,
                       device="cuda")
    t_scale = torch.tensor([scale], dtype=torch.float32).cuda()
    # abi.pointers(1, False): dq_accum, q_aux (unused when dense), scales, dq
    addresses = [t_acc.data_ptr(), t_scale.data_ptr(), t_scale.data_ptr(), t_out.data_ptr()]
    executor(*entry_args(plan.kernel.dtype, 1, None, addresses, plan.launch([acc.shape])[0]),
             cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    out = t_out.cpu().numpy().view(np.uint16)
    assert (out[B * S * H * D:] == POISON).all(), f"{what}: kernel wrote past the end of dQ"
    got = out[:B * S * H * D].view(np.dtype(dtype)).reshape(B, S, H, D)
    assert_same_bits(got, want, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(FA_HOPPER_CONFIGS))
def test_kernel_on_poisoned_output(rng, name, dtype):
    layout = AccumLayout(90, *FA_HOPPER_CONFIGS[name])
    for seqlen in (layout.tile_m - 3, 5 * layout.tile_m + 1):
        _kernel_on_poisoned_output(rng, layout, FA_HOPPER_HEAD_DIM[name], seqlen, dtype, f"kernel {name} S={seqlen}")


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


@pytest.mark.parametrize("heads", [6, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", SHORT_TILE_LAYOUTS)
def test_short_varlen_tiles_on_poisoned_output(rng, name, dtype, heads):
    """Many sequences shorter than a tile (0..20 rows, seqused shorter still, rows no sequence covers), long ones
    with short last tiles, 6 or 40 heads (one group of heads per short-tile CTA, or two with the last partial) and a
    negative scale (zeros stay +0): the module run directly on a poisoned buffer with a poisoned guard zone after
    it."""
    torch = _torch()
    import cuda.bindings.driver as cuda

    from jax_dqpost import arch, kernel_cache, varlen
    from jax_dqpost.kernel import entry_args
    from jax_dqpost.plan import Part, Plan

    layout, D = SHORT_TILE_LAYOUTS[name]
    H, batch = heads, 300
    lengths = [int(n) for n in rng.integers(0, 21, batch)]
    # an empty sequence, long ones (both paths in one launch: short last tiles of 5 and 16 rows, a long last tile of
    # 17, whole tiles), one row
    lengths[:6] = [0, layout.tile_m + 5, 2 * layout.tile_m + 16, layout.tile_m + 17, 2 * layout.tile_m, 1]
    cu = [0] + [int(v) for v in np.cumsum(lengths)]
    used = [int(rng.integers(0, n + 1)) if i % 3 == 0 else n for i, n in enumerate(lengths)]
    T, scale = cu[-1] + 7, -float(rng.uniform(0.05, 2.0))
    acc, want = oracle.build_varlen(rng, cu, used, T, H, D,
                                    (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab),
                                    hdim_multiple_of=layout.hdim_multiple_of, scale=scale, dtype=dtype)
    t_acc, t_scale = torch.from_numpy(acc).cuda(), torch.tensor([scale], dtype=torch.float32).cuda()
    executor = None
    for num_tiles in (None, varlen.WorkList.max_tiles(T, batch, layout)):  # static offsets' slots, traced ones'
        work, meta = varlen.WorkList.build(np, cu, used, total=T, layout=layout, num_tiles=num_tiles)
        plan = Plan((Part(layout, D, np.dtype(dtype), work=work),))
        executor = executor or kernel_cache.compile_executor(plan.kernel, arch.target_arch())
        t_meta = torch.from_numpy(meta).cuda()
        n = T * H * D
        t_out = torch.full((n + GUARD,), np.uint16(POISON).view(np.int16).item(), dtype=torch.int16, device="cuda")
        addresses = [t_acc.data_ptr(), t_meta.data_ptr(), t_scale.data_ptr(), t_out.data_ptr()]
        executor(*entry_args(plan.kernel.dtype, 1, None, addresses, plan.launch([acc.shape])[0]),
                 cuda.CUstream(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
        out = t_out.cpu().numpy().view(np.uint16)
        assert (out[n:] == POISON).all(), f"{name}: kernel wrote past the end of dQ"
        assert_same_bits(out[:n].view(np.dtype(dtype)).reshape(T, H, D), want, f"{name} short tiles {work}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_jax_output_poisoned_by_allocator_reuse(rng, dtype):
    """Through XLA: free a NaN-filled buffer of the output's size right before the call; when XLA's
    allocator hands the same memory to our output (checked by address), unwritten elements show."""
    name = "cute-hd128"
    layout, D, logical, acc, scale, want = _case(rng, name, dtype, 1000)
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
    from jax_dqpost import _ffi, kernel_cache
    from jax_dqpost.kernel_spec import KernelSpec, TensorKernel

    layout = AccumLayout(90, 64, 256, 1, False, 32)
    kernel = kernel_cache.get_kernel(KernelSpec(jnp.bfloat16, (TensorKernel(layout, 128, 0),)))
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
    torch = _torch()
    import cutlass

    postprocess = _flash_attn_postprocess()
    tile_m, threads, atom, swap, mult = FA_HOPPER_CONFIGS[name]
    for seqlen in (tile_m + 7, 1000):
        layout, D, logical, acc, scale, want = _case(rng, name, dtype, seqlen)
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
    torch = _torch()
    import cutlass

    postprocess = _flash_attn_postprocess()
    tile_m, threads, atom, swap, mult = FA_HOPPER_CONFIGS[name]
    D, H = FA_HOPPER_HEAD_DIM[name], 3
    layout = AccumLayout(90, tile_m, threads, atom, swap, mult)
    for batch, mean in ((7, 200), (300, 20)):  # 300 > FlashAttention's binary-search threshold
        lengths = [int(x) for x in rng.integers(0, 2 * mean + 1, batch)]
        cu = [0] + [int(v) for v in np.cumsum(lengths)]
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
    torch = _torch()
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


def _manifest():
    import json
    from pathlib import Path

    data = Path(__file__).parent / "data"
    return data, json.loads((data / "exported_manifest.json").read_text())


@pytest.mark.parametrize("name", ["dense", "varlen"])
def test_artifact_exported_on_a_cpu_machine_runs_here(rng, name):
    """tests/data/exported_*.bin were exported for platforms=["cuda"] on a machine without a GPU
    (tests/data/export_artifacts.py, jax.export + jax_dqpost.cuda_arch("sm_90a")): same bits as the oracle here."""
    data, manifest = _manifest()
    case = manifest["cases"][name]
    exported = jax.export.deserialize(bytearray((data / case["file"]).read_bytes()))
    assert exported.platforms == ("cuda",)
    tile_m, threads, atom, swap, mult = case["layout"][1:]
    dtype, D, H = jnp.dtype(case["dtype"]), case["head_dim"], case["heads"]
    if case["packing"] == "dense":
        B, S = case["batch"], case["seqlen"]
        logical = oracle.random_logical(rng, (B, S, H, D))
        acc = oracle.build_accumulator(logical, (tile_m, threads, atom, swap), hdim_multiple_of=mult, rng=rng)
        scale = np.float32(rng.uniform(0.05, 2.0))
        got = exported.call(acc, scale)
        want = oracle.expected_dq(logical, scale, dtype)
    else:
        B, T = case["batch"], case["total_q"]
        lengths = rng.integers(0, 2 * T // B, B)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        used = np.array([rng.integers(0, n + 1) for n in lengths], np.int32)
        acc, want = oracle.build_varlen(rng, cu.tolist(), used.tolist(), T, H, D, (tile_m, threads, atom, swap),
                                        hdim_multiple_of=mult, scale=case["scale"], dtype=dtype)
        got = exported.call(acc, cu, used)
    assert_same_bits(got, want, f"artifact {name} exported on {manifest['exported_on']}")


@pytest.mark.parametrize("capturable", [False, True], ids=["default", "JAX_DQPOST_COMMAND_BUFFERS=1"])
def test_cuda_graphs(tmp_path, seed, capturable):
    """Programs that XLA runs with command buffers (CUDA graphs) give bit-exact results, in a straight chain of
    calls and in a lax.fori_loop (tests/command_buffer_main.py, own process). By default XLA launches our call
    between its command buffers; with JAX_DQPOST_COMMAND_BUFFERS=1 it records the call into them."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "command_buffer_main.py"
    env = {k: v for k, v in os.environ.items() if k != "JAX_DQPOST_COMMAND_BUFFERS"}  # the default: unset
    env.update({"XLA_FLAGS": f"--xla_dump_to={tmp_path}", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    if capturable:
        env["JAX_DQPOST_COMMAND_BUFFERS"] = "1"
    out = subprocess.run([sys.executable, str(script), str(seed), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("chain", "fori_loop", "fused_chain"):
        for file, text in report[name]["thunk_sequences"].items():
            print(f"---- {name}: {file}\n{text[:4000]}")
        assert report[name]["bit_exact"], report
        where = report[name]["hlo_command_buffers"] + report[name]["thunk_command_buffers"]
        if capturable:
            assert where, f"{name}: no command buffer holds our call ({report['xla_flags']})"
        else:
            assert not where, f"{name}: our call was captured into a command buffer by default: {where}"


def test_profiler_around_calls(seed):
    """Both ops, static and traced varlen offsets, at a size that crashes under the profiler when the launches are
    captured: each program runs before, inside and after a jax.profiler trace with bit-exact results
    (tests/profiler_main.py, own process)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "profiler_main.py"
    out = subprocess.run([sys.executable, str(script), str(seed)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert out.returncode == 0, f"seed {seed}: " + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("dq_static", "dq_traced", "fused_static", "fused_traced"):
        assert report[name] == [True] * 4, (name, seed, report)


_CACHE_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, sys.argv[2])
import oracle
from jax_dqpost import AccumLayout, dq_postprocess
rng = np.random.default_rng(int(sys.argv[1]))
layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
logical = oracle.random_logical(rng, (2, 200, 3, 128))
acc = oracle.build_accumulator(logical, (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab),
                               hdim_multiple_of=layout.hdim_multiple_of, rng=rng)
got = jax.jit(lambda a: dq_postprocess(a, 0.5, seqlen_q=200, head_dim=128, layout=layout))(acc)
print(np.array_equal(np.asarray(got).view(np.uint16), oracle.expected_dq(logical, 0.5, jnp.bfloat16).view(np.uint16)))
"""


def test_a_damaged_cache_entry_heals_on_the_gpu(tmp_path, seed, rng):
    """A process that finds its kernel's disk entry truncated or overwritten compiles the kernel again, rewrites the
    entry, launches the right module (bit-exact) and warns once, at its own line that called the op (line 11 of the
    script); the next process loads the healed entry."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "JAX_DQPOST_CACHE_DIR": str(tmp_path / "cache"), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    tests = str(Path(__file__).parent)

    def run():
        out = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(seed), tests],
                             env=env, capture_output=True, text=True, timeout=600, cwd="/")
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split()[-1] == "True", out.stdout
        return out.stderr

    assert "damaged" not in run()
    (entry,) = (tmp_path / "cache").glob("*.cute")
    intact = entry.read_bytes()
    for broken in (intact[: len(intact) // 3], rng.bytes(len(intact))):  # truncated, overwritten
        entry.write_bytes(broken)
        warned = [line for line in run().splitlines() if "was damaged" in line]
        assert len(warned) == 1 and warned[0].startswith("<string>:11: RuntimeWarning: jax_dqpost: the kernel cache "
                                                         "entry "), warned
        assert entry.read_bytes() == intact
    assert "damaged" not in run()
