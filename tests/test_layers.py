"""The layers of docs/architecture.md hold: no upward import, no engine import of flows/Prefect/Ray, no cycle.

Every ``.py`` under ``flows/`` and ``cje_engine/`` is parsed with `ast` (nothing is imported or run) and
every import statement becomes an edge of a module graph, wherever it stands: an import inside a function
(a lazy import) is a dependency all the same.  The checks:

(a) a module of a ``flows`` package imports only from its own package or a package *below* it in
    `FLOWS_LAYERS` (the order of the diagram in docs/architecture.md, which a test here compares);
(b) no module of ``cje_engine`` imports ``flows``, ``prefect`` or ``ray``;
(c) no import cycle between modules (strongly connected components of more than one module), except
    the ones listed in `ALLOWED_CYCLES` (none).  Imports under ``if TYPE_CHECKING:`` are
    left out of the cycle check only: they never run, so they cannot make an import cycle (they still
    count for (a) and (b));
(d) no module of ``flows`` imports a ``_private`` name of another module (a helper another module needs
    gets a public name); the engine's are capped at `ENGINE_PRIVATE_IMPORTS_MAX` (only ever lowered).

The graph checks are also run on small synthetic graphs, so that each check is seen to fail.
"""
from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("flows", "cje_engine")

#: The packages of ``flows``, top first; each imports only from those after it (and the engine).
#: ``flows`` itself (its ``__init__``) and modules directly under it not listed here are errors.
FLOWS_LAYERS = (
    "flows.cli",
    "flows.pipelines",
    "flows.reports",
    "flows.label_requests",
    "flows.runtime",
    "flows.config",
    "flows.integrations",
    "flows.storage",
    "flows.uris",
)
ENGINE = "cje_engine"
ENGINE_FORBIDDEN = ("flows", "prefect", "ray")

#: Imports of another module's ``_private`` names in ``cje_engine`` (438187c: 33; now 0).
ENGINE_PRIVATE_IMPORTS_MAX = 0

#: Import cycles tolerated, each a frozenset of module names: none (the storage factory `Storage.for_uri`
#: opens its backends through `flows.storage.objects.register_backend`, not by importing them).
ALLOWED_CYCLES: tuple[frozenset[str], ...] = ()


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int
    type_only: bool = False

    def where(self) -> str:
        """``path:line`` of the import statement."""
        return f"{self.path}:{self.line}"


