"""FlashAttention-4's kernels under ``jax.jit`` with sharded operands, lowered for CUDA on this machine's eight host
devices (no GPU needed: ``CUTE_DSL_ARCH`` names the target, and fa4-jax is told the device is an sm_90 where there is
none): every kernel call of the forward, the backward and forward mode, with and without a sink, dense and packed,
sits under a partitioning rule (a ``custom_partitioning`` whose Shardy rule keeps the query's batch and heads
sharded), so that the partitioner gathers no query, key or value where they are sharded over batch or heads; and
'fa4''s context parallelism lowers inside ``jax.shard_map``, a windowed layer's keys sent by ``collective_permute``.

``jax.export`` cannot serialize a ``custom_partitioning``, so the module is read from ``jit(...).trace(...).lower``.
Needs fa4-jax (Python >= 3.12: ``pip install '.[fa4-jax]'``)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

fa4_kernels = pytest.importorskip("fa4_jax.kernels", reason="needs fa4-jax (Python >= 3.12: pip install "
                                  "'.[fa4-jax]')")

from jax_dqpost._attention import context  # noqa: E402
from jax_dqpost._attention import fa4  # noqa: E402

RULE = re.compile(r"sdy\.sharding_rule = #sdy\.op_sharding_rule<\((.*?)\)->\((.*?)\) \{[^}]*\}"
                  r"(?: need_replication=\{([^}]*)\})?")


@pytest.fixture(autouse=True)
def _an_sm90(monkeypatch):
    """fa4-jax reads the first device's compute capability: an sm_90's where this machine has no GPU."""
    if not any(d.platform == "gpu" for d in jax.devices()):
        monkeypatch.setattr(fa4_kernels, "_device_arch", lambda: 90)


def _mesh() -> Mesh:
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip(f"8 CPU devices needed, {len(devices)} here (conftest.py asks XLA for 8)")
    return Mesh(np.array(devices[:8]).reshape(2, 4), ("a", "b"))


def _rules(text: str) -> list[tuple[list[list[str]], set[str]]]:
    """Each custom call's operands' factors and its need_replication factors, from the lowered module's text."""
    rules = []
    for operands, _, replicated in RULE.findall(text):
        factors = [[f.strip() for f in op.strip("[]").split(",") if f.strip()]
                   for op in re.findall(r"\[[^\]]*\]", operands)]
        rules.append((factors, {f.strip() for f in (replicated or "").split(",") if f.strip()}))
    return rules


def _targets(text: str) -> set[str]:
    return set(re.findall(r"stablehlo\.custom_call @(\w+)", text))


def _check(text: str, calls: int, what: str):
    """Every custom call a ``custom_partitioning`` (no kernel launch outside a rule), ``calls`` of them, each rule
    keeping the query's (or an accumulator's) batch and heads factors sharded."""
    assert _targets(text) == {"CustomSPMDPartitioning"}, (what, _targets(text))
    rules = _rules(text)
    assert len(rules) == text.count("@CustomSPMDPartitioning") == calls, (what, len(rules))
    for factors, replicated in rules:
        first = factors[0]
        kept = [first[0], first[2]] if len(first) == 4 else [first[0], first[1]]  # (B, T, N, H) or (B, N, rows)
        if len(first) == 3 and first[1] in ("", None):
            continue
        for factor in kept:  # a compound factor (heads as key heads times group) keeps each part
            assert not set(factor) & replicated, (what, first, replicated)
    assert "all_gather" not in text and "all-gather" not in text, what


SPECS = {"batch": (P("a"), P("a")), "heads": (P(None, None, "b"), P("b")),
         "batch-and-heads": (P("a", None, "b"), P("b"))}


