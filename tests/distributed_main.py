"""One process of a two-process jax.distributed program on CPU, run as its own process (test_distributed.py starts
both, with four CPU devices each)::

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python3 tests/distributed_main.py PROCESS_ID PORT SEED OUTDIR

Joins the coordinator on 127.0.0.1:PORT (process 0 runs it) with gloo CPU collectives, draws the global operands
from SEED (both processes draw the same), and runs every case of ``CASES`` under jit with the operands sharded over
a global (batch, heads) mesh of the eight devices, whose batch axis crosses the processes (process p holds batch
shard p: a batch-sharded dsink's all-reduce goes between them). Writes every addressable shard of every result (its
global slice and its bits) to OUTDIR/process<PROCESS_ID>.npz and prints one JSON object (test_distributed.py reads
both).

The test process imports this module for the same operands (:func:`operands`), cases and mesh (:func:`results`).
"""

from __future__ import annotations

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402
from support import bits  # noqa: E402

from jax_dqpost import AccumLayout, dq_postprocess, flash_attention_postprocess  # noqa: E402

PROCESSES, TIMEOUT_S = 2, 60
B, H, H_KV, S, S_K, D = 2, 8, 4, 200, 150, 128
QL, KL = AccumLayout(90, 64, 256, 1, False, 32), AccumLayout(90, 128, 256, 2, False, 32)
MESH_SHAPE, AXES = (PROCESSES, 4), ("batch", "heads")
ROWS = P("batch", "heads", None)
SPECS = {"q": ROWS, "k": ROWS, "v": ROWS, "scale": P(), "k_scale": P(), "sink": P("heads"), "lse": ROWS,
         "dpsum": ROWS}


def operands(seed: int) -> dict[str, np.ndarray]:
    """The global operands, by name: accumulators in the layouts' orders, scales, a float32 sink with lse, dpsum."""
    rng = np.random.default_rng(seed)
    acc = lambda layout, h, s: oracle.dense_case(rng, layout, (B, s, h, D), 1.0, jnp.bfloat16)[0]  # noqa: E731
    x = {"q": acc(QL, H, S), "k": acc(KL, H_KV, S_K), "v": acc(KL, H_KV, S_K),
         "scale": np.float32(rng.uniform(0.1, 2.0)), "k_scale": np.float32(rng.uniform(0.1, 2.0))}
    x["sink"], x["lse"], x["dpsum"] = oracle.sink_inputs(rng, H, np.float32, (B, H, S), (B, H, QL.padded_seqlen(S)), 1)
    return {name: np.asarray(v) for name, v in x.items()}


def _dq(dtype, sink: bool):
    def op(x):
        if not sink:
            return (dq_postprocess(x["q"], x["scale"], head_dim=D, seqlen_q=S, dtype=dtype, layout=QL),)
        out = flash_attention_postprocess(x["q"], None, None, x["scale"], head_dim=D, seqlen_q=S, dtype=dtype,
                                          dq_layout=QL, learnable_sink=x["sink"], lse=x["lse"], dpsum=x["dpsum"])
        return out.dq, out.dsink
    return op


def _gqa(x):
    return flash_attention_postprocess(x["q"], x["k"], x["v"], x["scale"], head_dim=D, dq_layout=QL, dkv_layout=KL,
                                       dk_scale=x["k_scale"], seqlen_q=S, seqlen_k=S_K, learnable_sink=x["sink"],
                                       lse=x["lse"], dpsum=x["dpsum"])


CASES = {
    "dq-bf16": (_dq(jnp.bfloat16, False), ("dq",)),
    "dq-f16": (_dq(jnp.float16, False), ("dq",)),
    "dq-bf16-sink": (_dq(jnp.bfloat16, True), ("dq", "dsink")),
    "dq-f16-sink": (_dq(jnp.float16, True), ("dq", "dsink")),
    "gqa-bf16-sink": (_gqa, ("dq", "dk", "dv", "dsink")),
}
"""Each case: its op on the dict of operands, and the names of its results."""


def global_mesh(devices) -> Mesh:
    """The (batch, heads) mesh of ``devices`` (eight), row p those of process p."""
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(MESH_SHAPE), AXES)


def results(mesh: Mesh, x: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """Every case jitted on ``x`` placed over ``mesh``: its results by name, and the all-reduces in its program."""
    placed = {name: jax.make_array_from_callback(v.shape, NamedSharding(mesh, SPECS[name]), lambda i, v=v: v[i])
              for name, v in x.items()}
    outs, all_reduces = {}, {}
    for case, (op, names) in CASES.items():
        compiled = jax.jit(op).lower(placed).compile()
        outs[case] = dict(zip(names, compiled(placed)))
        all_reduces[case] = len(re.findall(r"\ball-reduce(?:-start)?\(", compiled.as_text()))
    return outs, all_reduces


def shard_entries(outs: dict) -> dict[str, np.ndarray]:
    """``<case>/<result>/<k>/index`` (the shard's global slice: (start, stop) per axis) and ``.../bits`` of every
    addressable shard ``k`` of every result."""
    entries = {}
    for case, by_name in outs.items():
        for name, arr in by_name.items():
            for k, shard in enumerate(arr.addressable_shards):
                key = f"{case}/{name}/{k}"
                entries[f"{key}/index"] = np.array([s.indices(n)[:2] for s, n in zip(shard.index, arr.shape)],
                                                   np.int64).reshape(arr.ndim, 2)
                entries[f"{key}/bits"] = bits(shard.data)  # npz has no bfloat16
    return entries


def main(process_id: int, port: int, seed: int, outdir: str) -> dict:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=PROCESSES,
                               process_id=process_id, cluster_detection_method="deactivate",
                               initialization_timeout=TIMEOUT_S, heartbeat_timeout_seconds=TIMEOUT_S,
                               shutdown_timeout_seconds=TIMEOUT_S)
    mesh = global_mesh(jax.devices())
    rows = [sorted({d.process_index for d in row}) for row in mesh.devices]
    outs, all_reduces = results(mesh, operands(seed))
    np.savez(os.path.join(outdir, f"process{process_id}.npz"), **shard_entries(outs))
    report = {"process_index": jax.process_index(), "process_count": jax.process_count(),
              "local_devices": jax.local_device_count(), "devices": jax.device_count(), "mesh_row_processes": rows,
              "all_reduces": all_reduces}
    jax.distributed.shutdown()
    return report


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))