def module_files(repo: Path = REPO) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``) for every ``.py`` under the roots."""
    mods: dict[str, tuple[Path, bool]] = {}
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join(parts)] = (path, is_pkg)
    return mods


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers of the statements inside ``if TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    for sub in ast.walk(stmt):
                        if hasattr(sub, "lineno"):
                            lines.add(sub.lineno)
    return lines


def _imported_names(module: str, is_pkg: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement loads (``from a import b`` gives ``a.b``; the caller
    reduces a name to the longest known module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module.split(".") if is_pkg else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{alias.name}" for alias in node.names]


def _known(name: str, mods: dict) -> str:
    """The longest prefix of ``name`` that is a module of the repository, else its top-level name."""
    probe = name
    while probe:
        if probe in mods:
            return probe
        probe = probe.rpartition(".")[0]
    return name.split(".")[0]


@functools.lru_cache(maxsize=None)
def _parsed(repo: Path = REPO) -> tuple[tuple[str, Path, bool, ast.Module], ...]:
    """(module, file, is a package ``__init__``, parsed tree) of every module under the roots, parsed once per
    test process: the checks below all read the same files, which do not change during a run (parsing
    every file for each of the five repository checks was ~80% of this file's CPU time)."""
    return tuple((module, path, is_pkg, ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
                 for module, (path, is_pkg) in module_files(repo).items())


@functools.lru_cache(maxsize=None)
def _import_edges(repo: Path) -> tuple[Edge, ...]:
    mods = module_files(repo)
    edges = []
    for module, path, is_pkg, tree in _parsed(repo):
        type_only = _type_checking_lines(tree)
        rel = str(path.relative_to(repo))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported_names(module, is_pkg, node):
                    target = _known(name, mods)
                    if target != module:
                        edges.append(Edge(module, target, rel, node.lineno, node.lineno in type_only))
    return tuple(edges)


def import_edges(repo: Path = REPO) -> list[Edge]:
    """Every import of every module under the roots, as edges to repository modules or to the
    top-level name of a third-party package (computed once per test process, a new list each call)."""
    return list(_import_edges(repo))


def private_imports(repo: Path = REPO) -> list[str]:
    """Messages for every ``from module import _name`` of another repository module's private name."""
    mods = module_files(repo)
    bad = []
    for module, path, is_pkg, tree in _parsed(repo):
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            for alias, name in zip(node.names, _imported_names(module, is_pkg, node)):
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                target = _known(name.rpartition(".")[0], mods)
                if private and target in mods and target != module and name not in mods:
                    bad.append(f"{path.relative_to(repo)}:{node.lineno}: {module} imports {alias.name} from {target}")
    return sorted(bad)


def layer_of(module: str, layers: tuple[str, ...] = FLOWS_LAYERS) -> int | None:
    """Index of the ``flows`` layer a module belongs to (0 = top), None outside ``flows``."""
    for i, layer in enumerate(layers):
        if module == layer or module.startswith(layer + "."):
            return i
    return None


def upward_imports(edges: list[Edge], layers: tuple[str, ...] = FLOWS_LAYERS) -> list[str]:
    """Messages for every import from a ``flows`` layer to a layer above it (or to an undeclared
    part of ``flows``)."""
    bad = []
    for e in edges:
        if not e.source.startswith("flows"):
            continue
        src, dst = layer_of(e.source, layers), layer_of(e.target, layers)
        if src is None:
            bad.append(f"{e.where()}: {e.source} is in no declared layer of flows (FLOWS_LAYERS)")
        elif e.target.startswith("flows") and dst is None:
            bad.append(f"{e.where()}: {e.source} imports {e.target}, in no declared layer of flows")
        elif dst is not None and dst < src:
            bad.append(f"{e.where()}: {e.source} ({layers[src]}) imports {e.target} ({layers[dst]}), "
                       f"a layer above it")
    return sorted(set(bad))


def engine_orchestration_imports(edges: list[Edge]) -> list[str]:
    """Messages for every import of flows, Prefect or Ray by the engine."""
    return sorted({f"{e.where()}: {e.source} imports {e.target} (the engine is statistics only)"
                   for e in edges
                   if (e.source == ENGINE or e.source.startswith(ENGINE + "."))
                   and e.target.split(".")[0] in ENGINE_FORBIDDEN})


def cycles(edges: list[Edge]) -> list[frozenset[str]]:
    """The import cycles: strongly connected components (Tarjan) of more than one module, leaving
    out imports that only run for type checkers."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        if not e.type_only:
            graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        # iterative Tarjan: a deep import chain must not hit the recursion limit
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe_cycle(comp: frozenset[str], edges: list[Edge]) -> str:
    """A cycle and the imports that make it, one per line."""
    inside = sorted({f"    {e.where()}: {e.source} -> {e.target}" for e in edges
                     if e.source in comp and e.target in comp and not e.type_only})
    return "cycle between " + ", ".join(sorted(comp)) + ":\n" + "\n".join(inside)


def _doc_layers() -> tuple[str, ...]:
    """The ``flows.*`` rows of the diagram in docs/architecture.md, top first."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("```", 2)[1]
    return tuple(m[1] for m in re.finditer(r"^\s*(flows\.\w+)\s", block, re.M))


# -- the repository --------------------------------------------------------------------------


def test_the_declared_order_is_the_order_of_docs_architecture():
    assert _doc_layers() == FLOWS_LAYERS, (
        f"docs/architecture.md lists {_doc_layers()}, tests/test_layers.py declares {FLOWS_LAYERS}")
    packages = {p.name for p in (REPO / "flows").iterdir()
                if (p / "__init__.py").exists() or (p.suffix == ".py" and p.stem != "__init__")}
    assert {f"flows.{p.removesuffix('.py')}" for p in packages} == set(FLOWS_LAYERS)


def test_flows_imports_only_run_down_the_layers():
    bad = upward_imports(import_edges())
    assert not bad, f"{len(bad)} upward import(s) in flows (order: {' > '.join(FLOWS_LAYERS)}):\n" + "\n".join(bad)


def test_the_engine_imports_no_flows_prefect_or_ray():
    bad = engine_orchestration_imports(import_edges())
    assert not bad, "\n".join(bad)


def test_no_import_cycle_in_flows_or_the_engine():
    edges = import_edges()
    found = cycles(edges)
    new = [c for c in found if c not in ALLOWED_CYCLES]
    assert not new, f"{len(new)} import cycle(s):\n" + "\n".join(describe_cycle(c, edges) for c in new)
    gone = [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert not gone, f"allowed cycle(s) no longer exist, remove them from ALLOWED_CYCLES: {gone}"


def test_flows_imports_no_private_name_of_another_module():
    found = private_imports()
    flows = [m for m in found if m.startswith("flows/")]
    assert not flows, (f"{len(flows)} import(s) of private names in flows (give the helper a public name):\n"
                       + "\n".join(flows))
    engine = [m for m in found if m.startswith("cje_engine/")]
    assert len(engine) <= ENGINE_PRIVATE_IMPORTS_MAX, "\n".join(engine)


def test_the_graph_sees_lazy_imports_and_relative_imports():
    edges = {(e.source, e.target) for e in import_edges()}
    # a module-level import, and imports inside functions (lazy) are both edges
    assert ("flows.pipelines.evaluate", "flows.storage.publish") in edges
    assert ("flows.cli.main", "flows.runtime.schedules") in edges
    assert len(edges) > 500
    relative = ast.parse("from ..storage import objects\nfrom . import pages").body
    assert _imported_names("flows.pipelines.evaluate", False, relative[0]) == ["flows.storage.objects"]
    assert _imported_names("flows.pipelines", True, relative[1]) == ["flows.pipelines.pages"]


# -- the checks on synthetic graphs (each must be able to fail) -------------------------------


def _edges(*pairs: tuple[str, str], type_only: bool = False) -> list[Edge]:
    return [Edge(a, b, "x.py", i + 1, type_only) for i, (a, b) in enumerate(pairs)]


def test_an_upward_import_is_reported_with_file_line_and_layers():
    bad = upward_imports(_edges(("flows.storage.publish", "flows.reports.history"),
                                ("flows.pipelines.pages", "flows.reports.history"),
                                ("flows.storage.publish", "cje_engine.result")))
    assert bad == ["x.py:1: flows.storage.publish (flows.storage) imports flows.reports.history "
                   "(flows.reports), a layer above it"]
    undeclared = upward_imports(_edges(("flows.newpkg.x", "flows.config")))
    assert undeclared[0].endswith("in no declared layer of flows (FLOWS_LAYERS)")


def test_an_engine_import_of_prefect_is_reported():
    bad = engine_orchestration_imports(_edges(("cje_engine.drift.monitor", "prefect"),
                                              ("cje_engine.data.io", "pandas")))
    assert bad == ["x.py:1: cje_engine.drift.monitor imports prefect (the engine is statistics only)"]


def test_a_cycle_is_found_but_not_one_of_type_only_imports():
    edges = _edges(("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"))
    assert cycles(edges) == [frozenset("abc")]
    assert "x.py:3: c -> a" in describe_cycle(frozenset("abc"), edges)
    assert cycles(_edges(("a", "b")) + _edges(("b", "a"), type_only=True)) == []


def test_the_old_storage_reports_config_tangle_fails_every_check():
    """The tangle of the code before the layers were restored (438187c), as edges."""
    old = _edges(("flows.config", "flows.storage.publish"), ("flows.storage.publish", "flows.reports.history"),
                 ("flows.reports.history", "flows.config"), ("flows.runtime.schedules", "flows.pipelines.audit"))
    assert len(upward_imports(old)) == 2
    assert cycles(old) == [frozenset({"flows.config", "flows.storage.publish", "flows.reports.history"})]
