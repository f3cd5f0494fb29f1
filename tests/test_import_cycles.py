"""The project's module import graph, read statically with `ast`, has no cycle, and its layers
(docs/architecture.md, "Layers") import only downwards. Every import counts wherever it is written (a
function-level import runs the module too, only later), and importing `a.b.c` also imports the packages `a` and
`a.b` (their `__init__` runs first). A cycle fails here naming its modules in import order; an upward import
names both modules and their layers."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("qdeploy_base", "isa", "calib", "simulator", "qdeploy", "hw")

# The layers, lowest first, each a set of module prefixes (a module belongs to the layer of its longest matching
# prefix): a module imports modules of its own layer and the layers below it only. `qdeploy` alone is the
# package's __init__, which imports nothing (its API functions load lazily, PEP 562), so the container
# qdeploy.program can live in the qdeploy package and still sit below the simulator.
LAYERS = [
    ("floor", ("qdeploy_base",)),
    ("hardware contract", ("isa",)),
    ("calibration statistics", ("calib",)),
    ("program container", ("qdeploy", "qdeploy.program")),
    ("simulator", ("simulator",)),
    ("compiler and tools", ("qdeploy.",)),
    ("reference RTL runner", ("hw",)),
    ("command line", ("qdeploy.cli", "qdeploy.__main__")),  # the edge: may drive every layer, `rtl run` included
]


def module_files(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under the project's packages (a package's
    `__init__.py` is the package's own name; a folder without one is a namespace package)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` written in `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules that running `module` imports, at any nesting level. An imported name's parent
    packages count too, except the packages `module` itself lives in (already initialised before it runs)."""
    is_package = path.name == "__init__.py"
    own_ancestors = set(_prefixes(module))
    imported = set()

    def add(explicit: str) -> None:
        for prefix in _prefixes(explicit):
            if prefix in known and (prefix == explicit or prefix not in own_ancestors):
                imported.add(prefix)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in known else source)
    imported.discard(module)
    return imported


def import_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = module_files(root, packages)
    known = set(files)
    return {module: imports_of(module, path, known) for module, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each as the modules in
    import order from the alphabetically first, closed by repeating it."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(start: str) -> None:
        # Iterative Tarjan: the graph has some 150 modules, but recursion depth should not depend on it.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(set(component))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return [_cycle_through(graph, component) for component in sorted(components, key=min)]


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest cycle from the component's first module back to itself (breadth-first, inside the
    component)."""
    start = min(component)
    parent = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & component):
                if successor == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if successor not in parent:
                    parent[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle through {start} in its own component")


def describe(cycle: list[str]) -> str:
    return " -> ".join(cycle)


def test_the_project_has_no_import_cycle():
    assert [describe(c) for c in cycles(import_graph())] == []


def layer_of(module: str) -> tuple[int, str]:
    """(rank, name) of the layer whose longest prefix matches `module` ("qdeploy." matches every submodule of
    qdeploy; a prefix without a trailing dot matches that module and its submodules)."""
    best = None
    for rank, (name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module.startswith(prefix) if prefix.endswith(".") else (
                module == prefix or module.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank, name)
    if best is None:
        raise AssertionError(f"module {module} is in no layer of LAYERS")
    return best[1], best[2]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module in sorted(graph):
        rank, name = layer_of(module)
        for imported in sorted(graph[module]):
            imported_rank, imported_name = layer_of(imported)
            if imported_rank > rank:
                found.append(f"{module} ({name}) imports {imported} ({imported_name})")
    return found


def test_lower_layers_never_import_upper_ones():
    assert upward_imports(import_graph()) == []


def test_an_upward_import_is_named():
    graph = {"calib.table": {"qdeploy_base.errors", "qdeploy.api"}, "qdeploy_base.errors": set(),
             "qdeploy.api": set(), "simulator.machine": {"qdeploy", "qdeploy.program", "isa.kinds"},
             "qdeploy": set(), "qdeploy.program": set(), "isa.kinds": set()}
    assert upward_imports(graph) == ["calib.table (calibration statistics) imports qdeploy.api (compiler and tools)"]


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_a_function_level_import_cycle_is_named(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import f\n",
                      "pkg/b.py": "def f():\n    from pkg import a\n    return a\n",
                      "pkg/c.py": "import pkg.a\n"})
    assert [describe(c) for c in cycles(import_graph(tmp_path, ("pkg",)))] == ["pkg.a -> pkg.b -> pkg.a"]


def test_a_cycle_through_a_package_init_is_named(tmp_path):
    """`import pkg.sub.leaf` runs pkg/sub/__init__.py first; when that imports back, it is a cycle."""
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/sub/__init__.py": "from pkg.top import VALUE\n",
                      "pkg/sub/leaf.py": "VALUE = 1\n", "pkg/top.py": "import pkg.sub.leaf\nVALUE = 2\n"})
    assert [describe(c) for c in cycles(import_graph(tmp_path, ("pkg",)))] == ["pkg.sub -> pkg.top -> pkg.sub"]


def test_relative_imports_and_own_packages(tmp_path):
    """A relative import resolves against the module's package; a module's own package (initialised before
    it) is not an edge unless it imports a name from it."""
    _write(tmp_path, {"pkg/__init__.py": "from pkg.sub.x import X\n", "pkg/sub/__init__.py": "",
                      "pkg/sub/x.py": "from .y import Y\nimport pkg.sub.y\nX = Y\n", "pkg/sub/y.py": "Y = 1\n"})
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.sub.x"] == {"pkg.sub.y"}
    assert graph["pkg"] == {"pkg.sub", "pkg.sub.x"}
    assert cycles(graph) == []
