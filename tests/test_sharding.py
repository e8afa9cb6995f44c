"""Sharding on 8 CPU devices, and on every GPU of a machine with two or more: batch and heads shard with no
collective in the compiled program; a sharded sequence axis is gathered (correct, with collectives); results
equal the unsharded op (the reference on one CPU) bit for bit."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import HAS_GPU
from jax_dqpost import AccumLayout, dq_postprocess
from test_dq_postprocess import assert_same_bits
import oracle

CPUS = jax.devices("cpu")
GPUS = jax.devices("cuda") if HAS_GPU else []
DEVICE_SETS = [pytest.param(CPUS, id=f"cpu{len(CPUS)}", marks=pytest.mark.skipif(
    len(CPUS) < 8, reason="needs --xla_force_host_platform_device_count=8"))]
DEVICE_SETS += [pytest.param(GPUS, id=f"cuda{len(GPUS)}")] if len(GPUS) >= 2 else []
LAYOUT = AccumLayout(90, 80, 256, 1, True, 32)
COLLECTIVES = re.compile(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter")


def _mesh(devices, shape, names):
    return Mesh(np.array(devices[: int(np.prod(shape))]).reshape(shape), names)


def _batch_head_meshes(n):
    """(batch, heads) mesh shapes over n devices: both axes sharded, and heads alone when n is small."""
    return [(2, n // 2)] + ([(1, n)] if n <= 4 else [])


def _compiled_and_result(f, args, in_specs, mesh):
    shardings = tuple(NamedSharding(mesh, s) for s in in_specs)
    jitted = jax.jit(f, in_shardings=shardings)
    placed = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    text = jitted.lower(*placed).compile().as_text()
    return text, jitted(*placed)


@pytest.mark.parametrize("devices", DEVICE_SETS)
def test_dense_batch_and_heads_shard_without_collectives(rng, devices):
    B, S, H, D = 2, 200, 4, 128
    acc = oracle.build_accumulator(oracle.random_logical(rng, (B, S, H, D)), (80, 256, 1, True), hdim_multiple_of=32,
                                   rng=rng)
    used = np.asarray([150, 200], np.int32)
    f = lambda a, u: dq_postprocess(a, 0.5, seqlen_q=S, head_dim=D, seqused_q=u, layout=LAYOUT)
    want = jax.jit(f)(jax.device_put(acc, CPUS[0]), jax.device_put(used, CPUS[0]))
    for shape in _batch_head_meshes(len(devices)):
        mesh = _mesh(devices, shape, ("b", "h"))
        text, got = _compiled_and_result(f, (acc, used), (P("b", "h", None), P("b")), mesh)
        assert not COLLECTIVES.search(text), f"collective in the compiled sharded program, mesh {shape}"
        assert got.sharding.spec == P("b", None, "h", None) or got.sharding.is_equivalent_to(
            NamedSharding(mesh, P("b", None, "h", None)), 4)
        assert_same_bits(got, want, f"sharded over batch and heads, mesh {shape} of {devices[0].platform}")


@pytest.mark.parametrize("devices", DEVICE_SETS)
def test_sharded_sequence_axis_is_gathered_correctly(rng, devices):
    B, S, H, D = 1, 160, 2, 128
    acc = oracle.build_accumulator(oracle.random_logical(rng, (B, S, H, D)), (80, 256, 1, True), hdim_multiple_of=32,
                                   rng=rng)
    f = lambda a: dq_postprocess(a, 0.5, seqlen_q=S, head_dim=D, layout=LAYOUT)
    want = jax.jit(f)(jax.device_put(acc, CPUS[0]))
    text, got = _compiled_and_result(f, (acc,), (P(None, None, "s"),), _mesh(devices, (len(devices),), ("s",)))
    assert COLLECTIVES.search(text), "a sequence-sharded accumulator must be gathered"
    assert_same_bits(got, want, "sequence-sharded input")


@pytest.mark.parametrize("devices", DEVICE_SETS)
def test_varlen_heads_shard_without_collectives(rng, devices):
    cu, T, H, D = [0, 70, 70, 300], 310, 8, 128
    acc, want = oracle.build_varlen(rng, cu, None, T, H, D, (80, 256, 1, True), hdim_multiple_of=32, scale=0.5,
                                    dtype=jnp.bfloat16)
    for cu_arg in (cu, np.asarray(cu, np.int32)):
        static = isinstance(cu_arg, list)
        if static:
            f = lambda a: dq_postprocess(a, 0.5, head_dim=D, total_q=T, cu_seqlens_q=cu, layout=LAYOUT)
            text, got = _compiled_and_result(f, (acc,), (P("h", None),), _mesh(devices, (len(devices),), ("h",)))
        else:
            f = lambda a, c: dq_postprocess(a, 0.5, head_dim=D, total_q=T, cu_seqlens_q=c, layout=LAYOUT)
            text, got = _compiled_and_result(f, (acc, cu_arg), (P("h", None), P(None)),
                                             _mesh(devices, (len(devices),), ("h",)))
        assert not COLLECTIVES.search(text), f"collective in the compiled sharded varlen program (static={static})"
        assert_same_bits(got, want, f"varlen sharded over heads (static={static})")
