"""The modules of meshtron/ import one another without a cycle.

Every module is parsed with `ast` (nothing is imported), and every import statement counts: at module level, inside
functions (the lazy "import it late" kind) and under `TYPE_CHECKING`. A cycle, even a lazy one, means two modules
each need the other to be understood, so a test names it rather than a reader finding it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "meshtron"



def module_name(path: Path) -> str:
    """The dotted name of the module at `path` (a package's `__init__.py` names the package)."""
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    """Every module under meshtron/, by dotted name."""
    return {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _absolute(name: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module that an `import from` statement of module `name` reads."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    # A package's own module is its __init__, so one dot stays in the package itself.
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The meshtron modules that module `name` imports, anywhere in its text."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(name, node, is_package)
            # `from package import submodule` reads the submodule; `from package import name` reads the package.
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # `import a.b.c` and `from a.b.c import d` need a.b.c itself; the packages above it only run their
            # __init__, which is not an arrow of this module's design.
            if target in modules and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module → the meshtron modules it imports."""
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One closed walk through `component`, to name in a failure (breadth-first from its first module)."""
    start = min(component)
    previous: dict[str, str] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & component):
            if child == start:
                walk = [node]
                while walk[-1] != start:
                    walk.append(previous[walk[-1]])
                return [*reversed(walk), start]
            if child not in previous:
                previous[child] = node
                queue.append(child)
    return sorted(component)


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    # Sanity checks on the reader itself, so that an empty graph cannot pass: the CLI loads the trainer lazily and
    # the package's __main__ imports the CLI.
    assert "meshtron.cli" in graph["meshtron.__main__"]
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300


def test_no_import_cycles_in_meshtron():
    graph = import_graph()
    cycles = strongly_connected(graph)
    named = ["  " + " -> ".join(a_cycle(graph, component)) for component in cycles]
    assert not cycles, "import cycles in meshtron/:\n" + "\n".join(named)

