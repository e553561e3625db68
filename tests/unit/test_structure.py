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
- Floors inside pretrain/ (PRETRAIN_FLOORS): each top-level module and subpackage of pretrain/ stands on a floor, and
  an import from one of them to another points to a lower floor; the arrows up are UP_ARROWS, each with its reason.
  Of the library packages, only the trainer (pretrain.train) imports the engine builder (pretrain.engine): the
  planner and the checks before a launch read the DeepSpeed config from pretrain.config.
- A file over MAX_LINES is one concern that says why in its docstring, and is listed in LONG_FILES with the reason.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
# files allowed past MAX_LINES: {path: why it is one concern that does not split}
LONG_FILES: dict[str, str] = {}
# floor of each package: imports go to the same package or a lower floor
FLOORS = {"model": 0, "tokendata": 0, "cli": 1, "pretrain": 2, "evaluation": 3, "tools": 4, "benchmarks": 5}
LIBRARIES = ("model", "tokendata", "cli", "pretrain", "evaluation")
# what a package may reach of a package below it, where it is not the whole package (prefixes of module names)
# evaluation reads pretrain's two public subpackages: what a run leaves (checkpoints) and how a model is scored and
# reported (observe: the downstream scorer that the trainer also runs on its live weights)
REACH = {("evaluation", "pretrain"): ("pretrain.checkpoints", "pretrain.observe")}
# Floors inside pretrain/, bottom up: a top-level module or subpackage imports only itself and lower floors.
#   0  what needs nothing of the run: timeouts, test fault hooks, pipeline stages of the model
#   1  the config (typed sections, the DeepSpeed dict)
#   2  what reads a config only: process groups, FP8, the planner, reporting
#   3  what runs on process groups: the data, the step guard, checkpoints, fleet health (its detector is pure
#      arithmetic; its gathering and its check before launch use the process groups)
#   4  what builds or watches a run: the engine, the supervision, the checks before a launch
#   5  the trainer
PRETRAIN_FLOORS = {
    "pretrain.timeouts": 0, "pretrain.faults": 0, "pretrain.pipeline": 0, "pretrain.node": 0,
    "pretrain.config": 1,
    "pretrain.distributed": 2, "pretrain.float8": 2, "pretrain.plan": 2, "pretrain.observe": 2,
    "pretrain.data": 3, "pretrain.step_guard": 3, "pretrain.checkpoints": 3, "pretrain.fleet": 3,
    "pretrain.engine": 4, "pretrain.supervision": 4, "pretrain.prelaunch": 4,
    "pretrain.train": 5,
}
# (importer, imported): an arrow up the floors of pretrain/, with its reason
UP_ARROWS = {
    ("pretrain.config.__main__", "pretrain.prelaunch"): "`python -m pretrain.config` is the checks before a launch "
                                                        "(launch/pretrain.sh, the README); the package hands over",
}
ENGINE_BUILDER, ENGINE_USERS = "pretrain.engine", ("pretrain.train",)
# (importer, imported): why the edge is left out of the circle check
ALLOWED_EDGES = {
    ("model.synthesizers", "model.config"): "type annotations only (under TYPE_CHECKING): ModelConfig asks the "
                                            "registry (model/variants.py), which builds the synthesizers, for the "
                                            "mixer names; the synthesizers name ModelConfig in their signatures only",
}
# (importer, imported): why a library module imports a project module inside a function
LOCAL_IMPORTS: dict[tuple[str, str], str] = {
    ("pretrain.observe.live_model", "pretrain.observe.downstream"): "lm-eval is an optional extra (synthformer[eval]): "
                                                                    "the trainer imports it only when "
                                                                    "logging.eval_tasks asks for scores",
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


def pretrain_unit(module: str) -> str | None:
    """The floor-holding unit of a pretrain module: its top-level module or subpackage (None: the package itself)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pretrain" and len(parts) > 1 else None


def pretrain_floor_errors(edges: list[Edge], modules) -> list[str]:
    """What breaks the floors of pretrain/: a unit on no floor, an arrow up (not in UP_ARROWS), the engine builder
    imported by a library module other than the trainer."""
    errors = [f"{unit} stands on no floor: add it to PRETRAIN_FLOORS"
              for unit in sorted({pretrain_unit(m) for m in modules} - {None} - set(PRETRAIN_FLOORS))]
    for e in edges:
        a, b = pretrain_unit(e.source), pretrain_unit(e.target)
        if a and b and a != b and a in PRETRAIN_FLOORS and b in PRETRAIN_FLOORS \
                and PRETRAIN_FLOORS[b] >= PRETRAIN_FLOORS[a] and (e.source, e.target) not in UP_ARROWS:
            errors.append(f"{e.source} (floor {PRETRAIN_FLOORS[a]}) -> {e.target} (floor {PRETRAIN_FLOORS[b]}), "
                          f"line {e.line}")
        if pretrain_unit(e.target) == ENGINE_BUILDER and package(e.source) in LIBRARIES \
                and e.source not in ENGINE_USERS and pretrain_unit(e.source) != ENGINE_BUILDER:
            errors.append(f"{e.source} imports the engine builder (line {e.line}): only {ENGINE_USERS} may; the "
                          f"DeepSpeed config is pretrain.config.deepspeed_dict's")
    return errors


# ---- the rules -----------------------------------------------------------------------------------------------------
def test_no_file_over_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in source_files().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES and str(p.relative_to(ROOT)) not in LONG_FILES}
    assert not long, f"files over {MAX_LINES} lines (split them by what they hold, or list one concern in " \
                     f"LONG_FILES with the reason): {long}"
    stale = [path for path in LONG_FILES if not (ROOT / path).exists()
             or len((ROOT / path).read_text().splitlines()) <= MAX_LINES]
    assert not stale, f"LONG_FILES entries that are gone or short now: remove them: {stale}"


def test_pretrain_stands_on_floors():
    floors = set(PRETRAIN_FLOORS.values())
    assert floors == set(range(len(floors))) and len(floors) <= 6, f"floors 0..5 at most: {sorted(floors)}"
    assert len(UP_ARROWS) <= 1, f"at most one arrow up inside pretrain/: {UP_ARROWS}"
    errors = pretrain_floor_errors(import_graph(), source_files())
    assert not errors, "imports inside pretrain/ that do not point down its floors:\n" + "\n".join(errors)


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
    stale = [pair for pair in list(ALLOWED_EDGES) + list(LOCAL_IMPORTS) + list(UP_ARROWS) if pair not in edges]
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


def test_an_upward_import_inside_pretrain_is_found(planted):
    """A planted arrow up (the timeouts, floor 0, importing the trainer) and a planner that imports the engine builder
    break the floors; the same tree without them does not."""
    (planted / "pretrain" / "timeouts.py").write_text("")
    (planted / "pretrain" / "train.py").write_text("from pretrain import engine, timeouts\n")
    (planted / "pretrain" / "engine.py").write_text("from pretrain import timeouts\n")
    (planted / "pretrain" / "plan").mkdir()
    (planted / "pretrain" / "plan" / "__init__.py").write_text("")
    (planted / "pretrain" / "plan" / "search.py").write_text("from pretrain.timeouts import x\n")
    modules = source_files(planted)
    assert pretrain_floor_errors(import_graph(planted), modules) == []
    (planted / "pretrain" / "timeouts.py").write_text("def f():\n    from pretrain.train import main\n")
    (planted / "pretrain" / "plan" / "search.py").write_text("from pretrain.engine import deepspeed_config\n")
    (planted / "pretrain" / "stray.py").write_text("")
    import_graph.cache_clear()
    source_files.cache_clear()
    errors = pretrain_floor_errors(import_graph(planted), source_files(planted))
    assert errors == ["pretrain.stray stands on no floor: add it to PRETRAIN_FLOORS",
                      "pretrain.plan.search (floor 2) -> pretrain.engine (floor 4), line 1",
                      "pretrain.plan.search imports the engine builder (line 1): only ('pretrain.train',) may; the "
                      "DeepSpeed config is pretrain.config.deepspeed_dict's",
                      "pretrain.timeouts (floor 0) -> pretrain.train (floor 5), line 2"], errors
