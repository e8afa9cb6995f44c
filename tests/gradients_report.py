"""Turn the records of ``test_gradients.py`` (``JAX_DQPOST_GRADIENTS_OUT=dir``) into the data the test reads and the
table of docs/gradients.md.

    python tests/gradients_report.py DIR --data tests/data/producer_gradients.json --table table.md

``--data`` writes, per producer release, the cases whose own gradients are wrong (and which tensors), those it cannot
run, and those jax_dqpost.fa4jax refuses. ``--table`` writes one markdown table per producer: each case's relative
error ``max|g - ref| / max|ref|`` against the float32 reference, the producer's own and ours, ``*`` where beyond the
tolerance.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TENSORS = ("dq", "dk", "dv", "dsink")


def load(directory: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in directory.glob("*.json")),
                  key=lambda r: (r["producer"], r["config"]["head_dim"], r["config"]["head_dim_v"], r["case"]))


def _wrong(judged: dict | None) -> list[str]:
    return sorted(n for n, e in (judged or {}).items() if not e["error"] <= e["tolerance"])


def data(records: list[dict]) -> dict:
    out: dict = {}
    for r in records:
        if r["config"].get("dkv_alone"):
            continue
        entry = out.setdefault(r["producer"], {"wrong": {}, "cannot_run": [], "refused_by_us": []})
        if r.get("cannot_run"):
            entry["cannot_run"].append(r["case"])
            continue
        wrong = _wrong(r["measured"]["producer"])
        if wrong:
            entry["wrong"][r["case"]] = wrong
        if r.get("refused") and r["measured"]["ours"] is None:
            entry["refused_by_us"].append(r["case"])
    return out


def _cell(judged: dict | None, name: str) -> str:
    if judged is None or name not in judged:
        return ""
    e = judged[name]
    return f"{e['relative']:.3g}" + ("" if e["error"] <= e["tolerance"] else " *")


def table(records: list[dict]) -> str:
    lines = []
    for producer in dict.fromkeys(r["producer"] for r in records):
        lines += [f"### {producer}", "",
                  "| case | " + " | ".join(f"{t} theirs" for t in TENSORS) + " | " + " | ".join(
                      f"{t} ours" for t in TENSORS) + " |",
                  "|---|" + "---:|" * (2 * len(TENSORS))]
        for r in (r for r in records if r["producer"] == producer):
            if r.get("cannot_run"):
                lines.append(f"| {r['case']} | cannot run: {r['cannot_run'][:60]} |" + " |" * (2 * len(TENSORS) - 1))
                continue
            theirs, ours = r["measured"]["producer"], r["measured"]["ours"]
            cells = [_cell(theirs, t) for t in TENSORS]
            if ours is None:
                why = r.get("refused") or ""
                why = "packed dQ lost by the producer" if "no reading recovers dQ" in why else why[:60]
                cells += [f"refused: {why}"] + [""] * (len(TENSORS) - 1)
            else:
                cells += [_cell(ours, t) for t in TENSORS]
            lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--data", type=Path)
    parser.add_argument("--table", type=Path)
    args = parser.parse_args(argv)
    records = load(args.directory)
    if args.data:
        args.data.write_text(json.dumps(data(records), indent=1, sort_keys=True) + "\n")
    if args.table:
        args.table.write_text(table(records))
    print(f"{len(records)} records")


if __name__ == "__main__":
    main()
