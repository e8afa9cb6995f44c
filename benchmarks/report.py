"""The benchmark's report: tables on stdout, the plot (matplotlib, optional), from the measurements' JSON."""

from __future__ import annotations

from pathlib import Path

from .cases import CONFIGS, PACKINGS, PLOTTED, REFERENCE_SEQUENCES, REFERENCE_SHAPE


def _tbps(res, impl):
    return res["bytes"] / res[impl] / 1e12 if impl in res else float("nan")


def _ratio(res, num, den, fmt):
    return format(res[num] / res[den], fmt) if num in res and den in res else "-"


def table(rows) -> str:
    """One line per measured case; columns an implementation was not measured for show '-'."""
    head = (f"{'config':>13} {'packing':>7} | {'MB':>6} | {'ours us (TB/s)':>15} | {'FA4 us (TB/s)':>15} | "
            f"{'copy us (TB/s)':>15} | {'ours/FA4':>8} | {'of copy':>7} | {'XLA dev us':>10} | {'of XLA':>6} | "
            f"{'jax us':>8} | {'XLA op us':>9} | {'gather us':>9} | {'x gather':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        us = lambda k: f"{r[k] * 1e6:7.1f} ({_tbps(r, k):4.2f})" if k in r else "-"  # noqa: E731
        plain = lambda k: f"{r[k] * 1e6:.1f}" if k in r else "-"  # noqa: E731
        lines.append(
            f"{r['config']:>13} {r['packing']:>7} | {r['bytes'] / 1e6:6.1f} | {us('ours'):>15} | {us('FA4'):>15} | "
            f"{us('copy'):>15} | {_ratio(r, 'FA4', 'ours', '8.3f'):>8} | {_ratio(r, 'copy', 'ours', '7.1%'):>7} | "
            f"{plain('xla_device'):>10} | {_ratio(r, 'xla_device', 'ours', '6.1%'):>6} | {plain('ours_jax'):>8} | "
            f"{plain('xla_same_bytes'):>9} | {plain('jnp_gather'):>9} | "
            f"{_ratio(r, 'jnp_gather', 'ours_jax', '8.1f'):>8}")
    return "\n".join(lines)


GOALS = {"dense of XLA op": 1.00, "varlen of XLA op": 0.98, "fused of XLA op": 0.98, "short of dense": 0.75,
         "short of sector bound": 0.75, "short of granule bound": 0.75}
"""The speed goals: our device time against XLA's fused op of the same bytes, and the short-sequence
sweep's throughput against dense (lengths up to 200, beyond 16) and against the bytes the lengths need (lengths up to
16): in 32-byte sectors, and in the granules the L2 fetches from DRAM (its fetch granularity, 64 bytes by default)."""


def _device(r: dict):
    """Our device time of a row: graph replay (``ours``), else the jitted op's GPU timeline."""
    return r.get("ours") or r.get("ours_jax_device")


def _goals(report: dict) -> list[str]:
    """One line per goal: the worst measured value and whether it is met."""
    lines = []

    def line(name, values):
        if values:
            worst = min(values, key=lambda v: v[1])
            lines.append(f"goal {name} >= {GOALS[name]:.0%}: worst {worst[1]:.1%} ({worst[0]}), "
                         f"{'met' if worst[1] >= GOALS[name] else 'MISSED'}")
    for packing in ("dense", "varlen"):
        line(f"{packing} of XLA op", [(r["config"], r["xla_device"] / _device(r)) for r in report["reference"]
                                      if r["packing"] == packing and "xla_device" in r and _device(r)])
    line("fused of XLA op", [(r["config"], r["xla_same_bytes"] / r["fused"]) for r in report.get("fused", [])
                             if "fused" in r and "xla_same_bytes" in r])
    dense = {r["config"]: r for r in report["reference"] if r["packing"] == "dense"}
    if "hd128" in dense and _device(dense["hd128"]):
        d = _device(dense["hd128"])
        rows = [r for r in report.get("short", []) if _device(r)]
        tag = lambda r: f"{r['sequences']} seqs, {'traced' if r['traced'] else 'static'}"  # noqa: E731
        # lengths 1..200 against dense; lengths 1..16 (no tile's worth of rows) against the bytes their rows need
        line("short of dense", [(tag(r), d / _device(r)) for r in rows if 16 < r["max_length"] <= 200])
        for name, key in (("short of sector bound", "bound_bytes"), ("short of granule bound", "granule_bound_bytes")):
            line(name, [(tag(r), d * r[key] / r["bytes"] / _device(r)) for r in rows
                        if r["max_length"] <= 16 and key in r])
    return lines


def short_table(rows, dense: dict) -> str:
    """The short-sequence sweep; throughputs are device times against our dense hd128's."""
    head = (f"{'sequences':>9} {'max len':>7} {'offsets':>7} | {'ours us':>8} | {'FA4 us':>8} | {'jit us':>8} | "
            f"{'of dense':>8} | {'sector MB':>9} | {'of it':>6} | {'granule MB':>10} | {'of it':>6} | {'CTAs':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        t, d = _device(r), _device(dense)
        plain = lambda k: f"{r[k] * 1e6:.1f}" if k in r else "-"  # noqa: E731
        of_dense = f"{d / t:.1%}" if t and d else "-"
        of = lambda k: f"{d * r[k] / r['bytes'] / t:.1%}" if t and d and k in r else "-"  # noqa: E731
        mb = lambda k: f"{r[k] / 1e6:.1f}" if k in r else "-"  # noqa: E731
        lines.append(f"{r['sequences']:>9} {r['max_length']:>7} {'traced' if r['traced'] else 'static':>7} | "
                     f"{plain('ours'):>8} | {plain('FA4'):>8} | {plain('ours_jax_device'):>8} | {of_dense:>8} | "
                     f"{mb('bound_bytes'):>9} | {of('bound_bytes'):>6} | {mb('granule_bound_bytes'):>10} | "
                     f"{of('granule_bound_bytes'):>6} | {r['ctas']:>7}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Bandwidth against size, one panel per (packing, configuration), device times only (:data:`PLOTTED`). Needs
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["sweep"]
    configs = [c for c, _, _ in CONFIGS]
    fig, axes = plt.subplots(2, len(configs), figsize=(4 * len(configs), 7), sharey=True, squeeze=False)
    for i, packing in enumerate(PACKINGS):
        for j, config in enumerate(configs):
            ax = axes[i, j]
            rs = sorted((r for r in rows if r["packing"] == packing and r["config"] == config),
                        key=lambda r: r["bytes"])
            for impl, label in PLOTTED.items():
                pts = [(r["bytes"], _tbps(r, impl)) for r in rs if impl in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, label=label)
            ax.set_xscale("log")
            ax.set_title(f"{config} {packing}", fontsize=9)
            ax.grid(True, alpha=0.3)
            if i == 1:
                ax.set_xlabel("bytes moved per call")
            if j == 0:
                ax.set_ylabel("TB/s")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"dQ postprocess, bf16, {report['gpu']}, {report['date']} ({report['commit']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(report: dict) -> str:
    """The printed report of a run (everything but the plot)."""
    out = [f"== {report['gpu']}, {report['date']}, commit {report['commit']}, jax {report['jax']}, "
           f"FlashAttention-4 {report['flash_attn']}; median of {report['samples']} samples",
           f"\n== B, H, S = {REFERENCE_SHAPE}, bf16 (varlen: {REFERENCE_SEQUENCES} random lengths, same tokens)",
           table(report["reference"])]
    if report.get("fused"):
        from .fused import GQA_SHAPE, table as fused_table

        out += [f"\n== fused dQ + dK + dV (+ dsink) in one launch, B, H, H_kv, S = {GQA_SHAPE}, bf16 "
                "(varlen: 64 random lengths)", fused_table(report["fused"])]
    dense = {r["config"]: r for r in report["reference"] if r["packing"] == "dense"}
    key = "ours" if all("ours" in r for r in report["reference"]) else "ours_jax"
    for r in report["reference"]:
        if r["packing"] == "varlen" and r["config"] in dense:
            d = dense[r["config"]]
            out.append(f"varlen {r['config']}: {d[key] / r[key]:.1%} of our dense throughput ({key}: "
                       f"{d[key] * 1e6:.1f} -> {r[key] * 1e6:.1f} us for {r['tokens']} tokens)")
    out += _goals(report)
    if report.get("short") and "hd128" in dense:
        out += ["\n== short sequences, hd128, random lengths over the same tokens (of dense: throughput against our "
                "dense hd128; of it: the bound's bytes at our dense throughput, in 32-byte sectors and in the L2's "
                "fetch granules)", short_table(
                    report["short"], dense["hd128"])]
    if report["sweep"]:
        out += ["\n== size sweep (bytes moved per call)",
                table(sorted(report["sweep"], key=lambda r: (r["config"], r["packing"], r["bytes"])))]
    c = report.get("chain")
    if c:
        modes = {True: "default: our calls captured into XLA's command buffers",
                 False: "JAX_DQPOST_COMMAND_BUFFERS=0: our calls launched between XLA's command buffers"}
        mode = modes.get(c.get("command_buffers"), "registration not recorded")
        out.append(f"\n== per-call cost in a jitted chain of {c['calls']} tiny calls {tuple(c['shape'])} ({mode}): "
                   "ours "
                   f"{c['ours'] * 1e6:.2f} us ({c['our_calls_in_program']} calls in the compiled program; whole "
                   f"program {c['ours_program_n'] * 1e6:.0f} us vs {c['ours_program_1'] * 1e6:.0f} us for one call); "
                   f"{c['ours_outputs_returned'] * 1e6:.2f} us when all {c['calls']} outputs are results of the "
                   f"program; XLA elementwise op {c['xla_elementwise'] * 1e6:.2f} us per kernel "
                   f"({c['xla_kernels_in_program']} kernels)")
        for label, k in (("ours", "ours_device"), ("XLA elementwise", "xla_device")):
            dev = c.get(k) or {}
            if "per_call" in dev:
                out.append(f"   GPU timeline (jax.profiler, one execution): {label} {dev['per_call'] * 1e6:.2f} us "
                           f"per call on the device ({dev['kernels']} kernels, median "
                           f"{dev['median_duration'] * 1e6:.2f} us each, median gap {dev['median_gap'] * 1e6:.2f} us)")
            else:
                out.append(f"   GPU timeline of {label}: not recorded {dev.get('error', '')}")
    s = report.get("start")
    if s and "error" in s:
        out.append(f"start probe failed: {s['error']}")
    elif s:
        for name in ("cold", "warm"):
            cfg = ", ".join(f"hd{x['head_dim']} {x['first_result']:.3f} s (kernel {x['get_kernel']:.3f} s)"
                            for x in s[name]["configs"])
            out.append(f"== {name} start, first call to first result: {cfg}; import jax {s[name]['import_jax']:.3f} s, "
                       f"import jax_dqpost {s[name]['import_jax_dqpost']:.3f} s")
    for name, r in (report.get("jax_path") or {}).items():
        out.append(f"== jax.jit(dq_postprocess) hd128 dense {REFERENCE_SHAPE}, XLA command buffers {name}: " + (
            r["error"][-300:] if "error" in r else
            ", ".join(f"{k.replace('_', ' ')} {v * 1e6:.1f} us per call" for k, v in r.items())))
    if report.get("step"):
        from .step import table as step_table

        out += ["\n== inside a step: producer -> slot -> consumer (benchmarks/step.py)", step_table(report["step"])]
    return "\n".join(out)
