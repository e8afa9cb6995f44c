"""Right gradients, measured against the mathematics (a CUDA GPU; flash-attn-4 for the first half, fa4-jax for
the second): real FlashAttention-4 backwards, finished by jax-dqpost, against plain attention's gradients.

For every head dim the producer's sm90 backward accepts (8..256 in steps of 8; pairs with another ``head_dim_v``),
grouped-query attention dense and MHA varlen with traced offsets, causal or not, with and without a learnable sink:

* **flash-attn-4** (torch): its real backward runs; its postprocess calls are caught (``fa4_peer.captured``) and
  their accumulators finished by :func:`jax_dqpost.flash_attention_postprocess` with the presets of the installed
  release (``AccumLayout.flash_attention(..., version=...)``).
* **fa4-jax**: ``jax.grad`` through ``fa4_jax.flash_attn`` on fa4-jax's own backend and on
  ``jax_dqpost.fa4jax.flash_attn``.

The reference is torch autograd of ``softmax(q k^T / sqrt(d)) v`` on the same bf16 inputs in float32 (float64 for
dsink), and the tolerance FlashAttention's own tests use (``tests/cute/test_flash_attn.py``): twice the error of the
same computation in bf16, plus twice the float32 rounding at the reference's magnitude (``attention_judge``). Ours
must be within it, or the call refused at trace time with a ``ValueError``, and only where the producer cannot run
(or, for fa4-jax, where its accumulator order is one our kernel does not take). Where fa4-jax's kernels do not
compile and ``jax_dqpost.fa4jax`` runs them padded (head dims 136..160 on Hopper), ours must be right.

What the producer itself gets wrong or cannot run is data, ``tests/data/producer_gradients.json``, per producer
release: a case listed as wrong must still be wrong (so a fixed release shows up as a failure here, and the data is
updated), a case not listed must be right and, where we convert the same accumulator, bit-identical to ours. A
release with no entry there is measured, not judged. ``JAX_DQPOST_GRADIENTS_OUT=dir`` writes each case's errors
there (``tests/gradients_report.py`` turns them into the data and docs/gradients.md's table).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HAS_GPU
from jax_dqpost import AccumLayout, dq_postprocess, flash_attention_postprocess
from attention_judge import judge, reference, sequences
import fa4_peer
from support import bits, cu_seqlens

pytestmark = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")

DATA = Path(__file__).parent / "data" / "producer_gradients.json"
OUT_ENV = "JAX_DQPOST_GRADIENTS_OUT"
B, SEQLEN_Q, SEQLEN_K, H = 2, 301, 333, 4  # S <= Sk: a causal row always has a key; no tile divides them
VARLEN_LENS = (127, 1, 200)  # q and k alike
RTOL = dict(dq=2, dk=2, dv=2, dsink=4)
"""Multiples of the bf16 reference's error: FlashAttention's 2; dsink's one sum over every row makes that error a
noisy yardstick (two draws of 30 came within 30% of 2x), where a reduction over the wrong rows is off by far more."""


def _cases():
    """Every head dim three times: grouped-query dense, MHA varlen (traced offsets) and multi-query varlen, causal one
    way for the first and the other way for the others; a sink in one of the first two; and pairs of unequal head
    dims (MHA, as FA4's sm90 backward takes them: grouped-query needs equal ones)."""
    out = []
    for i, d in enumerate(range(8, 257, 8)):
        sink = i % 3 == 0
        out.append(dict(head_dim=d, head_dim_v=d, heads_kv=2, causal=i % 2 == 1, varlen=False, sink=sink))
        out.append(dict(head_dim=d, head_dim_v=d, heads_kv=H, causal=i % 2 == 0, varlen=True, sink=not sink))
        out.append(dict(head_dim=d, head_dim_v=d, heads_kv=1, causal=i % 2 == 0, varlen=True, sink=False))
    for d, dv, causal, varlen in ((192, 128, False, False), (96, 64, True, True), (72, 128, False, True),
                                  (256, 128, True, False)):
        out.append(dict(head_dim=d, head_dim_v=dv, heads_kv=H, causal=causal, varlen=varlen, sink=False))
    return out


def case_id(c) -> str:
    return (f"hd{c['head_dim']}" + (f"-dv{c['head_dim_v']}" if c["head_dim_v"] != c["head_dim"] else "")
            + f"-{ {1: 'mqa', H: 'mha'}.get(c['heads_kv'], 'gqa')}-{'causal' if c['causal'] else 'full'}"
            + f"-{'varlen' if c['varlen'] else 'dense'}" + ("-sink" if c["sink"] else "")
            + ("-dkv-alone" if c.get("dkv_alone") else ""))


CASES = _cases()


def _expected(producer: str):
    """The data's entry for this producer release (``{"wrong": {case: [tensors]}, "cannot_run": [cases]}``), or None."""
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    return data.get(producer)


# ---- inputs and the reference

def _inputs(torch, seed, c):
    """bf16 q, k, v, d_out and the sink (float32), dense ``(B, S, H, D)`` or packed ``(T, H, D)``."""
    gen = torch.Generator(device="cuda").manual_seed(seed % 2**31)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype)

    hk, d, dv = c["heads_kv"], c["head_dim"], c["head_dim_v"]
    rows_q, rows_k = ((sum(VARLEN_LENS),),) * 2 if c["varlen"] else ((B, SEQLEN_Q), (B, SEQLEN_K))
    q, k, v = randn(*rows_q, H, d), randn(*rows_k, hk, d), randn(*rows_k, hk, dv)
    d_out = randn(*rows_q, H, dv)
    sink = randn(H, dtype=torch.float32) * 2 if c["sink"] else None
    return q, k, v, d_out, sink


