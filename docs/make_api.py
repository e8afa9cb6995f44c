"""Writes docs/api.md, the reference of every public name, from the docstrings (the reference's one home):

    python docs/make_api.py            # rewrite docs/api.md
    python docs/make_api.py --check    # exit 1, saying so, if docs/api.md is not what the docstrings give

The names are ``jax_dqpost.__all__`` and ``jax_dqpost.fa4jax.__all__`` (which needs no fa4-jax to be documented);
for a class, its public methods and properties in the order of its source. ``tests/test_docs.py`` checks that the
page is current. Signatures show no annotations (the docstrings say the types).
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

import numpy as np

PAGE = Path(__file__).with_name("api.md")
_SECTION = re.compile(r"^(Args|Attributes|Returns|Raises):\s*$")
_ITEM = re.compile(r"^([\w*][\w*, ]*?): (.*)$")


def _default(value) -> str:
    """A default as the API's users write it: ``jnp.bfloat16`` for a dtype, the repr otherwise."""
    if isinstance(value, type) and hasattr(value, "dtype"):
        return f"jnp.{np.dtype(value).name}"
    return repr(value)


def signature(obj, name: str) -> str:
    """``name(params)``, without annotations and without ``self``/``cls``."""
    sig = inspect.signature(obj)
    params = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        params.append(p.replace(annotation=p.empty,
                                default=p.default if p.default is p.empty else _Shown(_default(p.default))))
    return f"{name}{sig.replace(parameters=params, return_annotation=sig.empty)}"


class _Shown:
    """A default shown as given text."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def markdown(doc: str) -> str:
    """A docstring (Google-style sections, reST literal blocks and double backticks) as Markdown."""
    lines, out, k = inspect.cleandoc(doc).splitlines(), [], 0
    while k < len(lines):
        line = lines[k]
        if _SECTION.match(line):
            out += ["", f"**{line.strip().rstrip(':')}**", ""]
            k += 1
            while k < len(lines) and (not lines[k].strip() or lines[k].startswith(" ")):
                text = lines[k].strip()
                item = _ITEM.match(text) if len(lines[k]) - len(lines[k].lstrip()) <= 2 else None
                if item:
                    out.append(f"- `{item.group(1)}`: {item.group(2)}")
                elif text and out and out[-1].startswith("- "):
                    out[-1] += " " + text
                elif text:
                    out.append(text)
                k += 1
            out.append("")
            continue
        if line.rstrip().endswith("::"):
            out.append(line.rstrip()[:-1] if line.strip() != "::" else "")
            k += 1
            block = []
            while k < len(lines) and (not lines[k].strip() or lines[k].startswith(" ")):
                block.append(lines[k])
                k += 1
            while block and not block[-1].strip():
                block.pop()
            body = inspect.cleandoc("\n".join(block))
            fence = "" if body.lstrip().startswith("|") else "text"
            out += ["", body, ""] if not fence else ["", f"```{fence}", body, "```", ""]
            continue
        out.append(line)
        k += 1
    text = re.sub(r":(?:func|class|meth|data|mod|attr):`~?([^`]+)`", r"`\1`", "\n".join(out))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _constant(module, name: str) -> tuple[str, str]:
    """``(source, docstring)`` of a module-level constant: the expression assigned to it and the string literal
    right after the assignment, in the module that defines it (its source, not its repr, which jax may change)."""
    source = inspect.getsource(module)
    tree = ast.parse(source)
    for a, b in zip(tree.body, tree.body[1:]):
        targets = a.targets if isinstance(a, ast.Assign) else [a.target] if isinstance(a, ast.AnnAssign) else []
        if any(getattr(t, "id", None) == name for t in targets) and isinstance(b, ast.Expr) \
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
            return ast.get_source_segment(source, a.value), b.value.value
    raise ValueError(f"{module.__name__}.{name} has no docstring")


def _members(cls):
    """The public methods and properties of ``cls`` defined in its own body, in source order."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (classmethod, staticmethod)):
            yield name, getattr(cls, name), "method"
        elif isinstance(value, property):
            yield name, value, "property"
        elif inspect.isfunction(value):
            yield name, value, "method"


def _entry(module, qualified: str, name: str) -> list[str]:
    obj = getattr(module, name)
    if inspect.isclass(obj):
        parts = [f"### `{qualified}`", "", "```python", signature(obj, qualified), "```", "", markdown(obj.__doc__)]
        for member, value, kind in _members(obj):
            title = f"{qualified}.{member}"
            shown = title if kind == "property" else signature(value, title)
            parts += ["", f"#### `{title}`", "", "```python", shown + ("  # property" if kind == "property" else ""),
                      "```", "", markdown(value.__doc__ or "")]
        return parts
    if callable(obj):
        return [f"### `{qualified}`", "", "```python", signature(obj, qualified), "```", "", markdown(obj.__doc__)]
    package = module.__name__.split(".")[0]
    for candidate in (module, *[sys.modules[m] for m in sorted(sys.modules) if m.startswith(package + ".")]):
        try:
            expression, doc = _constant(candidate, name)
            break
        except (ValueError, OSError, TypeError):
            continue
    else:
        raise ValueError(f"{qualified} has no docstring")
    return [f"### `{qualified}`", "", "```python", f"{qualified} = {expression}", "```", "", markdown(doc)]


def render() -> str:
    import jax_dqpost
    from jax_dqpost import fa4jax

    parts = ["# API reference", "",
             "Generated from the docstrings by `python docs/make_api.py`; `tests/test_docs.py` checks that it is "
             "current. The README says which call to start with.", ""]
    for module, prefix, title in ((jax_dqpost, "jax_dqpost", "`jax_dqpost`"),
                                  (fa4jax, "jax_dqpost.fa4jax", "`jax_dqpost.fa4jax`")):
        parts += [f"## {title}", "", markdown(module.__doc__), ""]
        for name in module.__all__:
            parts += _entry(module, f"{prefix}.{name}", name) + [""]
    return "\n".join(parts).rstrip() + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's jax_dqpost, not an installed one
    text = render()
    if argv == ["--check"]:
        if PAGE.read_text() != text:
            print(f"{PAGE} is not what the docstrings give: run python docs/make_api.py", file=sys.stderr)
            return 1
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
