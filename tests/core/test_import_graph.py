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
    assert "megatron_mm_balance.solver.placement" in g["megatron_mm_balance.runtime.engine"]
    assert "megatron_mm_balance.runtime" not in g["megatron_mm_balance.runtime.engine"]
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(planted) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


#: The package's layers, bottom up: a module may import only from its own layer or a lower one.
#: (``patching``: our hooks as data, the import-time overlay and the same-code digest; the glue's.)
LAYERS = {"data": 0, "solver": 0, "cost": 0, "runtime": 1, "sim": 2, "bench": 2, "patching": 2, "timeline": 3,
          "megatron": 3, "bridge": 4,
          "testing": 4, "cli": 5, "reference": 5, "__init__": 5}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_belongs_to_a_layer():
    unknown = sorted({_layer(m) for m in import_graph()} - set(LAYERS))
    assert not unknown, f"modules outside the known layers: {unknown} (add them to LAYERS)"


def test_layers_import_only_downward():
    upward = sorted((a, d) for a, deps in import_graph().items() for d in deps
                    if LAYERS[_layer(d)] > LAYERS[_layer(a)])
    assert not upward, "imports from a higher layer: " + ", ".join(f"{a} -> {d}" for a, d in upward)


def test_pure_layers_and_runtime_import_no_megatron():
    """The solver, data and cost layers import neither torch.distributed nor Megatron-LM; the
    runtime imports torch.distributed but nothing of Megatron-LM (megatron.core,
    megatron.training; our glue is a higher layer, checked above). megatron-energon, a data
    loading library, is allowed in the data layer."""
    offenders = []
    for name, (path, _) in _modules().items():
        layer = _layer(name)
        if LAYERS.get(layer) not in (0, 1):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for mod in mods:
                megatron_lm = mod.split(".")[0] == "megatron" and not mod.startswith("megatron.energon")
                if megatron_lm or (layer != "runtime" and mod.startswith("torch.distributed")):
                    offenders.append(f"{name} imports {mod}")
    assert not offenders, "; ".join(offenders)