def _judge(got: dict, c, q, k, v, d_out, sink) -> dict:
    """Each tensor's ``{error, tolerance, relative}``: ``max|got - ref|`` against the float32 reference (float64 for
    dsink), FlashAttention's tolerance (module docstring), and the error relative to the reference's largest value."""
    import torch

    kw = dict(causal=c["causal"], scale=c["head_dim"] ** -0.5, sink=sink,
              packed=sequences(VARLEN_LENS) if c["varlen"] else None)
    ref = reference(q, k, v, d_out, dtype=torch.float32, **kw)
    ref64 = reference(q, k, v, d_out, dtype=torch.float64, **kw) if sink is not None else {}
    low = reference(q, k, v, d_out, dtype=torch.bfloat16, **kw)
    out = {}
    for name, g in got.items():
        r = (ref64 if name == "dsink" else ref)[name]
        err, tol = judge(g, r, low[name], RTOL[name], rule="flash_attention")
        out[name] = dict(error=err, tolerance=tol, relative=err / max(r.abs().max().item(), 1e-30))
    return out


def _record(producer: str, c, measured: dict, **extra):
    where = os.environ.get(OUT_ENV)
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        name = f"{producer.replace(' ', '_')}--{case_id(c)}.json"
        (Path(where) / name).write_text(json.dumps(dict(producer=producer, case=case_id(c), config=c,
                                                        measured=measured, **extra), indent=1))


def _wrong(judged: dict) -> list:
    return sorted(name for name, e in judged.items() if not e["error"] <= e["tolerance"])


def _assert_right(judged: dict, what: str):
    bad = {n: judged[n] for n in _wrong(judged)}
    assert not bad, f"{what}: beyond the tolerance against the mathematics: {bad}"


def _check_producer(expected, case: str, producer: str, judged: dict, cannot_run: str | None):
    """The producer's own gradients as the data says (module docstring); None: the release is measured only."""
    if expected is None:
        return
    if cannot_run is not None or case in expected.get("cannot_run", []):
        assert (cannot_run is not None) == (case in expected.get("cannot_run", [])), (
            f"{producer} {case}: " + (f"cannot run ({cannot_run}), which the data does not say"
                                      if cannot_run else "runs, where the data says it cannot: update the data"))
        return
    want = sorted(expected.get("wrong", {}).get(case, []))
    assert _wrong(judged) == want, (f"{producer} {case}: its own gradients are wrong for {_wrong(judged)}, the "
                                    f"data says {want} (a fixed release? update the data): {judged}")


# ---- flash-attn-4 (torch)

