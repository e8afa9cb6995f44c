"""The postprocess inside a step, from the GPU timeline:

    python -m benchmarks.step [--out DIR] [--quick] [--reps N]     (also a section of ``python -m benchmarks``)

One jitted program per shape and slot, ``links`` times in a chain: a producer writes the float32 accumulator (a
fusion reading a base array), the slot converts it, a consumer fusion reads its output (``dq * 1.5 + 1``), and the
consumer's first element feeds the next link's producer, so links run in order; optimization barriers keep the
stages apart (no fusion across them). The slot is ``ours`` (``dq_postprocess``) or ``xla`` (XLA's ``(x *
scale).astype(bf16)`` of as many accumulator elements as the call's useful ones: the practical roofline in JAX). Shapes
are one layer's dQ: H=32, head dims 64-256, B 1-2 and S 1k-8k dense; packs of 2-8 sequences of random lengths.

Per link, on jax.profiler's timeline: ``slot`` = end(slot kernel) - end(the kernel before it) and ``gap`` =
start(slot kernel) - end(the kernel before it); medians over the links and ``reps`` traced executions. And
``wall``: wall-clock time per link of pipelined untraced executions (the host's launches included). Each registration of
our target runs in its own process: the default, which XLA captures into its command buffers, and the one it launches
between them (``JAX_DQPOST_COMMAND_BUFFERS=0``), with ``--xla_enable_command_buffers_during_profiling`` so that the
trace sees the command buffers a step runs (XLA otherwise replays them op by op while a profiler is active). Every
program is compiled and recorded before the one trace that measures them all.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import harness

H = 32
DENSE = [(64, 1, 1024), (64, 1, 4096), (64, 2, 8192), (128, 1, 1024), (128, 1, 4096), (128, 2, 8192),
         (256, 1, 1024), (256, 1, 4096), (256, 2, 8192)]
"""(head dim, B, S) of the dense shapes; :data:`PACKS`: (head dim, tokens, sequences) of the packed ones."""
PACKS = [(64, 4096, 2), (64, 16384, 8), (128, 4096, 4), (128, 16384, 8), (256, 8192, 4)]
QUICK = {"hd128 B=1 S=1024", "hd128 B=2 S=8192", "hd128 8 seqs, 16384 tokens"}  # --quick: these (``_label``)
LINK_BYTES = 1 << 30  # links per program: about this many bytes of accumulators, 2 to 8 links
METHOD = ("per link of a jitted chain producer -> slot -> consumer: slot = end(slot kernel) - end(previous kernel), "
          "gap = start(slot kernel) - end(previous kernel), on jax.profiler's timeline with XLA's command buffers "
          "recorded while profiling; medians over links and traced executions; wall = untraced wall clock per link")
CHILD_FLAGS = "--xla_enable_command_buffers_during_profiling=true"
CHILD_TIMEOUT_S = 900  # one registration's process, compiles included (about 25 s on the H200)


def shapes(quick: bool) -> list[dict]:
    out = [dict(packing="dense", head_dim=d, batch=b, seqlen=s, tokens=b * s) for d, b, s in DENSE]
    out += [dict(packing="varlen", head_dim=d, tokens=t, sequences=n) for d, t, n in PACKS]
    return [s for s in out if _label(s) in QUICK] if quick else out


class Program:
    """One shape's chain with one slot: ``run()`` executes it once; ``links`` and ``bytes`` (useful, per call)."""

    def __init__(self, shape: dict, slot: str, seed: int):
        import jax
        import jax.numpy as jnp

        from jax_dqpost import AccumLayout, dq_postprocess

        from . import cases

        D, T = shape["head_dim"], shape["tokens"]
        layout = AccumLayout.flash_attention(90, D, causal=False, tensor="dq", version="4.0.0b36")
        Dr, scale = layout.padded_head_dim(D), np.float32(D ** -0.5)
        if shape["packing"] == "dense":
            B, S = shape["batch"], shape["seqlen"]
            acc_shape = layout.accum_shape(B, H, S, D)
            ours = lambda a: dq_postprocess(a, scale, seqlen_q=S, head_dim=D, layout=layout)  # noqa: E731
        else:
            cu = cases.random_lengths(np.random.default_rng(seed), T, shape["sequences"])
            acc_shape = layout.varlen_accum_shape(len(cu) - 1, H, T, D)
            ours = lambda a: dq_postprocess(a, scale, head_dim=D, total_q=T, cu_seqlens_q=cu,  # noqa: E731
                                            layout=layout)
        self.cu = None if shape["packing"] == "dense" else cu
        useful = T * H * Dr  # the accumulator elements of the rows of dQ
        xla = lambda a: (a.reshape(-1)[:useful] * scale).astype(jnp.bfloat16)  # noqa: E731
        convert = ours if slot == "ours" else xla
        self.bytes = useful * 4 + T * H * D * 2
        self.links = int(max(2, min(8, LINK_BYTES // (int(np.prod(acc_shape)) * 4))))
        barrier = jax.lax.optimization_barrier

        def chain(base):
            dep, outs = jnp.float32(0), []
            for i in range(self.links):
                acc = barrier(base * (1 + (i + 1) / 4096 + dep * 1e-30))  # producer (never a multiply by 1)
                dq = barrier(convert(acc))  # slot
                out = barrier(dq.astype(jnp.float32) * 1.5 + 1)  # consumer
                dep = out.reshape(-1)[0]
                outs.append(out)
            return outs

        self.fn = jax.jit(chain)
        self.base = jax.random.normal(jax.random.key(seed), acc_shape, jnp.float32)

    def run(self):
        return self.fn(self.base)


MARKER = "sine"
"""A tiny kernel run between the traced programs (``jnp.sin``): its name on the timeline splits the trace."""


def _split(events: list[tuple], parts: int) -> list[list[tuple]]:
    """The kernels (start, end, name) between the marker kernels that precede each of ``parts`` programs."""
    marks = [i for i, e in enumerate(events) if MARKER in e[2]]
    if len(marks) != parts:
        raise RuntimeError(f"{len(marks)} marker kernels on the timeline for {parts} programs")
    return [events[a + 1:b] for a, b in zip(marks, marks[1:] + [len(events)])]


def _spans(kernels: list[tuple], reps: int, positions: list[int]) -> dict:
    """Per execution (``reps`` of equal length) and slot kernel (at ``positions`` of an execution): the slot and the
    gap before it (see the module's docstring), medians and quartiles in us."""
    n = len(kernels) // reps
    if n * reps != len(kernels) or not positions or positions[0] == 0 or positions[-1] >= n:
        raise RuntimeError(f"{len(kernels)} kernels for {reps} executions with slots at {positions}")
    slots, gaps = [], []
    for r in range(reps):
        for j in positions:
            prev, cur = kernels[r * n + j - 1], kernels[r * n + j]
            slots.append((cur[1] - prev[1]) * 1e-3)
            gaps.append((cur[0] - prev[1]) * 1e-3)
    return dict(slot_us=statistics.median(slots), gap_us=statistics.median(gaps),
                slot_us_quartiles=[float(np.percentile(slots, q)) for q in (25, 75)], kernels_per_execution=n,
                slot_kernel=kernels[positions[0]][2][:60])


def _slot_positions(kernels: list[tuple], reps: int) -> list[int]:
    """Where our kernel sits in an execution of the ``ours`` program (``reps`` of equal length)."""
    n = len(kernels) // reps
    return [j for j in range(n) if harness.OUR_KERNEL in kernels[j][2]]


def _check_same_places(kernels: list[tuple], reps: int, positions: list[int]) -> None:
    """The ``xla`` program has the ``ours`` program's kernels but the slot's: at ``positions`` of every execution one
    kernel name, which is not the kernel's before it (the producer); else a RuntimeError."""
    n = len(kernels) // reps
    names = {kernels[r * n + j][2] for r in range(reps) for j in positions if r * n + j < len(kernels)}
    before = {kernels[r * n + j - 1][2] for r in range(reps) for j in positions if 0 < r * n + j <= len(kernels)}
    if len(names) != 1 or names & before:
        raise RuntimeError(f"the slot's kernels at {positions} are {sorted(names)}, after {sorted(before)}")


def _execution(kernels: list[tuple], reps: int) -> list[tuple[str, float]]:
    """An execution's kernels: each one's name (shortened) and median duration in us over the ``reps`` executions
    (evidence of what the program ran; empty if the kernels do not split into equal executions)."""
    n = len(kernels) // reps
    if not n or n * reps != len(kernels):
        return []
    return [(kernels[j][2][:48], statistics.median((kernels[r * n + j][1] - kernels[r * n + j][0]) * 1e-3
                                                   for r in range(reps))) for j in range(n)]


def measure_all(quick: bool, reps: int) -> list[dict]:
    """In this process (its registration of our target, its XLA flags): every shape's ``ours`` and ``xla`` programs,
    each executed twice untraced (warm-up, command-buffer recording) and timed untraced (the second of two rounds of
    pipelined executions), then all in one trace."""
    import jax
    import jax.numpy as jnp

    from . import internals

    marker = jax.jit(jnp.sin)
    small = jnp.ones(8)
    jax.block_until_ready(marker(small))
    programs = []
    for k, shape in enumerate(shapes(quick)):
        for slot in ("ours", "xla"):
            p = Program(dict(shape), slot, seed=k)
            for _ in range(2):
                jax.block_until_ready(p.run())
            for _ in range(2):  # the first round grows the allocator's pool for pipelined executions
                t0 = time.perf_counter()
                for _ in range(reps):
                    out = p.run()
                jax.block_until_ready(out)
                p.wall = (time.perf_counter() - t0) / (reps * p.links)
            programs.append((shape, slot, p))
    trace_dir = tempfile.mkdtemp(prefix="jax_dqpost_step_")
    try:
        with jax.profiler.trace(trace_dir):
            for _, _, p in programs:  # one program at a time, after a marker kernel
                jax.block_until_ready(marker(small))
                for _ in range(reps):
                    jax.block_until_ready(p.run())
        events = sorted((s, s + d, ev) for _, ev, s, d in harness.gpu_activities(trace_dir)
                        if not ev.lower().startswith(("memcpy", "memset")))
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    results, positions = [], []
    for (shape, slot, p), kernels in zip(programs, _split(events, len(programs))):
        row = dict(shape, slot=slot, bytes=p.bytes, links=p.links, reps=reps, wall_us=p.wall * 1e6,
                   command_buffers=internals.command_buffers())
        if p.cu is not None:
            row["cu_seqlens"] = p.cu
        row["kernels"] = _execution(kernels, reps)
        try:
            if slot == "ours":  # the xla program has the same kernels but the slot's: the same positions
                positions = _slot_positions(kernels, reps)
            else:
                _check_same_places(kernels, reps, positions)
            row.update(_spans(kernels, reps, positions))
        except RuntimeError as e:
            row["error"] = str(e)
        results.append(row)
    return results


_CHILD = r"""
import json, sys
from benchmarks import step
print(json.dumps(step.measure_all(sys.argv[1] == "quick", int(sys.argv[2]))))
"""


def measure(quick: bool = False, reps: int = 5) -> dict:
    """Both registrations of our target, each in a fresh process (:data:`_CHILD`): ``{"launched": rows, "captured":
    rows}`` (or ``{"error": ...}`` for a process that failed); captured is the default."""
    out = {}
    for name, capture in (("launched", "0"), ("captured", "")):
        env = {**os.environ, "JAX_DQPOST_COMMAND_BUFFERS": capture, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
               "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + CHILD_FLAGS).strip()}
        try:
            p = harness.python_child(_CHILD, env, "quick" if quick else "full", str(reps), timeout=CHILD_TIMEOUT_S)
            out[name] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {
                "error": p.stderr[-2000:]}
        except (subprocess.TimeoutExpired, ValueError, IndexError) as e:  # no report from the child
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    return out


def table(report: dict) -> str:
    """One line per shape: ours and XLA's slot (us), their ratio, the gaps and wall per link, per registration."""
    lines = ["| shape | MB | registration | ours slot (us) | XLA slot (us) | ours / XLA | gap ours / XLA (us) | "
             "wall per link ours / XLA (us) |", "|---|---|---|---|---|---|---|---|"]
    for name, rows in report.items():
        if isinstance(rows, dict):
            lines.append(f"| {name}: {rows.get('error', '')[-300:]!r} |")
            continue
        pairs = {}
        for r in rows:
            pairs.setdefault(_label(r), {})[r["slot"]] = r
        for label, pair in pairs.items():
            o, x = pair.get("ours", {}), pair.get("xla", {})
            if "slot_us" not in o or "slot_us" not in x:
                lines.append(f"| {label} | | {name} | {o.get('error') or x.get('error')} |")
                continue
            lines.append(f"| {label} | {o['bytes'] / 1e6:.1f} | {name} | {o['slot_us']:.1f} | {x['slot_us']:.1f} | "
                         f"{o['slot_us'] / x['slot_us']:.3f} | {o['gap_us']:.2f} / {x['gap_us']:.2f} | "
                         f"{o['wall_us']:.1f} / {x['wall_us']:.1f} |")
    return "\n".join(lines)


def _label(r: dict) -> str:
    if r["packing"] == "dense":
        return f"hd{r['head_dim']} B={r['batch']} S={r['seqlen']}"
    return f"hd{r['head_dim']} {r['sequences']} seqs, {r['tokens']} tokens"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__.splitlines()[0].rstrip(":"))
    p.add_argument("--out", default=".", help="folder for step.json")
    p.add_argument("--quick", action="store_true", help="three shapes")
    p.add_argument("--reps", type=int, default=5, help="traced executions per program")
    args = p.parse_args(argv)
    import jax

    if jax.default_backend() != "gpu":
        print("python -m benchmarks.step needs a CUDA GPU", file=sys.stderr)
        return 2
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  commit=harness.commit(), gpu=jax.devices()[0].device_kind, jax=jax.__version__, method=METHOD,
                  step=measure(args.quick, args.reps))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "step.json").write_text(json.dumps(report, indent=1) + "\n")
    print(table(report["step"]))
    return 1 if all(isinstance(rows, dict) for rows in report["step"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