@pytest.mark.parametrize("sink", [True, False], ids=["sink", "no-sink"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_every_kernel_call_of_the_backward_is_under_a_rule(spec, sink):
    """``jax.grad`` of the dense attention (causal, gpt-oss's window, 8:4 grouped heads): the forward and the backward
    (its accumulators and the postprocess), two rules, none replicating the batch or the heads."""
    mesh = _mesh()
    q_spec, sink_spec = SPECS[spec]
    q = jnp.zeros((4, 256, 8, 64), jnp.bfloat16)
    k = jnp.zeros((4, 256, 4, 64), jnp.bfloat16)
    s = jnp.zeros((8,), jnp.float32)
    attention = fa4.flash(False)

    def loss(q, k, v, s):
        out = attention(q, k, v, learnable_sink=s if sink else None, causal=True, window_size=(127, 0), scale=0.125)
        return jnp.sum(out.astype(jnp.float32))

    def put(x, p):
        return jax.device_put(x, NamedSharding(mesh, p))

    args = (put(q, q_spec), put(k, q_spec), put(k, q_spec), put(s, sink_spec))
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    _check(text, 2, f"grad {spec} sink={sink}")


def test_forward_mode_and_packed_batches_are_under_rules():
    """``jax.jvp`` (the forward and the forward-mode kernel, two rules) of the dense attention, and ``jax.grad`` of
    the packed one (heads sharded: its batch is in the offsets)."""
    mesh = _mesh()
    q = jnp.zeros((4, 256, 8, 64), jnp.bfloat16)
    k = jnp.zeros((4, 256, 4, 64), jnp.bfloat16)
    s = jnp.zeros((8,), jnp.float32)
    dense = fa4.flash(False)

    def f(q, k, v, s):
        return dense(q, k, v, learnable_sink=s, causal=True, scale=0.125)

    def put(x, p):
        return jax.device_put(x, NamedSharding(mesh, p))

    heads = P("a", None, "b")
    args = tuple(put(x, p) for x, p in ((q, heads), (k, heads), (k, heads), (s, P("b"))))
    jvp = jax.jit(lambda *a: jax.jvp(f, a, a))
    _check(jvp.trace(*args).lower(lowering_platforms=("cuda",)).as_text(), 2, "jvp")

    packed = fa4.flash(True)
    cu = jnp.arange(5, dtype=jnp.int32) * 256

    def loss(q, k, v, s):
        out = packed(q, k, v, cu, cu, learnable_sink=s, causal=True, scale=0.125, seqused_q=cu[1:] - cu[:-1],
                     seqused_k=cu[1:] - cu[:-1], defined_padding=True)
        return jnp.sum(out.astype(jnp.float32))

    rows = P(None, "b")
    args = tuple(put(x, p) for x, p in ((q.reshape(1024, 8, 64), rows), (k.reshape(1024, 4, 64), rows),
                                          (k.reshape(1024, 4, 64), rows), (s, P("b"))))
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert _targets(text) == {"CustomSPMDPartitioning"}
    assert len(_rules(text)) == 2 and "all_gather" not in text


@pytest.mark.parametrize("window, rows", [((127, 0), True), ((None, 0), True), ((None, None), True),
                                          ((127, 3), False)], ids=["w127", "causal", "unmasked", "w127-3"])
def test_the_rows_shard_where_a_device_can_run_its_own(window, rows):
    """``jax.grad`` with the sequence sharded (over 4 devices, the batch over 2): under gpt-oss's window, a causal
    mask or none, the forward's and the backward's rules let the rows shard (each device runs its own: the rows'
    factor is not replicated), the keys' replicated; a window reaching keys after a row's own gathers the rows."""
    mesh = _mesh()
    q = jnp.zeros((2, 256, 8, 64), jnp.bfloat16)
    k = jnp.zeros((2, 256, 2, 64), jnp.bfloat16)
    s = jnp.zeros((8,), jnp.float32)
    attention = fa4.flash(False)

    def loss(q, k, v, s):
        out = attention(q, k, v, learnable_sink=s, window_size=window, scale=0.125)
        return jnp.sum(out.astype(jnp.float32))

    seq = NamedSharding(mesh, P("a", "b"))
    args = (*(jax.device_put(x, seq) for x in (q, k, k)), jax.device_put(s, NamedSharding(mesh, P())))
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert _targets(text) == {"CustomSPMDPartitioning"}
    rules = _rules(text)
    assert len(rules) == 2
    for factors, replicated in rules:
        q_rows, k_rows = factors[0][1], factors[1][1]
        assert (q_rows not in replicated) == rows, (window, factors[0], replicated)
        assert k_rows in replicated, (window, factors[1], replicated)


@pytest.mark.parametrize("window, sends", [((127, 0), "collective_permute"), ((None, 0), "all_gather")])
def test_context_parallelism_lowers_inside_shard_map(monkeypatch, window, sends):
    """'fa4''s context parallelism over 8 devices (zigzag, a sink), forward and backward, lowered for CUDA: its
    keys received by ``collective_permute`` under gpt-oss's window and ``all_gather`` under a causal mask alone,
    the kernels (told that JAX runs on a GPU) called inside the shard_map as they are."""
    _mesh()
    monkeypatch.setattr(fa4, "on_gpu", lambda: True)
    mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("cp",))
    n, t = 8, 256
    q = jnp.zeros((1, n * t, 8, 64), jnp.bfloat16)
    k = jnp.zeros((1, n * t, 1, 64), jnp.bfloat16)
    s = jnp.zeros((8,), jnp.float32)
    halo = context.halo(True, window, "zigzag", t)

    def loss(q, k, v, s):
        if halo is None:
            k, v = context.gather(k, "cp"), context.gather(v, "cp")
        else:
            k, v = (context.neighbours(x, "cp", "zigzag", n, jax.lax.axis_index("cp"), halo) for x in (k, v))
        out = fa4.context_attention(q, k, v, layout="zigzag", devices=n, index=jax.lax.axis_index("cp"), scale=0.125,
                                    window=window, sink=s, halo=halo)
        return jnp.sum(out.astype(jnp.float32))

    seq = P(None, "cp")
    grads = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2, 3)), mesh=mesh, in_specs=(seq, seq, seq, P()),
                          out_specs=(seq, seq, seq, P()), check_vma=False)
    text = jax.jit(grads).trace(q, k, k, s).lower(lowering_platforms=("cuda",)).as_text()
    assert sends in text, window
    assert halo is None or "all_gather" not in text, window
    targets = _targets(text)  # inside shard_map each device's calls are its own: the kernels themselves
    assert "cutejax" in targets and any(t.startswith("jax_dqpost_postprocess") for t in targets), targets
    assert not targets - {"cutejax"} - {t for t in targets if t.startswith("jax_dqpost_postprocess")}, targets
