"""The repository stands on its own and its README stays true: the two commands CI runs are the README's, every
install command works on its own, every python block runs (but those marked sketches; the README's and
docs/postprocess.md's, the postprocess reference), the preset table is what the code returns,
the performance summaries quote docs/performance.md, every relative link and anchor resolves, and nothing cites a
document outside the tree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
POSTPROCESS = (ROOT / "docs" / "postprocess.md").read_text()  # the postprocess's reference, for kernel authors


def _readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readme_commands_verbatim():
    """.ci/run runs the README's two commands as written, on the oldest supported pair (Python 3.11 and the jax
    pyproject names as the minimum, pinned) and on the newest (Python 3.12, the jax pip picks), then builds the
    manylinux wheel on the newest."""
    commands = _readme_commands()
    assert len(commands) == 2, commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert command in ci, f"{command!r} is not in .ci/run"
    assert ci[-3:] == ["check 3.11 .ci/oldest.txt", "check 3.12", "manylinux_wheel 3.12"], ci[-3:]  # newest only
    minimum = next(r for r in _pyproject()["project"]["dependencies"] if r.startswith("jax>="))[len("jax>="):]
    pins = (ROOT / ".ci" / "oldest.txt").read_text().split()
    assert f"jax=={minimum}.0" in pins and f"jaxlib=={minimum}.0" in pins, (minimum, pins)
    assert _pyproject()["project"]["requires-python"] == ">=3.11"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_install_command_brings_what_its_build_needs():
    """Each `pip install` the README shows runs in a fresh virtual environment: pip builds the handler with build
    isolation (pyproject's build requirements), or, with --no-build-isolation, the same command line installs them
    first (the GPU command once lacked them: `No module named 'scikit_build_core'`); every extra it names exists."""
    commands = re.findall(r"[^`\n]*pip install [^`\n]*", README)
    assert len(commands) >= 2, commands
    extras = set(_pyproject()["project"]["optional-dependencies"])
    build_requires = [re.match(r"[\w.-]+", r).group(0) for r in _pyproject()["build-system"]["requires"]]
    for line in commands:
        steps = [c.strip() for c in line.split("&&")]
        for k, step in enumerate(steps):
            if "pip install" not in step:
                continue
            for extra in re.findall(r"\.\[([\w,-]+)\]", step):
                assert set(extra.split(",")) <= extras, (extra, step)
            if "--no-build-isolation" in step:
                before = " ".join(steps[:k]) + " "
                for package in [*build_requires, "cmake", "ninja"]:
                    assert re.search(rf"[\"' ]{package}[>=<\"' ]", before), (package, line)
    install = _readme_commands()[0]
    assert '".[test]"' in install and install.endswith("python examples/quickstart.py"), install
    assert 'pip install ".[cuda13]"' in README  # the GPU command


def _python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(line, code, is_sketch) of every ```python block; a block right after `<!-- sketch -->` is a sketch."""
    blocks, lines = [], text.split("\n")
    for m in re.finditer(r"^([ \t]*)```python\n(.*?)^\1```$", text, re.M | re.S):
        line = text.count("\n", 0, m.start()) + 1
        before = next((lines[i].strip() for i in range(line - 2, -1, -1) if lines[i].strip()), "")
        blocks.append((line + 1, textwrap.dedent(m.group(2)), before == "<!-- sketch -->"))
    return blocks


@pytest.mark.parametrize("doc, least", [("README.md", 1), ("docs/postprocess.md", 4)])
def test_readme_python_blocks_run(tmp_path, doc, least):
    """Every python block not marked a sketch runs as written, in order, as one session a document on CPU (8 CPU
    devices, as for sharding); a failure's traceback names the document's line."""
    blocks = _python_blocks((ROOT / doc).read_text())
    runnable = [(line, code) for line, code, sketch in blocks if not sketch]
    # the quickstart; the postprocess's first call and three calls; hardly any code that does not run
    assert len(runnable) >= least and len(blocks) - len(runnable) <= 1, [(b[0], b[2]) for b in blocks]
    script = tmp_path / "readme_blocks.py"
    script.write_text(
        "ns = {'__name__': '__main__'}\n"
        f"for line, code in {runnable!r}:\n"
        f"    exec(compile('\\n' * (line - 1) + code, {str(ROOT / doc)!r}, 'exec'), ns)\n"
        f"    print('ran {doc} block at line', line, flush=True)\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.count(f"ran {doc} block") == len(runnable), out.stdout


def _preset_rows_of(text: str) -> list[list[str]]:
    """The rows of a preset table in ``text``: table rows whose first cell lists GPU architectures."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.strip().startswith("|")]
    return [row for row in rows if re.fullmatch(r"\d+(, \d+)*", row[0])]


def _preset_rows() -> list[list[str]]:
    """The rows of the preset table in ``AccumLayout.flash_attention``'s docstring, its one home."""
    from jax_dqpost import AccumLayout

    return _preset_rows_of(AccumLayout.flash_attention.__doc__)


def _preset_cell(cell: str):
    """A cell's layout (`(arch, tile_m, ...)`, the fields of AccumLayout in order), or ValueError."""
    from jax_dqpost import AccumLayout

    if "ValueError" in cell:
        return ValueError
    fields = re.fullmatch(r"`\((.*)\)`", cell).group(1)
    return eval(f"AccumLayout({fields})", {"AccumLayout": AccumLayout})


def _preset(arch, head_dim, causal, tensor):
    """The preset's order and padding (every field but ``varlen_unreadable``: test_preset_table_is_what_the_code_returns
    checks it), or ValueError."""
    import dataclasses

    from jax_dqpost import AccumLayout

    try:
        layout = AccumLayout.flash_attention(arch, head_dim, causal=causal, tensor=tensor, version="4.0.0b36")
    except ValueError:
        return ValueError
    return dataclasses.replace(layout, varlen_unreadable=None)


def _head_dims_named(text: str) -> list[int]:
    """``'8, 16 and 40'`` -> ``[8, 16, 40]``."""
    return [int(d) for d in re.split(r", | and ", text)]


def _b36_sm90_padding() -> tuple[list[int], dict, list[int]]:
    """What the docstring says of 4.0.0b36's sm90 padding: the head dims where it differs from the table's rows, the
    fields it changes there, and the head dims refused without ``causal``."""
    from jax_dqpost import AccumLayout

    doc = " ".join(AccumLayout.flash_attention.__doc__.split())
    m = re.search(r"At sm90 head dims ([\d, and]+?), where the two differ, .*?: the rows below with "
                  r"``hdim_multiple_of=(\d+), alloc_hdim_multiple_of=(\d+)``", doc)
    refused = re.search(r"At ([\d, and]+?) without ``causal`` its backward does not compile .*?: ValueError", doc)
    fields = dict(hdim_multiple_of=int(m.group(2)), alloc_hdim_multiple_of=int(m.group(3)))
    return _head_dims_named(m.group(1)), fields, _head_dims_named(refused.group(1))


def test_preset_table_is_what_the_code_returns():
    """Every row of the table holds AccumLayout.flash_attention's dQ and dK/dV layout for every head dim (multiples
    of 8) in its range, and the rows cover every architecture FlashAttention-4's backward runs on, its head dims
    8..256, causal or not, once; but where the docstring says 4.0.0b36's sm90 padding differs (the head dims where
    ceil(D / 16) * 16 and ceil(D / 32) * 32 do, up to 128): there the row with its fields (and dQ's packed
    accumulators refused), at those it names without causal ValueError."""
    import dataclasses

    from jax_dqpost import AccumLayout

    padded, fields, refused = _b36_sm90_padding()
    assert padded == [d for d in range(8, 129, 8) if -(-d // 16) * 16 != -(-d // 32) * 32], padded
    assert fields == dict(hdim_multiple_of=16, alloc_hdim_multiple_of=32) and refused == [104, 112]
    rows = _preset_rows()
    assert len(rows) >= 8, rows
    covered = []
    for archs, head_dims, causal, dq_cell, dkv_cell in rows:
        lo, hi = map(int, head_dims.split(".."))
        dq = _preset_cell(dq_cell)
        dkv = dq if dkv_cell == "the same" else _preset_cell(dkv_cell)
        for arch in map(int, archs.split(", ")):
            for flag in {"either": (False, True), "no": (False,), "yes": (True,)}[causal]:
                for head_dim in range(lo, hi + 1, 8):
                    covered.append((arch, head_dim, flag))
                    for tensor, want in (("dq", dq), ("dkv", dkv)):
                        where = (arch, head_dim, flag, tensor)
                        if arch == 90 and head_dim in refused and not flag:
                            want = ValueError
                        elif arch == 90 and head_dim in padded:
                            want = dataclasses.replace(want, **fields)
                        assert _preset(arch, head_dim, flag, tensor) == want, where
                        if want is not ValueError:
                            layout = AccumLayout.flash_attention(arch, head_dim, causal=flag, tensor=tensor,
                                                                 version="4.0.0b36")
                            unreadable = arch == 90 and head_dim in padded and tensor == "dq"
                            assert bool(layout.varlen_unreadable) == unreadable, where
    archs = (90, 100, 101, 103, 110, 120, 121)
    assert sorted(covered) == [(a, d, c) for a in archs for d in range(8, 257, 8) for c in (False, True)]


def test_readme_layout_section_is_what_the_code_takes():
    """docs/postprocess.md's "Which layout" table names the constructors, not the presets (their one home is the
    docstring above, rendered into docs/api.md, which the section names): its GPU list is FlashAttention-4's, and the
    sm90 head dims it names for ``causal`` are those where the two dQ presets differ."""
    from jax_dqpost.layout._presets import FLASH_ATTENTION_ARCHS

    section = POSTPROCESS.split("\n### Which layout\n", 1)[1].split("\n### ", 1)[0]
    assert not _preset_rows_of(section), "the preset table's home is AccumLayout.flash_attention's docstring"
    archs = re.search(r"on GPU `gpu` \(([\d, ]+)\)", section).group(1)
    assert tuple(map(int, archs.split(", "))) == FLASH_ATTENTION_ARCHS, archs
    lo, hi = map(int, re.search(r"on sm90 at head dims (\d+)\.\.(\d+) the\s+two dQ orders differ", section).groups())
    differ = [d for d in range(8, 257, 8) if _preset(90, d, False, "dq") != _preset(90, d, True, "dq")]
    assert differ == list(range(lo, hi + 1, 8)), differ
    assert "`help(AccumLayout.flash_attention)` (docs/api.md)" in section


def test_the_readme_has_no_relative_links():
    """The README is also the project's page on a package index (the wheel's and the sdist's description), where a
    relative link or image leads nowhere, and so does a link to a heading (an index gives headings no ids). With no
    URL of the repository in pyproject.toml to make them absolute, files of the source tree are named in text."""
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)", README)  # [text](target), ![alt](target)
    defined = re.findall(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)", README, re.M)  # [label]: target
    html = re.findall(r"(?:href|src)\s*=\s*[\"']([^\"']*)", README, re.I)
    assert len(inline) >= 1, inline  # fa4-jax's
    assert [t for t in inline + defined + html if not re.match(r"https?://", t)] == []


def _numbers(text: str) -> set[str]:
    """The words of text that hold a digit (numbers, ranges, dates, commits), without trailing punctuation."""
    return {w.rstrip(".") for w in re.findall(r"[\w.%-]+", text) if re.search(r"\d", w)}


@pytest.mark.parametrize("doc", ["README.md", "docs/postprocess.md"])
def test_readme_performance_summary_quotes_performance_md(doc):
    """The measurements' one home is docs/performance.md: every number of the README's performance summary (and
    docs/postprocess.md's: ranges, ratios, date, commit) appears there, so a new run that updates that page and not
    the summary fails here."""
    section = (ROOT / doc).read_text().split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    quoted, measured = _numbers(section), _numbers((ROOT / "docs" / "performance.md").read_text())
    assert len(quoted) >= 5, quoted
    assert quoted <= measured, f"not in docs/performance.md: {sorted(quoted - measured)}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    prose = re.sub(r"^([ \t]*)```.*?^\1```$", "", text, flags=re.M | re.S)  # no headings inside code blocks
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose, re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


DOCS = ["README.md", "CHANGELOG.md", "docs/postprocess.md", "docs/design.md", "docs/performance.md",
        "docs/gradients.md", "benchmarks/README.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_anchor_links_resolve(doc):
    """Every link to a heading, in the same document (`#...`) or another one (`file.md#...`), finds it."""
    text = (ROOT / doc).read_text()
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
        if "://" in target:
            continue
        linked = (ROOT / doc).parent.joinpath(target) if target else ROOT / doc
        assert anchor in _anchors(linked.read_text()), f"{doc} links to a missing heading {target}#{anchor}"


@pytest.mark.parametrize("module", ["jax_dqpost.precompile", "benchmarks", "benchmarks.fa4jax"])
def test_command_help_description_is_a_sentence(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    description = out.stdout.split("\n\n")[1]  # usage, description, options
    assert description.rstrip().endswith(".") and len(description) > 20, description


def _tracked(*patterns):
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.stdout.split() if (ROOT / p).exists()]  # (a copy's index may be stale)


def test_nothing_cites_what_is_not_in_the_tree():
    pattern = re.compile(r"SPEC\.md|\.\./shared|\.device/|GPU_RESULTS|results/20")
    suffixes = (".py", ".md", ".sh", ".cc", ".toml", ".txt")
    offenders = [str(p.relative_to(ROOT)) for p in _tracked() if p.suffix in suffixes
                 and p.name != "test_docs.py" and pattern.search(p.read_text(errors="ignore"))]
    assert offenders == []
    assert not _tracked("results"), "run logs are not kept in the tree"


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    text = (ROOT / doc).read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / doc).parent.joinpath(target).exists(), f"{doc} links to a missing {target}"


def test_api_reference_is_what_the_docstrings_give():
    """docs/api.md is generated from the docstrings (docs/make_api.py): every public name of jax_dqpost and
    jax_dqpost.fa4jax, and nothing else; it cannot drift from them."""
    import importlib.util

    import jax_dqpost
    from jax_dqpost import fa4jax

    spec = importlib.util.spec_from_file_location("make_api", ROOT / "docs" / "make_api.py")
    make_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_api)
    page = (ROOT / "docs" / "api.md").read_text()
    assert page == make_api.render(), "docs/api.md is stale: run python docs/make_api.py"
    documented = re.findall(r"^### `([\w.]+)`$", page, re.M)
    assert documented == [f"jax_dqpost.{n}" for n in jax_dqpost.__all__] + [
        f"jax_dqpost.fa4jax.{n}" for n in fa4jax.__all__], documented
    for name in ("dq_postprocess", "flash_attention_postprocess", "dq_accum_from_dq"):
        section = page.split(f"### `jax_dqpost.{name}`", 1)[1].split("\n### ", 1)[0]
        assert all(s in section for s in ("**Args**", "**Returns**", "**Raises**")), name


def test_the_gradients_table_says_what_the_data_says():
    """docs/gradients.md's table and tests/data/producer_gradients.json (which test_gradients.py checks on a GPU)
    give the same verdicts: the producer's wrong tensors starred, its cases that cannot run, ours refused where the
    data says, and no tensor of ours beyond the tolerance."""
    import json

    data = json.loads((ROOT / "tests" / "data" / "producer_gradients.json").read_text())
    tensors = ("dq", "dk", "dv", "dsink")
    sections = re.split(r"^### ", (ROOT / "docs" / "gradients.md").read_text(), flags=re.M)[1:]
    assert sorted(s.split("\n", 1)[0] for s in sections) == sorted(data), "one table per producer release"
    for section in sections:
        producer, body = section.split("\n", 1)
        want = data[producer]
        rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                                  for line in body.splitlines() if line.startswith("| hd"))}
        assert rows, producer
        for case, cells in rows.items():
            if case.endswith("-dkv-alone"):
                assert not any(c.endswith("*") for c in cells), (producer, case)
                continue
            if case in want["cannot_run"]:
                assert cells[0].startswith("cannot run"), (producer, case)
                continue
            theirs, ours = cells[:len(tensors)], cells[len(tensors):]
            starred = [t for t, c in zip(tensors, theirs) if c.endswith("*")]
            assert starred == sorted(want["wrong"].get(case, []), key=tensors.index), (producer, case, starred)
            assert ours[0].startswith("refused") == (case in want["refused_by_us"]), (producer, case)
            assert not any(c.endswith("*") for c in ours), (producer, case, ours)