def _fa4_run(torch, interface, q, k, v, d_out, sink, c):
    """FlashAttention-4's forward and backward: ``(grads, postprocess calls)``."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    sink_leaf = None if sink is None else sink.clone().requires_grad_()
    varlen = {}
    if c["varlen"]:
        cu = torch.tensor(cu_seqlens(VARLEN_LENS), dtype=torch.int32, device="cuda")
        varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(VARLEN_LENS), max_seqlen_k=max(VARLEN_LENS))
    calls = fa4_peer.backward_calls(torch, interface, q, k, v, d_out, causal=c["causal"], sink=sink_leaf, **varlen)
    grads = dict(dq=q.grad, dk=k.grad, dv=v.grad)
    if sink_leaf is not None:
        grads["dsink"] = sink_leaf.grad
    return grads, calls


def _presets(c, version, gqa):
    """The presets of the installed release for this case: ``dq_layout`` (and ``dkv_layout`` under grouped-query
    attention); ValueError where they refuse it."""
    kw = dict(causal=c["causal"], version=version, head_dim_v=c["head_dim_v"])
    out = dict(dq_layout=AccumLayout.flash_attention(90, c["head_dim"], tensor="dq", **kw))
    if gqa:
        out["dkv_layout"] = AccumLayout.flash_attention(90, c["head_dim"], tensor="dkv", **kw)
    return out


def _ours_from_fa4(calls, c, version):
    """Our one launch on FlashAttention-4's accumulators, in jit, offsets traced: ``{tensor: array}`` for the tensors
    FA4 postprocessed (dQ; dK and dV under grouped-query attention; dsink). ValueError where the presets refuse."""
    gqa = len(calls) == 3
    d, dv = c["head_dim"], c["head_dim_v"]
    layouts = _presets(c, version, gqa)
    np_, cq = fa4_peer.to_numpy, calls[0]
    accs = [jnp.asarray(np_(x["accum"])) for x in calls]
    sink = [jnp.asarray(np_(cq[name])) for name in ("sink", "lse", "dpsum")] if c["sink"] else None
    cu = jnp.asarray(cu_seqlens(VARLEN_LENS))
    total = sum(VARLEN_LENS)

    @jax.jit
    def run(accs, cu, sink):
        kw = dict(head_dim=d, **layouts)
        if c["varlen"]:
            kw.update(total_q=total, cu_seqlens_q=cu)
        else:
            kw.update(seqlen_q=SEQLEN_Q)
        if gqa:
            kw.update(head_dim_v=dv, dk_scale=calls[1]["scale"])
            kw.update(dict(total_k=total, cu_seqlens_k=cu) if c["varlen"] else dict(seqlen_k=SEQLEN_K))
        if sink is not None:
            kw.update(zip(("learnable_sink", "lse", "dpsum"), sink))
        return flash_attention_postprocess(*accs, *([None, None] if not gqa else []), cq["scale"], **kw)

    outs = run(accs, cu, sink)
    names = ["dq"] + (["dk", "dv"] if gqa else []) + (["dsink"] if c["sink"] else [])
    return {name: getattr(outs, name) for name in names}


def _dkv_alone(calls, c, version):
    """dK and dV of a packed grouped-query case, each by :func:`jax_dqpost.dq_postprocess` with the dK/dV preset and
    the k side's traced offsets."""
    layout = _presets(c, version, True)["dkv_layout"]
    cu = jnp.asarray(cu_seqlens(VARLEN_LENS))
    run = jax.jit(lambda acc, cu, scale: dq_postprocess(acc, scale, head_dim=c["head_dim"], total_q=sum(VARLEN_LENS),
                                                        cu_seqlens_q=cu, layout=layout))
    return {name: run(jnp.asarray(fa4_peer.to_numpy(x["accum"])), cu, x["scale"])
            for name, x in zip(("dk", "dv"), calls[1:])}


@pytest.mark.parametrize("c", CASES, ids=[case_id(c) for c in CASES])
def test_flash_attention_4_backward_finished_by_us_is_right(seed, c):
    torch, interface = fa4_peer.fa4()
    version = fa4_peer.fa4_version()
    producer = f"flash-attn-4 {version}"
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the presets under test are FlashAttention-4's sm90 ones; this GPU is not an sm90")
    expected = _expected(producer)
    q, k, v, d_out, sink = _inputs(torch, seed, c)
    try:
        fa4_grads, calls = _fa4_run(torch, interface, q, k, v, d_out, sink, c)
        cannot_run = None
    except Exception as e:  # noqa: BLE001 - the DSL raises many kinds; what matters is that it did not run
        fa4_grads, calls, cannot_run = None, [], f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        ours = _ours_from_fa4(calls, c, version) if calls else _presets(c, version, c["heads_kv"] < H) and None
        refused = None
    except ValueError as e:
        ours, refused = None, str(e)
    if calls == [] and cannot_run is None:
        pytest.fail(f"FlashAttention-4 made no postprocess call for {case_id(c)}")
    judged_fa4 = _judge(fa4_grads, c, q, k, v, d_out, sink) if fa4_grads is not None else None
    judged_ours = _judge(ours, c, q, k, v, d_out, sink) if ours is not None else None
    same_bits = None
    if ours is not None:
        same_bits = {name: bool(np.array_equal(bits(ours[name]), bits(fa4_peer.to_numpy(fa4_grads[name]))))
                     for name in ours}
    _record(producer, c, dict(producer=judged_fa4, ours=judged_ours), cannot_run=cannot_run, refused=refused,
            same_bits=same_bits)
    if cannot_run is not None:
        # No accumulator: our presets must refuse this configuration at trace time, naming the release.
        assert refused is not None and f"flash-attn-4 {version}'s sm90 backward does not run at head_dim=" \
            f"{c['head_dim']}" in refused, f"FA4 cannot run {case_id(c)} ({cannot_run}), our presets do not say so"
    elif refused is not None:
        # Refused at trace time although FA4 ran: only where what it wrote cannot be read (its varlen dQ of the
        # paddings that disagree), and only as the data says.
        assert c["varlen"] and "no reading recovers dQ" in refused, f"our presets refuse {case_id(c)}: {refused}"
        assert expected is None or case_id(c) in expected.get("refused_by_us", []), (
            f"we refuse {case_id(c)}, which the data does not say: {refused}")
        if len(calls) == 3:  # dK and dV, allocated as zeros, are read right: each alone, from the same accumulators
            judged_kv = _judge(_dkv_alone(calls, c, version), c, q, k, v, d_out, sink)
            _record(producer, dict(c, dkv_alone=True), dict(producer=None, ours=judged_kv))
            _assert_right(judged_kv, f"jax-dqpost's dK, dV alone on {producer}'s accumulators, {case_id(c)}")
    else:
        _assert_right(judged_ours, f"jax-dqpost on {producer}'s accumulators, {case_id(c)}")
    _check_producer(expected, case_id(c), producer, judged_fa4, cannot_run)
    if expected is not None and same_bits is not None:
        right = [n for n in same_bits if n not in expected.get("wrong", {}).get(case_id(c), [])]
        assert all(same_bits[n] for n in right), (
            f"where {producer} is right our bits must be its bits: {same_bits}")


