"""The package's structure: its modules import one way (docs/design.md draws the order), read no frame objects
(``sys._getframe``, a frame's locals), and reach jax's private modules only through ``_jax_internals.py``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jax_dqpost"


def _trees() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(PACKAGE.glob("*.py"))}


def test_the_modules_import_one_way():
    """No circle among the package's modules, counting imports inside functions too."""
    trees = _trees()
    edges = {m: set() for m in trees}
    for m, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                edges[m].update(n for n in names if n in trees and n != m)
    state: dict[str, int] = {}
    circles = []

    def visit(m, path):
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                circles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert circles == [], [" -> ".join(c) for c in circles]


def test_no_module_reads_stack_frames_or_jax_private_modules_but_one():
    """Frames and jax's private modules change without notice: no ``sys._getframe``/frame attributes anywhere (the
    ``traceback`` module's file names are public), and ``jax._src`` only in ``_jax_internals.py``, which says why each
    use has no public counterpart."""
    for name, tree in _trees().items():
        attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not attributes & {"_getframe", "f_back", "f_locals", "f_globals", "currentframe"}, name
        private = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   and any(m.startswith("jax._src") for m in ([n.module or ""] if isinstance(n, ast.ImportFrom)
                                                               else [a.name for a in n.names]))]
        assert not private or name == "_jax_internals", (name, [ast.unparse(n) for n in private])
