"""The package's structure: its modules and folders import one way (docs/design.md draws the layers), read no frame
objects (``sys._getframe``, a frame's locals), and reach jax's private modules only through ``_jax_internals.py``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jax_dqpost"

LAYERS = [
    {"_version", "_checks", "_jax_internals"},  # leaves
    {"layout"},  # the accumulator orders, and what the kernel takes of them
    {"_kernel"},  # the CUDA kernel and its compilation
    {"postprocess"},  # the JAX op and its front door
    {"_attention"},  # attention's machinery
    {"fa4jax"},
    {"attention"},
    {"precompile"},
    {"__init__"},
]
"""The layers, bottom first: a folder of the package, or a module of its root. A unit imports only from its own
layer and those below it."""


def _name(path: Path) -> str:
    """The dotted module name inside the package (a package is its ``__init__``)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _trees() -> dict[str, tuple[Path, ast.Module]]:
    return {_name(p): (p, ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(trees) -> dict[str, set[str]]:
    """Each module's imports of the package's modules (relative imports, inside functions too), a module that
    imports its own package not counted."""
    edges = {m: set() for m in trees}
    for m, (path, tree) in trees.items():
        package = m.split(".") if path.name == "__init__.py" and m != "__init__" else m.split(".")[:-1]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level >= 1):
                continue
            base = package[:len(package) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                found = ".".join(x for x in (target, alias.name) if x)
                found = found if found in trees else target
                while found and found not in trees:
                    found = found.rpartition(".")[0]
                found = found or "__init__"
                if found != m and not m.startswith(found + "."):
                    edges[m].add(found)
    return edges


def test_the_modules_import_one_way():
    """No circle among the package's modules, counting imports inside functions too."""
    edges = _imports(_trees())
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


def test_the_folders_import_one_way():
    """Every module is in one layer of :data:`LAYERS` (by its folder, or as a module of the package's root), and
    imports from its own layer and those below it only."""
    level = {unit: k for k, layer in enumerate(LAYERS) for unit in layer}
    unit = {m: m.split(".")[0] for m in _trees()}
    units = set(unit.values())
    assert units == set(level), (sorted(units - set(level)), sorted(set(level) - units))
    upward = sorted(f"{m} -> {n}" for m, targets in _imports(_trees()).items() for n in targets
                    if level[unit[n]] > level[unit[m]])
    assert upward == []


def test_no_module_reads_stack_frames_or_jax_private_modules_but_one():
    """Frames and jax's private modules change without notice: no ``sys._getframe``/frame attributes anywhere (the
    ``traceback`` module's file names are public), and ``jax._src`` only in ``_jax_internals.py``, which says why each
    use has no public counterpart."""
    for name, (_, tree) in _trees().items():
        attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not attributes & {"_getframe", "f_back", "f_locals", "f_globals", "currentframe"}, name
        private = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   and any(m.startswith("jax._src") for m in ([n.module or ""] if isinstance(n, ast.ImportFrom)
                                                               else [a.name for a in n.names]))]
        assert not private or name == "_jax_internals", (name, [ast.unparse(n) for n in private])
