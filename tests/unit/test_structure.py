"""The house rules, read from the source with `ast` (nothing is imported). They hold for every package of the project;
tests/data, frozen fixtures of old formats, is exempt.

- No file over MAX_LINES lines.
- No `sys.path` edits: the project is installed (`make setup`, editable) or on PYTHONPATH, never patched in.
- Floors: a package imports only itself and packages on lower floors (FLOORS), so every arrow points down; the data
  layer (tokendata) and the model know nothing of each other or of training; evaluation reads training's checkpoints
  only through the public `pretrain.checkpoints`.
- No import circle among the project's modules. The graph holds every import: module-level, function-local and
  type-only (`if TYPE_CHECKING:`), except the edges of ALLOWED_EDGES, each with its reason.
- In the library packages (LIBRARIES) a function-local import of a project module is one of LOCAL_IMPORTS, each
  with its reason; commands (tools/, benchmarks/) may import lazily, so that `--help` and usage errors stay quick,
  and those imports are still in the graph above.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
# floor of each package: imports go to the same package or a lower floor
FLOORS = {"model": 0, "tokendata": 0, "cli": 1, "pretrain": 2, "evaluation": 3, "tools": 4, "benchmarks": 5}
LIBRARIES = ("model", "tokendata", "cli", "pretrain", "evaluation")
# what a package may reach of a package below it, where it is not the whole package (prefixes of module names)
REACH = {("evaluation", "pretrain"): ("pretrain.checkpoints", "pretrain.downstream")}
# (importer, imported): why the edge is left out of the circle check
ALLOWED_EDGES = {
    ("model.synthesizers", "model.config"): "type annotations only (under TYPE_CHECKING): ModelConfig asks the "
                                            "registry (model/variants.py), which builds the synthesizers, for the "
                                            "mixer names; the synthesizers name ModelConfig in their signatures only",
}
# (importer, imported): why a library module imports a project module inside a function
LOCAL_IMPORTS: dict[tuple[str, str], str] = {
    ("pretrain.live", "pretrain.downstream"): "lm-eval is an optional extra (synthformer[eval]): the trainer imports it "
                                              "only when logging.eval_tasks asks for scores",
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    local: bool       # inside a function
    type_only: bool   # under `if TYPE_CHECKING:`


@cache
def source_files(root: Path = ROOT) -> dict[str, Path]:
    """{module name: file} of every package in FLOORS."""
    out = {}
    for package in FLOORS:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def resolve(module: str, path: Path, node: ast.ImportFrom | ast.Import, name: str, modules) -> str | None:
    """The project module that `import name` or `from … import name` names (a submodule where `from x import y`
    names one), or None for a module outside the project."""
    if isinstance(node, ast.Import):
        target = name
    else:
        base = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(max(0, node.level - 1)):
            base = base.rpartition(".")[0]
        target = ".".join(p for p in ((base if node.level else ""), node.module or "") if p)
        if f"{target}.{name}" in modules:
            return f"{target}.{name}"
    while target and target not in modules:   # `import a.b.c` of a module a.b: its nearest project module
        target = target.rpartition(".")[0]
    return target or None


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def edges_of(module: str, path: Path, modules) -> list[Edge]:
    out = []

    def visit(node, local, type_only):
        for child in ast.iter_child_nodes(node):
            inner_local = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for alias in child.names:
                    target = resolve(module, path, child, alias.name, modules)
                    if target and target != module:
                        out.append(Edge(module, target, child.lineno, local, type_only))
            elif isinstance(child, ast.If) and is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local, type_only)
            else:
                visit(child, inner_local, type_only)
    visit(ast.parse(path.read_text()), False, False)
    return out


@cache
def import_graph(root: Path = ROOT) -> list[Edge]:
    modules = source_files(root)
    return [e for m, p in modules.items() for e in edges_of(m, p, modules)]


def circles(edges: list[Edge]) -> list[list[str]]:
    """Every import circle (one path round each strongly connected group of modules), ALLOWED_EDGES left out."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if (e.source, e.target) not in ALLOWED_EDGES:
            graph.setdefault(e.source, set()).add(e.target)
    index, low, stack, on, groups = {}, {}, [], set(), []

    def connect(v):   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [path_round(sorted(group), graph) for group in groups]


def path_round(group: list[str], graph) -> list[str]:
    """A circle through the group's first module, by breadth-first search inside the group."""
    start, seen, queue = group[0], {group[0]: None}, [group[0]]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while seen[path[-1]] is not None:
                    path.append(seen[path[-1]])
                return path[::-1] + [start]
            if w in group and w not in seen:
                seen[w] = v
                queue.append(w)
    return group


def package(module: str) -> str:
    return module.split(".")[0]


# ---- the rules -----------------------------------------------------------------------------------------------------
def test_no_file_over_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in source_files().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by what they hold): {long}"


def test_no_sys_path_edits():
    edits = []
    for path in source_files().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                    and node.value.id == "sys":
                edits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not edits, f"sys.path edited (install the project or set PYTHONPATH instead): {edits}"


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_every_arrow_points_down():
    wrong = []
    for e in import_graph():
        a, b = package(e.source), package(e.target)
        if a == b:
            continue
        reach = REACH.get((a, b))
        if FLOORS[b] >= FLOORS[a] or (reach and not e.target.startswith(reach)):
            wrong.append(f"{e.source} -> {e.target} (line {e.line})")
    assert not wrong, f"imports that do not point down the floors {FLOORS} (or past {REACH}): {wrong}"


def test_function_local_imports_in_the_libraries_are_listed():
    unlisted = [f"{e.source} -> {e.target} (line {e.line})" for e in import_graph()
                if e.local and package(e.source) in LIBRARIES and (e.source, e.target) not in LOCAL_IMPORTS]
    assert not unlisted, f"function-local imports of project modules: import at the top, or list them with a " \
                         f"reason in LOCAL_IMPORTS: {unlisted}"


def test_the_allow_lists_name_real_edges():
    edges = {(e.source, e.target) for e in import_graph()}
    stale = [pair for pair in list(ALLOWED_EDGES) + list(LOCAL_IMPORTS) if pair not in edges]
    assert not stale, f"allowed imports that no longer exist: remove them from the lists: {stale}"


# ---- the checker itself, on a planted tree ---------------------------------------------------------------------------
@pytest.fixture
def planted(tmp_path):
    for package_name in FLOORS:
        (tmp_path / package_name).mkdir()
        (tmp_path / package_name / "__init__.py").write_text("")
    return tmp_path


def test_a_circle_through_a_function_local_import_is_found(planted):
    (planted / "pretrain" / "a.py").write_text("from pretrain import b\n")
    (planted / "pretrain" / "b.py").write_text("def f():\n    from pretrain.a import x\n    return x\n")
    assert circles(import_graph(planted)) == [["pretrain.a", "pretrain.b", "pretrain.a"]]
    assert [e.local for e in import_graph(planted) if e.source == "pretrain.b"] == [True]


def test_relative_imports_and_submodules_resolve(planted):
    (planted / "model" / "x.py").write_text("from . import y\nfrom .y import z\nif TYPE_CHECKING:\n    import model\n")
    (planted / "model" / "y.py").write_text("")
    got = {(e.target, e.type_only) for e in import_graph(planted) if e.source == "model.x"}
    assert got == {("model.y", False), ("model", True)}