def _api_section(name: str) -> str:
    page = (ROOT / "docs" / "api.md").read_text()
    return page.split(f"### `jax_dqpost.{name}`", 1)[1].split("\n### ", 1)[0]


def test_the_dtype_spellings_are_one_set():
    """The names of the output dtype that docs/api.md lists, that the error lists and that the prose of the README
    and docs/postprocess.md uses are the names the API takes, and no other string (numpy's 'half') is taken."""
    import jax.numpy as jnp
    import numpy as np

    from jax_dqpost.postprocess import arguments as _arguments

    accepted = set(_arguments.OUT_DTYPE_SPELLINGS)
    item = re.search(r"^- `dtype`: (.*)$", _api_section("dq_postprocess"), re.M).group(1)
    documented = set(re.findall(r'`"(\w+)"`', item))
    with pytest.raises(ValueError) as refused:
        _arguments.out_dtype("half")
    listed = set(re.findall(r"'(\w+)'", str(refused.value).split(", got")[0]))
    prose = re.sub(r"```.*?```", "", README + POSTPROCESS, flags=re.S)
    used = set(re.findall(r"\b(bf16|fp16|f16|bfloat16|float16|half)\b", prose))
    assert {"bf16", "fp16"} <= used, used
    assert documented == listed == accepted, (documented, listed, accepted)
    assert used <= accepted, used - accepted
    for name in accepted:
        assert _arguments.out_dtype(name) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)), name


