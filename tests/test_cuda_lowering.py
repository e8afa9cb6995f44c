"""The CUDA path without a GPU: lowering through jax.export emits our FFI custom call carrying a CuTe
module compiled for sm_90a; the FFI library is built and exports its handlers; importing the package
does not import cutlass."""

from __future__ import annotations

import ctypes
import itertools
import re
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dqpost
from jax_dqpost import DISABLED_CHECKS, AccumLayout, dq_postprocess
from jax_dqpost.postprocess._primitive import ffi as _ffi
from jax_dqpost._kernel import cache as kernel_cache, tuning as kernel_tuning
from jax_dqpost._kernel.abi import Tiling
import oracle
from support import export_dq, export_layout, one_part_kernel

LAYOUT = export_layout()


def test_import_does_not_load_cutlass():
    code = "import sys, jax_dqpost; assert 'cutlass' not in sys.modules, 'cutlass imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("dtype, name", [(jnp.bfloat16, "bf16"), (jnp.float16, "f16")])
def test_export_for_cuda_emits_our_custom_call(dtype, name):
    exported = export_dq(["cuda"], dtype=dtype)
    text = exported.mlir_module()
    calls = re.findall(r"stablehlo.custom_call @(\w+)\(", text)
    assert calls == [_ffi.TARGET_NAME], calls
    tiles = -(-1000 // 80)
    # abi.py: dq_accum, q_aux (empty), scales (1,), then dq; extents (B, H, S, D, tiles); CTAs: a call this small
    # splits each tile into its finest shares, 4 (tuning.shares_for), so 4 * H * tiles per batch
    acc_bytes, out_bytes = 2 * 4 * tiles * 80 * 128 * 4, 2 * 1000 * 4 * 128 * 2
    assert f"bytes = dense<[{acc_bytes}, 0, 4, {out_bytes}]> : tensor<4xi64>" in text
    assert f"extents = dense<[2, 4, 1000, 128, {tiles}]>" in text and f"ctas = {2 * 4 * 4 * tiles} : i64" in text
    assert "mhlo.backend_config = {" in text  # typed XLA FFI: attributes as a dictionary
    assert "tensor<2x1000x4x128x" in text  # (B, S, H, D) result
    kernel = kernel_cache.get_kernel(one_part_kernel(dtype, LAYOUT, 128, shares=4), arch="sm_90a")
    assert kernel.module[:4] == b"\x7fELF"  # a host object holding the sm_90a cubin
    assert f'fingerprint = "{_ffi.call_fingerprint(kernel.fingerprint)}"' in text  # with the handler's suffix


@pytest.mark.parametrize("name", ["dense", "varlen"])
def test_stored_artifacts_call_the_registered_target(name):
    """tests/data's artifacts (run on a GPU by tests/test_gpu_runtime.py) call the target the package registers, so
    the GPU test checks the handler that calls use; they are exported again when the target changes."""
    blob = (Path(__file__).parent / "data" / f"exported_{name}.bin").read_bytes()
    text = jax.export.deserialize(bytearray(blob)).mlir_module()
    assert re.findall(r"stablehlo.custom_call @(\w+)\(", text) == [_ffi.TARGET_NAME]


@pytest.mark.parametrize("batch, heads, seqlen, what", [
    (65536, 1, 80, "batch"),  # grid z
    (1, 2**16, 2**15 * 80, "heads"),  # grid x: heads * ceil(S / tile_m) = 2^31
])
def test_cuda_lowering_rejects_grids_cuda_cannot_launch(batch, heads, seqlen, what):
    """Shapes past CUDA's grid limits fail at lowering time with a ValueError naming them (before any
    kernel compile or launch); the largest batch that fits still lowers."""
    f = jax.jit(lambda a: dq_postprocess(a, 0.5, seqlen_q=seqlen, head_dim=128, layout=LAYOUT))
    spec = jax.ShapeDtypeStruct(LAYOUT.accum_shape(batch, heads, seqlen, 128), jnp.float32)
    with pytest.raises(ValueError, match=what):
        jax.export.export(f, platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(spec)
    if what == "batch":
        ok = jax.ShapeDtypeStruct(LAYOUT.accum_shape(batch - 1, heads, seqlen, 128), jnp.float32)
        exported = jax.export.export(f, platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(ok)
        assert _ffi.TARGET_NAME in exported.mlir_module()


def test_export_serializes_and_multi_platform(rng):
    exported = export_dq(["cpu", "cuda"])
    assert exported.platforms == ("cpu", "cuda")
    restored = jax.export.deserialize(exported.serialize())
    acc = rng.standard_normal(LAYOUT.accum_shape(2, 4, 1000, 128)).astype(np.float32)
    # On this machine the CPU lowering of the multi-platform artifact runs: same bits as a direct call.
    want = jax.jit(lambda a: dq_postprocess(a, 0.3, seqlen_q=1000, head_dim=128, layout=LAYOUT))(acc)
    got = restored.call(acc, np.float32(0.3))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_disabled_checks_cover_every_target_the_package_emits(rng):
    """jax_dqpost.DISABLED_CHECKS exports, for CUDA (here without a GPU), a function using every path of the package
    (dq_postprocess, flash_attention_postprocess with a sink and without dK/dV, and with them: one target); each of
    its checks is needed; the serialized artifact round-trips, and its CPU lowering runs here with the bits of a direct
    call (dsink, a float32 sum, within the roundings of another order)."""
    pytest.importorskip("flatbuffers", reason="Exported.serialize needs flatbuffers (in the package's [test] extra)")
    from jax_dqpost import cuda_arch, flash_attention_postprocess

    q_layout = AccumLayout.flash_attention(90, 64, causal=False, tensor="dq", version="4.0.0b36")
    kv_layout = AccumLayout.flash_attention(90, 64, causal=False, tensor="dkv", version="4.0.0b36")
    B, H, H_KV, S, S_K, D = 2, 4, 2, 100, 70, 64

    def f(q, k, v, sink, lse, dpsum):
        sk = dict(learnable_sink=sink, lse=lse, dpsum=dpsum)
        alone = dq_postprocess(q, 0.5, seqlen_q=S, head_dim=D, layout=q_layout)
        with_sink = flash_attention_postprocess(q, None, None, 0.5, seqlen_q=S, head_dim=D, dq_layout=q_layout, **sk)
        fused = flash_attention_postprocess(q, k, v, 0.5, head_dim=D, dq_layout=q_layout, dkv_layout=kv_layout,
                                            seqlen_q=S, seqlen_k=S_K, **sk)
        return alone, with_sink.dq, with_sink.dsink, *fused

    shapes = [q_layout.accum_shape(B, H, S, D), kv_layout.accum_shape(B, H_KV, S_K, D),
              kv_layout.accum_shape(B, H_KV, S_K, D), (H,), (B, H, S), (B, H, q_layout.padded_seqlen(S))]
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    assert isinstance(DISABLED_CHECKS, tuple)
    with cuda_arch("sm_90a"):
        for dropped in DISABLED_CHECKS:  # each check is needed: without it the export names its target
            with pytest.raises(ValueError, match=dropped.is_custom_call()):
                jax.export.export(jax.jit(f), platforms=["cuda"],
                                  disabled_checks=[c for c in DISABLED_CHECKS if c != dropped])(*specs)
        exported = jax.export.export(jax.jit(f), platforms=["cpu", "cuda"], disabled_checks=DISABLED_CHECKS)(*specs)
    targets = set(re.findall(r"stablehlo.custom_call @(jax_dqpost\w+)\(", exported.mlir_module()))
    assert targets == {c.is_custom_call() for c in DISABLED_CHECKS} == {_ffi.TARGET_NAME}
    restored = jax.export.deserialize(exported.serialize())
    assert restored.platforms == ("cpu", "cuda") and restored.out_avals == exported.out_avals
    assert restored.mlir_module_serialized == exported.mlir_module_serialized
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    want = jax.jit(f)(*args)
    for j, (got, w) in enumerate(zip(restored.call(*args), want, strict=True)):
        if j in (2, 6):  # dsink: a float32 sum the two programs may order differently
            oracle.assert_dsink_reordered(got, w, *args[3:], f"output {j}")
        else:
            assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(w).view(np.uint8)), j


def test_cuda_kernel_compiles_for_sm90a_for_every_fa_head_dim():
    from conftest import fa_cute_hopper_config

    for head_dim in (64, 96, 128, 192, 256, 40, 200):
        for causal in (False, True):
            layout = AccumLayout(90, *fa_cute_hopper_config(head_dim, causal))
            spec = one_part_kernel(jnp.float16, layout, layout.padded_head_dim(head_dim))
            k = kernel_cache.get_kernel(spec, arch="sm_90a")
            assert k.arch == "sm_90a" and len(k.module) > 1000


def test_ffi_library_is_built_and_exports_its_handlers():
    """The handler library is the installed package's: beside the imported package (``pytest tests``), or, where the
    source tree is imported (``python -m pytest tests`` from the repository root), the installed distribution's,
    built from this tree."""
    from importlib import metadata

    path = _ffi.library_path()
    installed = [Path(f.locate()).resolve() for f in metadata.distribution("jax-dqpost").files or ()
                 if f.name == path.name]
    assert path.resolve() in installed, (path, installed)
    if (Path(jax_dqpost.__file__).parent / path.name).is_file():
        assert path.parent == Path(jax_dqpost.__file__).parent
    lib = ctypes.CDLL(str(path))
    for symbol in ["JaxDqpostExecute", "JaxDqpostExecuteCapturable", "JaxDqpostInstantiate", "jax_dqpost_set_runtime",
                   "jax_dqpost_load_runtime", "jax_dqpost_state_type_id", "jax_dqpost_state_type_info"]:
        assert hasattr(lib, symbol), symbol


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100a"])
def test_every_order_and_mode_compiles_for(arch):
    """Every accumulator order is data order: each compiles for Ampere, Hopper and Blackwell targets."""
    layouts = [AccumLayout(90, 80, 256, 1, True, 32), AccumLayout(90, 128, 256, 2, False, 32),
               AccumLayout(80, 64, 128, 4, False, 32), AccumLayout(80, 64, 256, 2, True, 32),
               AccumLayout(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=1),
               AccumLayout(100, 128, 128, 1, False, 32, two_cta=True, cluster_size=1),
               AccumLayout(None, 64, 256, 1, False, 32)]
    for layout in layouts:
        for tiling in Tiling:
            for split in kernel_tuning.call_shares(layout, 128):  # a tile per CTA, or its finest split
                k = kernel_cache.get_kernel(one_part_kernel(jnp.bfloat16, layout, 128, tiling, split), arch=arch)
                assert k.arch == arch and k.module[:4] == b"\x7fELF"


def test_compiling_for_another_arch_leaves_the_dsl_setting_alone():
    """The DSL's target arch is process-wide; compiling ours for sm_100a must not change it for other
    users of the DSL in the process (on the H200, FlashAttention-4 then failed to compile for sm_90a)."""
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    before = envar.arch
    for arch in ("sm_100a", "sm_80"):
        kernel_cache.compile_executor(one_part_kernel("bf16", LAYOUT, 128, Tiling.VARLEN), arch)
        assert envar.arch == before, (arch, envar.arch, before)


def test_ffi_handler_passes_the_calling_convention_of_abi():
    """The handler knows the calling convention only as: every buffer, then the extents (abi.EXTENTS per part, at
    most abi.PARTS parts), then the stream; pinned here to abi.py. Every call's pointer list fits its buffer array."""
    from jax_dqpost._kernel import abi

    lib = ctypes.CDLL(str(_ffi.library_path()))
    for name in ("jax_dqpost_extents_per_part", "jax_dqpost_max_parts", "jax_dqpost_max_buffers"):
        getattr(lib, name).restype = ctypes.c_int64
    assert lib.jax_dqpost_extents_per_part() == len(abi.EXTENTS)
    assert lib.jax_dqpost_max_parts() == len(abi.PARTS)
    assert lib.jax_dqpost_max_buffers() >= max(len(abi.pointers(n, s)) for n in (1, 3) for s in (False, True))
    assert abi.pointers(3, True) == ("dq_accum", "dk_accum", "dv_accum", "q_aux", "k_aux", "scales", "learnable_sink",
                                     "lse", "dpsum", "dq", "dk", "dv", "dsink")
    assert abi.arguments(1, False)[-5:] == tuple(f"dq_{e}" for e in abi.EXTENTS)


def test_the_handler_reads_each_buffer_by_the_buffers_table():
    """The handler checks every buffer's element type and rank by its role (not only its size), the roles in
    abi.BUFFERS' order for each kind of call (its table, read through the library, here without a GPU)."""
    from jax_dqpost._kernel import abi

    lib = ctypes.CDLL(str(_ffi.library_path()))
    lib.jax_dqpost_buffer_roles.restype = ctypes.c_int64
    lib.jax_dqpost_role_name.restype = ctypes.c_char_p
    roles = (ctypes.c_int32 * 16)()
    for parts, sink in itertools.product((1, 3), (False, True)):
        n = lib.jax_dqpost_buffer_roles(parts, int(sink), roles)
        assert [lib.jax_dqpost_role_name(r).decode() for r in roles[:n]] == [
            b.kind for b in abi.buffers(parts, sink)], (parts, sink)
    assert lib.jax_dqpost_buffer_roles(2, 0, roles) == 0
    assert lib.jax_dqpost_role_name(8) is None


def test_split_and_join_follow_the_buffers_table():
    """Plan.group and Plan.join are inverses in abi.BUFFERS' order, for one part or three, with a sink or not."""
    from jax_dqpost._kernel import abi
    from jax_dqpost.postprocess._primitive.plan import Part, Plan

    q = Part(LAYOUT, 128, np.dtype(jnp.bfloat16), seqlen=100)
    sink = np.dtype(np.float32)
    for plan in (Plan((q,)), Plan((q,), sink, sink), Plan((q, q, q)), Plan((q, q, q), sink, sink)):
        names = [b.name for b in plan.operands]
        assert names == list(abi.pointers(len(plan.parts), plan.has_sink)[:len(names)])
        ops = plan.group(names)
        assert plan.join(ops) == names
        assert list(ops.acc) == [f"{p}_accum" for p in plan.names]
        assert list(ops.aux) == [f"{s}_aux" for s in abi.sides(len(plan.parts))]
        assert plan.part_aux(ops) == tuple(f"{abi.SIDE[p]}_aux" for p in plan.names)
        want_sink = ("learnable_sink", "lse", "dpsum") if plan.has_sink else (None, None, None)
        assert ops.scales == "scales" and ops.sink == want_sink


@pytest.fixture
def command_buffers_env(monkeypatch):
    """Set JAX_DQPOST_COMMAND_BUFFERS for one test (the package reads it once per process: the cache is cleared
    around the test)."""
    def set_value(value):
        monkeypatch.setenv(_ffi.COMMAND_BUFFERS_ENV, value)
        _ffi.command_buffers.cache_clear()
    yield set_value
    monkeypatch.undo()
    _ffi.command_buffers.cache_clear()


def test_command_buffers_mode_is_in_the_lowered_call(command_buffers_env):
    """The capturable handler (the default; JAX_DQPOST_COMMAND_BUFFERS=1 too) changes the call's fingerprint
    attribute, so a program compiled for it never shares a compilation-cache entry with one compiled for the plain
    handler (JAX_DQPOST_COMMAND_BUFFERS=0); a value other than 0/1 is refused, naming the variable and the value."""
    from jax_dqpost._kernel import arch

    if arch.cuda_devices():
        _ffi.register()  # with the process's own setting, before this test changes it (lowering registers once)
    fingerprint = kernel_cache.get_kernel(one_part_kernel(jnp.bfloat16, LAYOUT, 128, shares=4)).fingerprint
    texts = {}
    for value in ("", "0", "1"):
        command_buffers_env(value)
        texts[value] = export_dq(["cuda"]).mlir_module()
    assert f'fingerprint = "{fingerprint}"' in texts["0"]
    assert f'fingerprint = "{fingerprint}+command-buffers"' in texts["1"] and texts[""] == texts["1"]
    command_buffers_env("yes")
    with pytest.raises(ValueError, match=r"JAX_DQPOST_COMMAND_BUFFERS must be 0 or 1 \(or unset\), got 'yes'"):
        export_dq(["cuda"])



@pytest.mark.parametrize("name, does", [
    ("JAX_DQPOST_COMMAND_BUFFERS", "lets XLA capture the kernel into its command buffers, docs/design.md"),
    ("JAX_DQPOST_CHECKIFY", "checks traced offsets, lengths and scales on the device under jax.experimental.checkify")])
def test_a_bad_flag_value_fails_at_import_on_every_platform(name, does):
    """The package's flags are read once, at import: a value other than 0/1 is one clear error there, also on a
    machine that never lowers for CUDA."""
    env = {**os.environ, name: "2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", "import jax_dqpost"], cwd="/", env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"ValueError: {name} must be 0 or 1 (or unset), got '2' (1 {does})"), out.stderr[-2000:]


@pytest.mark.parametrize("packing", ["dense", "varlen"])
def test_export_for_cuda_emits_one_fused_custom_call(packing):
    """flash_attention_postprocess lowered for CUDA (also without a GPU): one custom call carrying one module (dQ, dK,
    dV and dsink), with the buffers in abi.py's order (their sizes checked by the handler) and the extents of each
    part; and it serialises."""
    from conftest import fa4_pair
    from jax_dqpost import flash_attention_postprocess

    dq_layout, dkv_layout, d, dv = fa4_pair("sm90-hd192-dv128")
    H, H_KV = 4, 2
    batch, s_q, s_k = 2, 300, 200
    sk = dict(learnable_sink=jax.ShapeDtypeStruct((H,), jnp.float32))
    if packing == "dense":
        kw = dict(seqlen_q=s_q, seqlen_k=s_k)
        shapes = (dq_layout.accum_shape(batch, H, s_q, d), dkv_layout.accum_shape(batch, H_KV, s_k, d),
                  dkv_layout.accum_shape(batch, H_KV, s_k, dv))
        rows = ((batch, H, s_q), (batch, H, dq_layout.padded_seqlen(s_q)))
    else:
        cu_q, cu_k = jnp.asarray([0, 100, 300], jnp.int32), jnp.asarray([0, 50, 200], jnp.int32)
        kw = dict(total_q=s_q, total_k=s_k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        shapes = (dq_layout.varlen_accum_shape(batch, H, s_q, d), dkv_layout.varlen_accum_shape(batch, H_KV, s_k, d),
                  dkv_layout.varlen_accum_shape(batch, H_KV, s_k, dv))
        tp = shapes[0][1] // dq_layout.padded_head_dim(d)
        rows = ((H, s_q), (H, tp))

    def f(q, k, v, sink, lse, dpsum):
        return flash_attention_postprocess(q, k, v, 0.1, head_dim=d, head_dim_v=dv, dq_layout=dq_layout,
                                           dkv_layout=dkv_layout, learnable_sink=sink, lse=lse, dpsum=dpsum, **kw)

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes] + [sk["learnable_sink"]] + [
        jax.ShapeDtypeStruct(r, jnp.float32) for r in rows]
    exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(*args)
    text = exp.mlir_module()
    assert text.count("@jax_dqpost") == 1 and text.count(f"@{_ffi.TARGET_NAME}") == 1, "expected one launch"
    outs = [(batch, s_q, H, d) if packing == "dense" else (s_q, H, d),
            (batch, s_k, H_KV, d) if packing == "dense" else (s_k, H_KV, d),
            (batch, s_k, H_KV, dv) if packing == "dense" else (s_k, H_KV, dv)]
    aux = (0, 0)  # dense: no seqused; varlen: the work lists of traced offsets (varlen.WorkList, its bound of tiles)
    if packing == "varlen":
        from jax_dqpost._kernel.varlen import WorkList, sections

        aux = tuple(sections(batch + 2)[1] + WorkList.max_tiles(total, batch, layout)
                    for total, layout in ((s_q, dq_layout), (s_k, dkv_layout)))
    sizes = [4 * int(np.prod(x)) for x in shapes]
    sizes += [4 * a for a in aux] + [4 * 3, 4 * H] + [4 * int(np.prod(r)) for r in rows]
    sizes += [2 * int(np.prod(o)) for o in outs] + [4 * H]
    assert "bytes = dense<[" + ", ".join(map(str, sizes)) + "]>" in text, "buffers in abi.py's order"
    assert [o.shape for o in exp.out_avals] == [*outs, (H,)]
    assert jax.export.deserialize(exp.serialize()).out_avals == exp.out_avals
