"""Times the backward of FlashAttention-4 in JAX: fa4-jax alone against fa4-jax finished by jax-dqpost.

In one run:

    python -m benchmarks.fa4jax [--out DIR] [--quick]     (needs a CUDA GPU and fa4-jax 0.1.0)

For B=2, H=32, H_kv = 8 and 32, S=8192, head dims 64, 128 and 192, causal and not, bf16, it times the backward
alone (``jax.jit`` of the function ``jax.vjp`` returns, its residuals passed as arguments) of

- ``fa4jax``: fa4-jax's kernel backend (preprocess, main kernel, one postprocess launch per accumulator);
- ``dqpost``: :mod:`jax_dqpost.fa4jax` (the same preprocess and main kernel, one jax-dqpost launch);
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, for context (where cuDNN takes the shape).

Device time from the GPU timeline (jax.profiler): a step's time is the sum of the durations of its GPU activities
(kernels and memsets), the postprocess share that of the kernels whose name contains ``Postprocess``, the rest
the preprocess, the main kernel and the accumulators' zeroing (the same kernels in both); each is the median over
the traced steps; fa4-jax and ours in turn in one trace, their order reversed every other round (A B B A ...), so
that each follows itself and the other equally often; cuDNN in a trace of its own.
"Bwd ratio" is fa4-jax's step time over ours (above 1: ours is faster). Prints a table and writes
``fa4jax.json`` into ``--out``. The gradients of ``fa4jax`` and ``dqpost`` are compared on the way (they agree
to the atomics' rounding: the backward adds fp32 partial sums in no fixed order).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from . import harness

POST = "Postprocess"
METHOD = ("device time of the backward alone (jax.jit of jax.vjp's function, residuals as arguments): per step, the "
          "sum of the durations of its GPU activities (kernels and memsets) on jax.profiler's timeline; postprocess "
          "= kernels whose name contains 'Postprocess'; median over the steps; fa4-jax and ours in turn in one trace, "
          "order reversed every other round (ABBA); cuDNN in its own trace")


def shapes(quick: bool):
    heads_kv = (8,) if quick else (8, 32)
    dims = (128,) if quick else (64, 128, 192)
    return [dict(batch=2, heads=32, heads_kv=hkv, seqlen=8192, head_dim=d, causal=c)
            for hkv in heads_kv for d in dims for c in (False, True)]


def _attention(name):
    import jax

    from jax_dqpost import fa4jax

    if name == "dqpost":
        return fa4jax.flash_attn
    if name == "fa4jax":
        import fa4_jax
        return lambda q, k, v, causal: fa4_jax.flash_attn(q, k, v, causal=causal, backend="cute")
    return lambda q, k, v, causal: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def backward_step(name, q, k, v, causal):
    """``(step, args)``: ``step(*args)`` runs the backward of ``name`` for a random output cotangent."""
    import functools

    import jax

    attention = functools.partial(_attention(name), causal=causal)
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v), q, k, v)
    d_out = jax.random.normal(jax.random.key(1), out.shape, out.dtype)
    return jax.jit(lambda vjp, d_out: vjp(d_out)), (vjp, d_out)


def _trace(calls) -> list[tuple[str, int]]:
    """``(name, duration ns)`` of the GPU activities (no copies) of running each ``(step, args)`` once, in order
    (:func:`harness.traced_activities`: one untraced run first)."""
    import jax

    def run():
        for step, args in calls:
            jax.block_until_ready(step(*args))

    activities = sorted(harness.traced_activities(run, ()), key=lambda a: a[3])
    return [(ev, dur) for _, _, ev, _, dur in activities if not ev.lower().startswith("memcpy")]


def measure(runs: dict, steps: int) -> dict:
    """Each ``runs[name] = (step, args)`` traced ``steps`` times, the implementations in turn (reversed every other
    round): per implementation, the medians of the step's device time, its postprocess's and each activity's."""
    import jax

    for step, args in runs.values():
        jax.block_until_ready(step(*args))
    counts = {name: len(_trace([run])) for name, run in runs.items()}
    orders = [list(runs) if r % 2 == 0 else list(runs)[::-1] for r in range(steps)]
    events = _trace([runs[name] for order in orders for name in order])
    if len(events) != sum(counts.values()) * steps:
        raise RuntimeError(f"{len(events)} GPU activities for {steps} rounds of {counts}")
    chunks, at = {name: [] for name in runs}, 0
    for order in orders:
        for name in order:
            chunks[name].append(events[at:at + counts[name]])
            at += counts[name]
    result = {}
    for name, steps_of in chunks.items():
        names = [ev for ev, _ in steps_of[0]]
        if any([ev for ev, _ in c] != names for c in steps_of):
            raise RuntimeError(f"{name}: the traced steps ran different GPU activities")
        result[name] = dict(step_us=statistics.median(sum(d for _, d in c) for c in steps_of) * 1e-3,
                            post_us=statistics.median(sum(d for ev, d in c if POST in ev) for c in steps_of) * 1e-3,
                            activities=[(ev, statistics.median(c[i][1] for c in steps_of) * 1e-3)
                                        for i, ev in enumerate(names)])
    return result


