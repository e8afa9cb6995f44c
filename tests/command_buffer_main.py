"""CUDA-graph evidence, run as its own process (XLA reads its flags once, at backend start):

    XLA_FLAGS=--xla_dump_to=DIR python3 tests/command_buffer_main.py SEED DIR

Compiles three jitted programs: dq_postprocess called repeatedly in a straight chain and in a `lax.fori_loop`,
and a chain of the fused op (dQ, dK, dV and dsink); runs them and checks every result bit for bit against the
oracle (dsink: against the same call outside any graph), and reports where XLA put our FFI call:
in command buffers (CUDA graphs) formed on the HLO (`command_buffer` computations) or, in current XLA, on
the thunk sequence (`*thunk_sequence_after_thunk_passes*.txt` in the dump directory). Prints one JSON
object (test_gpu_runtime.py reads it).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402

from jax_dqpost import AccumLayout, dq_postprocess, flash_attention_postprocess  # noqa: E402
from jax_dqpost.postprocess._primitive import ffi as _ffi  # noqa: E402


def computations(hlo_text: str) -> dict[str, str]:
    """HLO module text -> {computation name: body}."""
    out, name, body = {}, None, []
    for line in hlo_text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if name is None and m:
            name, body = m.group(1), []
        elif name is not None and line.startswith("}"):
            out[name] = "\n".join(body)
            name = None
        elif name is not None:
            body.append(line)
    return out


def hlo_command_buffers(compiled) -> list[str]:
    """Names of command-buffer computations of a compiled program that contain our FFI call."""
    comps = computations(compiled.as_text())
    targets = [f'custom_call_target="{_ffi.TARGET_NAME}"']
    return sorted(n for n, b in comps.items() if "command_buffer" in n and any(t in b for t in targets))


def thunk_dumps(dump_dir: str, module: str) -> dict[str, str]:
    """XLA's dumped thunk sequences (after its thunk passes) of the modules named like ``module``."""
    paths = glob.glob(os.path.join(dump_dir, f"*{module}*thunk_sequence_after_thunk_passes*.txt"))
    return {os.path.basename(p): open(p).read() for p in sorted(paths)}


def thunk_command_buffer_holds_call(text: str) -> bool:
    """Whether a dumped thunk sequence has a command-buffer thunk with a custom-call thunk nested in it
    (nesting is shown by indentation)."""
    lines = text.splitlines()
    indent = lambda line: len(line) - len(line.lstrip())  # noqa: E731
    for i, line in enumerate(lines):
        if "kCommandBuffer" in line:
            for inner in lines[i + 1:]:
                if inner.strip() and indent(inner) <= indent(line):
                    break
                if "kCustomCall" in inner or _ffi.TARGET_NAME in inner:
                    return True
    return False


def main(seed: int, dump_dir: str) -> dict:
    rng = np.random.default_rng(seed)
    layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
    B, S, H, D, steps = 2, 300, 4, 128, 6
    logical = oracle.random_logical(rng, (B, S, H, D), specials=False)
    acc = jnp.asarray(oracle.build_accumulator(
        logical, (layout.tile_m, layout.num_threads, layout.atom_layout, layout.swap_ab),
        hdim_multiple_of=layout.hdim_multiple_of, rng=rng))
    scales = rng.uniform(0.05, 2.0, steps).astype(np.float32)

    def op(s):
        return dq_postprocess(acc, s, seqlen_q=S, head_dim=D, dtype=jnp.bfloat16, layout=layout)

    def chain(scales):  # `steps` calls in a straight line
        return jnp.stack([op(scales[i]) for i in range(steps)])

    def loop(scales):  # the same calls in a device-side loop
        out = jnp.zeros((steps, B, S, H, D), jnp.bfloat16)
        return jax.lax.fori_loop(0, steps, lambda i, o: o.at[i].set(op(scales[i])), out)

    # The fused op (dQ, dK, dV and dsink in one launch), chained likewise.
    kv_layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dkv", version="4.0.0b36")
    kv_logical = oracle.random_logical(rng, (B, S, 2, D), specials=False)
    kv_acc = jnp.asarray(oracle.build_accumulator(
        kv_logical, (kv_layout.tile_m, kv_layout.num_threads, kv_layout.atom_layout, kv_layout.swap_ab),
        hdim_multiple_of=kv_layout.hdim_multiple_of, rng=rng))
    sink = jnp.asarray(rng.standard_normal(H).astype(np.float32))
    lse = sink[None, :, None] + jnp.asarray(np.abs(rng.standard_normal((B, H, S))).astype(np.float32))
    dpsum = jnp.asarray(rng.standard_normal((B, H, layout.padded_seqlen(S))).astype(np.float32))

    def fused(s):
        return flash_attention_postprocess(acc, kv_acc, kv_acc, s, head_dim=D, dq_layout=layout, dkv_layout=kv_layout,
                                           seqlen_q=S, seqlen_k=S, learnable_sink=sink, lse=lse, dpsum=dpsum)

    def fused_chain(scales):
        outs = [fused(scales[i]) for i in range(steps)]
        return tuple(jnp.stack([o[j] for o in outs]) for j in range(4))

    def fused_exact(got):
        dsink_alone = np.asarray(jax.jit(fused)(scales[0])[3])  # one call outside any graph
        return all(np.array_equal(got[0][i].view(np.uint16), oracle.expected_dq(logical, scales[i], jnp.bfloat16)
                                  .view(np.uint16)) and
                   np.array_equal(got[1][i].view(np.uint16), oracle.expected_dq(kv_logical, scales[i], jnp.bfloat16)
                                  .view(np.uint16)) and
                   np.array_equal(got[2][i].view(np.uint16), oracle.expected_dq(kv_logical, 1.0, jnp.bfloat16)
                                  .view(np.uint16)) and
                   np.array_equal(got[3][i].view(np.uint32), dsink_alone.view(np.uint32)) for i in range(steps))

    report = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "device": str(jax.devices()[0])}
    for name, fn in (("chain", chain), ("fori_loop", loop), ("fused_chain", fused_chain)):
        fn.__name__ = f"dqpost_{name}"  # the module's name in the dump
        compiled = jax.jit(fn).lower(scales).compile()
        if name == "fused_chain":
            exact = fused_exact([np.asarray(x) for x in compiled(scales)])
        else:
            got = np.asarray(compiled(scales))
            exact = all(np.array_equal(got[i].view(np.uint16), oracle.expected_dq(logical, scales[i], jnp.bfloat16)
                                       .view(np.uint16)) for i in range(steps))
        thunks = thunk_dumps(dump_dir, fn.__name__) if dump_dir else {}
        report[name] = {"bit_exact": exact, "hlo_command_buffers": hlo_command_buffers(compiled),
                        "thunk_command_buffers": sorted(f for f, t in thunks.items()
                                                        if thunk_command_buffer_holds_call(t)),
                        "thunk_sequences": thunks}
    return report


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0, sys.argv[2] if len(sys.argv) > 2 else "")))
