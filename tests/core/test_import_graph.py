"""The package's import graph has no cycle (module-level and function-level imports alike)."""
import ast
import pathlib

import megatron_mm_balance

ROOT = pathlib.Path(megatron_mm_balance.__file__).parent
PKG = "megatron_mm_balance"


def _modules() -> dict:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join([PKG] + parts)] = (path, is_pkg)
    return mods


def import_graph() -> dict:
    """``{module: {package modules it imports}}``, from every import statement in it."""
    mods = _modules()
    graph = {}
    for name, (path, is_pkg) in mods.items():
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            # A module's own parent packages are initialised before it in any case
            # (``from . import sibling``): not an edge of a cycle.
            deps.update(t for t in targets if t in mods and not name.startswith(t + ".") and t != name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict):
    """One cycle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_walker_sees_the_package_and_finds_a_planted_cycle():
    g = import_graph()
    assert "megatron_mm_balance.megatron.iterator" in g
    assert "megatron_mm_balance.placement" in g["megatron_mm_balance.runtime.engine"]
    assert "megatron_mm_balance.runtime" not in g["megatron_mm_balance.runtime.engine"]
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(planted) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