def run_shape(shape, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    b, h, hkv, s, d, causal = (shape[k] for k in ("batch", "heads", "heads_kv", "seqlen", "head_dim", "causal"))
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.bfloat16)
    runs, skipped = {}, {}
    for name in ("fa4jax", "dqpost", "cudnn"):
        try:
            runs[name] = backward_step(name, q, k, v, causal)
            jax.block_until_ready(runs[name][0](*runs[name][1]))
        except Exception as e:  # noqa: BLE001 - cuDNN refuses some shapes; that is a result
            if name != "cudnn":
                raise
            runs.pop(name, None)
            skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    ours, theirs = (runs[n][0](*runs[n][1]) for n in ("dqpost", "fa4jax"))
    agree = {}
    for g, a, b_ in zip("qkv", ours, theirs):
        a32, b32 = np.asarray(a, np.float32), np.asarray(b_, np.float32)
        agree[f"d{g}_identical"] = float(np.mean(a32 == b32))
        agree[f"d{g}_max_rel"] = float(np.max(np.abs(a32 - b32)) / max(np.max(np.abs(b32)), 1e-30))
    # fa4-jax and ours in turn (ABBA: each follows itself and the other equally often), cuDNN's slower kernels apart
    pair = {name: runs[name] for name in ("fa4jax", "dqpost")}
    timed = measure(pair, steps) | (measure({"cudnn": runs["cudnn"]}, steps) if "cudnn" in runs else {})
    result = dict(shape, **timed, skipped=skipped, agreement=agree)
    return result


def table(results) -> str:
    rows = ["| H_kv | hd | causal | fa4-jax bwd (us) | its postprocess (us) | + jax-dqpost bwd (us) | our postprocess "
            "(us) | bwd ratio | postprocess ratio | rest, fa4-jax / ours (us) | cuDNN bwd (us) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        f, o = r["fa4jax"], r["dqpost"]
        cudnn = f"{r['cudnn']['step_us']:.1f}" if "cudnn" in r else "n/a"
        rows.append(f"| {r['heads_kv']} | {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {f['step_us']:.1f} | "
                    f"{f['post_us']:.1f} | {o['step_us']:.1f} | {o['post_us']:.1f} | "
                    f"{f['step_us'] / o['step_us']:.3f} | {f['post_us'] / o['post_us']:.2f} | "
                    f"{f['step_us'] - f['post_us']:.1f} / {o['step_us'] - o['post_us']:.1f} | {cudnn} |")
    return "\n".join(rows)


def run_all(prog: str, out: str, report_name: str, method: str, shapes, run_one, table) -> int:
    """The run of a benchmark of fa4-jax's attention: exit status 2 and one line on stderr without fa4-jax or a GPU;
    else ``run_one(shape)`` for each shape, the table's row on stderr as it comes, the report (``method``, the
    results, the date, commit, GPU and jax) written to ``out/report_name`` after each shape, the table on stdout."""
    import jax

    from jax_dqpost import fa4jax

    try:
        fa4jax.register()
    except ImportError as e:
        print(e, file=sys.stderr)
        return 2
    if jax.default_backend() != "gpu":
        print(f"{prog} needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    Path(out).mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        harness.log(f"{prog}: {shape}")
        results.append(run_one(shape))
        harness.log(table(results[-1:]).splitlines()[-1])
        report = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                      commit=harness.commit(), gpu=jax.devices()[0].device_kind, jax=jax.__version__, method=method,
                      results=results)
        (Path(out) / report_name).write_text(json.dumps(report, indent=1))  # after each shape
    print(table(results))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fa4jax", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="folder for fa4jax.json")
    p.add_argument("--quick", action="store_true", help="hd 128, H_kv 8 only")
    p.add_argument("--steps", type=int, default=30, help="traced steps per implementation and shape")
    args = p.parse_args(argv)
    return run_all(p.prog, args.out, "fa4jax.json", METHOD, shapes(args.quick),
                   lambda shape: run_shape(shape, args.steps), table)


if __name__ == "__main__":
    sys.exit(main())