def test_dq_accum_from_dq_says_first_that_it_is_the_transpose_and_scales():
    """Its first line says it is the op's transpose and that it multiplies by the scale too, so that
    postprocess(accum_from_dq(dq, s), s) is dq * s**2, which it is; with scale 1 it builds what a producer writes."""
    import jax.numpy as jnp
    import numpy as np

    from jax_dqpost import AccumLayout, dq_accum_from_dq, dq_postprocess

    first, summary = dq_accum_from_dq.__doc__.splitlines()[0], dq_accum_from_dq.__doc__.split("\n\n")[0]
    assert "transpose of :func:`dq_postprocess`" in first and "scales" in first, first
    assert "``dq_postprocess(dq_accum_from_dq(dq, s), s)``" in " ".join(summary.split()), summary
    assert "is ``dq * s**2``" in " ".join(summary.split()), summary
    layout = AccumLayout.flash_attention(90, 128, causal=False, tensor="dq", version="4.0.0b36")
    dq = jnp.asarray(np.random.default_rng(0).standard_normal((1, 100, 2, 128)), jnp.bfloat16)
    for s in (0.5, 0.125):  # powers of two: exactly dq * s**2
        back = dq_postprocess(dq_accum_from_dq(dq, s, layout=layout), s, seqlen_q=100, head_dim=128, layout=layout)
        assert np.array_equal(np.asarray(back, np.float32), np.asarray(dq, np.float32) * s * s), s


def test_the_readme_dsink_formula_says_what_an_infinite_lse_gives():
    """docs/postprocess.md's dsink formula says, as the docstring (docs/api.md) does, that the exponential is 1
    where lse = -inf."""
    import jax_dqpost

    formula = POSTPROCESS.split("`dsink[h] = ", 1)[1].split(", in the sink's dtype", 1)[0]
    assert "(the exponential is 1 where `lse = -inf`" in " ".join(formula.split()), formula
    assert "the exponential is 1 where ``lse = -inf``" in " ".join(
        jax_dqpost.flash_attention_postprocess.__doc__.split())