# ---- fa4-jax

def _fa4jax_grads(attention, q, k, v, d_out, c):
    def loss(q, k, v):
        if c["varlen"]:
            cu = jnp.asarray(cu_seqlens(VARLEN_LENS))
            out = attention["varlen"](q, k, v, cu, cu, causal=c["causal"])
        else:
            out = attention["dense"](q, k, v, causal=c["causal"])
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    return dict(zip(("dq", "dk", "dv"), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)))


@pytest.mark.parametrize("c", [dict(c, sink=False) for c in CASES], ids=[case_id(dict(c, sink=False)) for c in CASES])
def test_fa4jax_backward_finished_by_us_is_right(seed, c):
    fa4_jax = pytest.importorskip("fa4_jax")
    torch = pytest.importorskip("torch")
    from jax_dqpost import fa4jax
    from jax_dqpost._attention import fa4 as _fa4

    producer = f"fa4-jax {fa4_jax.__version__}"
    expected = _expected(producer)
    tq, tk, tv, td, _ = _inputs(torch, seed, c)
    q, k, v, d_out = (jnp.asarray(fa4_peer.to_numpy(t)) for t in (tq, tk, tv, td))
    own = dict(dense=lambda *a, **kw: fa4_jax.flash_attn(*a, backend="cute", **kw),
               varlen=lambda *a, **kw: fa4_jax.flash_attn_varlen(*a, backend="cute", **kw))
    mine = dict(dense=fa4jax.flash_attn, varlen=fa4jax.flash_attn_varlen)
    try:
        theirs = _fa4jax_grads(own, q, k, v, d_out, c)
        cannot_run = None
    except Exception as e:  # noqa: BLE001
        theirs, cannot_run = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        ours, refused = _fa4jax_grads(mine, q, k, v, d_out, c), None
    except ValueError as e:  # a refusal: any other error (a compiler's) must not reach a user
        ours, refused = None, str(e).splitlines()[0]
    judged_theirs = _judge(theirs, c, tq, tk, tv, td, None) if theirs is not None else None
    judged_ours = _judge(ours, c, tq, tk, tv, td, None) if ours is not None else None
    _record(producer, c, dict(producer=judged_theirs, ours=judged_ours), cannot_run=cannot_run, refused=refused)
    family = int(str(jax.devices()[0].compute_capability).split(".")[0])
    padded = _fa4.padded_head_dims(c["head_dim"], c["head_dim_v"], family)
    if cannot_run is not None and padded == (c["head_dim"], c["head_dim_v"]):
        assert ours is None and refused.startswith("jax_dqpost.fa4jax"), (
            f"fa4-jax's own backend cannot run {case_id(c)} ({cannot_run}); ours: {refused or 'runs'}")
    elif cannot_run is not None:  # run padded where fa4-jax's kernels do not compile
        assert ours is not None, f"{case_id(c)} runs padded to {padded}, but: {refused}"
        _assert_right(judged_ours, f"jax_dqpost.fa4jax on {producer}, {case_id(c)} padded to {padded}")
    elif ours is None:
        assert refused.startswith("jax_dqpost.fa4jax cannot finish"), refused
        assert expected is None or case_id(c) in expected.get("refused_by_us", []), (
            f"we refuse {case_id(c)}, which the data does not say: {refused}")
    else:
        _assert_right(judged_ours, f"jax_dqpost.fa4jax on {producer}, {case_id(c)}")
    _check_producer(expected, case_id(c), producer, judged_theirs, cannot_run)
