"""The repository stands on its own: the library depends on torch alone, and the docs refer only to files that exist
in the repository (no design, style or case files kept elsewhere)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "shardfusion"
# Modules of the package that are not the library: the training job, and the export (needs safetensors).
NOT_LIBRARY = ("train/", "checkpoint/export.py", "export.py")
EXTRAS = {"numpy", "tqdm", "matplotlib", "safetensors", "transformers", "tokenizers", "pytorch_lightning",
          "lightning_fabric", "lightning", "lightning_utilities"}
# Optional subpackages of the library, each needing its extra (imported by `import shardfusion.<name>` only, never
# by `import shardfusion`): {folder: extras its modules may import at module level}.
OPTIONAL_PACKAGES = {"lightning/": {"pytorch_lightning", "lightning_fabric", "lightning_utilities"}}
# Library modules that may import an extra inside a function (an optional feature that raises ImportError naming the
# package when called), never at module level: {module: extras}.
LAZY_EXTRAS = {"checkpoint/streaming.py": {"safetensors"},
               "checkpoint/export_tokenizer.py": {"tokenizers", "transformers"}}
# Files that were kept outside the repository once; nothing may cite them (the names are split so that this file
# does not cite them either).
OUTSIDE = ["DESIGN" + ".md", "STYLE" + ".md", "CASES" + ".md", "shared" + "/cases", "../" + "shared"]
TEXT = ("*.py", "*.md", "*.toml", "Makefile", "run")


def _library_modules() -> list[Path]:
    return [p for p in LIBRARY.rglob("*.py")
            if not str(p.relative_to(LIBRARY)).startswith(NOT_LIBRARY)]


def _names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return {node.module}
    return set()


def _imports(path: Path, in_functions: bool = True) -> set[str]:
    """The modules ``path`` imports; without ``in_functions`` only those imported outside function bodies."""
    tree = ast.parse(path.read_text())
    inner = set()
    if not in_functions:
        inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
    return {name for node in ast.walk(tree) if id(node) not in inner for name in _names(node)}


def test_library_imports_torch_alone() -> None:
    for path in _library_modules():
        lazy = LAZY_EXTRAS.get(str(path.relative_to(LIBRARY)), set())
        optional = set().union(*(v for k, v in OPTIONAL_PACKAGES.items()
                                 if str(path.relative_to(LIBRARY)).startswith(k)))
        for name in _imports(path):
            if name.split(".")[0] in lazy | optional:
                continue  # lazy: checked below, inside a function only; optional: the subpackage's own extra
            assert name.split(".")[0] not in EXTRAS, f"{path.relative_to(REPO)} imports {name}"
            assert not name.startswith("shardfusion.train"), f"{path.relative_to(REPO)} imports the job ({name})"
        for name in _imports(path, in_functions=False):
            assert name.split(".")[0] not in lazy, f"{path.relative_to(REPO)} imports {name} at module level"


def _module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root`` (a package as its ``__init__.py``)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_graph(root: Path, annotations: bool = False) -> dict[str, dict[str, int]]:
    """The package's import graph: module -> {module of the package it imports: line of the first such import}.

    Imports at module level and inside functions count alike; those under ``if TYPE_CHECKING:`` only with
    ``annotations``. ``from a import b`` is an edge to ``a.b`` where that is a module, else to ``a``; relative imports
    are resolved. The parent packages that Python initializes on the way (``a`` for ``import a.b``) are not edges.
    """
    modules = _module_names(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}

        def add(target: str, line: int) -> None:
            if target in modules and target != name:
                edges.setdefault(target, line)

        def visit(node: ast.AST) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child.test) and not annotations:
                    for stmt in child.orelse:
                        visit_node(stmt)
                    continue
                visit_node(child)

        def visit_node(node: ast.AST) -> None:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base, node.lineno)
            visit(node)

        visit(ast.parse(path.read_text()))
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, dict[str, int]]) -> list[str]:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or ``[]`` when it has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def search(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = search(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return []

    for start in sorted(graph):
        if start not in state:
            found = search(start)
            if found:
                return found
    return []


def _describe_cycle(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return "import cycle: " + "; ".join(steps)


def _components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (each sorted, the list sorted):
    Tarjan's algorithm. Every import cycle lies inside one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(node: str) -> None:  # recursive: the package's import depth is small
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                components.append(sorted(component))

    for start in sorted(graph):
        if start not in index:
            connect(start)
    return sorted(components)


def _shortest_cycle(graph: dict[str, dict[str, int]], members: set[str], start: str) -> list[str]:
    """The shortest cycle ``[start, ..., start]`` inside ``members`` (a strongly connected component holding
    ``start``): a breadth-first search from ``start`` back to it."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while start not in came_from:
        reached = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt in members and nxt not in came_from:
                    came_from[nxt] = node
                    reached.append(nxt)
        frontier = reached
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    return path[::-1]


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import cycles of ``graph``, each as ``[a, b, ..., a]``: for every module of every strongly connected
    component, the shortest cycle through it, each cycle once (whatever module it starts from). ``[]`` when the graph
    has none."""
    cycles: list[list[str]] = []
    seen: set[frozenset[tuple[str, str]]] = set()
    for component in _components(graph):
        for start in component:
            cycle = _shortest_cycle(graph, set(component), start)
            edges = frozenset(zip(cycle, cycle[1:]))
            if edges not in seen:
                seen.add(edges)
                cycles.append(cycle)
    return cycles


def test_no_module_outside_the_job_imports_the_job() -> None:
    # Every module of shardfusion/ outside shardfusion/train/ (the export and its command line included), imports
    # under `if TYPE_CHECKING:` and inside functions included: the job fills what the library needs (issue 34).
    graph = _import_graph(LIBRARY, annotations=True)
    found = [f"{module} (line {line}) imports {target}" for module, edges in sorted(graph.items())
             if not module.startswith("shardfusion.train") for target, line in sorted(edges.items())
             if target == "shardfusion.train" or target.startswith("shardfusion.train.")]
    assert not found, found


def test_package_has_no_import_cycle_even_through_annotations() -> None:
    # Every module of shardfusion/, the job included, imports under `if TYPE_CHECKING:` and inside functions included
    # (issue 34: "no import circle anywhere in shardfusion/"); each cycle is reported as a path of modules.
    graph = _import_graph(LIBRARY, annotations=True)
    assert "shardfusion.train.config" in graph and graph["shardfusion.train.job"], graph
    cycles = _cycles(graph)
    assert not cycles, "\n".join(_describe_cycle(graph, cycle) for cycle in cycles)


def test_library_has_no_import_cycle() -> None:
    # Every module of shardfusion/, imports in functions included (a lazy import does not hide a cycle).
    graph = _import_graph(LIBRARY)
    assert "shardfusion._runtime.flat_buffer" in graph and graph["shardfusion._runtime.unit"], graph
    cycle = _cycle(graph)
    assert not cycle, _describe_cycle(graph, cycle)


def test_runtime_has_no_import_cycle_even_through_annotations() -> None:
    # shardfusion/_runtime/ is layered: not even an `if TYPE_CHECKING:` import goes back up (issue 22, item 8).
    graph = {m: {t: line for t, line in edges.items() if t.startswith("shardfusion._runtime.")}
             for m, edges in _import_graph(LIBRARY, annotations=True).items() if m.startswith("shardfusion._runtime.")}
    cycle = _cycle(graph)
    assert not cycle, _describe_cycle(graph, cycle)


def test_the_cycle_check_finds_cycles(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub import low\n")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text("from .sub import low\n")
    (package / "sub" / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    assert _cycle(_import_graph(package)) == []
    graph = _import_graph(package, annotations=True)
    assert graph["pkg.b"] == {"pkg.sub.low": 1} and graph["pkg.sub.low"] == {"pkg.a": 3}
    assert _cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.low", "pkg.a"], _describe_cycle(graph, _cycle(graph))
    assert _cycles(_import_graph(package)) == []
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.low", "pkg.a"]]
    (package / "c.py").write_text("from pkg import d\n")  # a second, separate cycle; and a module in none
    (package / "d.py").write_text("import pkg.c\nimport pkg.a\n")
    (package / "e.py").write_text("from pkg import c\n")
    assert _cycles(_import_graph(package, annotations=True)) == [["pkg.a", "pkg.b", "pkg.sub.low", "pkg.a"],
                                                                 ["pkg.c", "pkg.d", "pkg.c"]]


def test_import_shardfusion_loads_no_job_module() -> None:
    # torch itself may import numpy or tqdm when they are installed; the lazily imported extras must stay unloaded
    lazy = sorted(set().union(*LAZY_EXTRAS.values(), *OPTIONAL_PACKAGES.values()))
    code = ("import sys, shardfusion, shardfusion.checkpoint; "
            f"print([m for m in sys.modules if m.startswith(('shardfusion.train', 'transformers')) "
            f"or m.split('.')[0] in {lazy!r}])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_job_loads_transformers_only_for_hf_models() -> None:
    # transformers is an optional extra: the job's modules (and the GPT path) import it only when an HF model is built
    code = ("import sys, shardfusion.train.job, shardfusion.train.job_model, shardfusion.train.hf_models; "
            "from shardfusion.train.config import parse_args; parse_args(['--hf-model', 'llama']); "
            "print([m for m in sys.modules if m.startswith('transformers')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _repo_text_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    files = [REPO / f for f in tracked] if tracked else [p for pat in TEXT for p in REPO.rglob(pat)]
    return [p for p in files if p.is_file() and ".venv" not in p.parts
            and (p.suffix in (".py", ".md", ".toml") or p.name in ("Makefile", "run"))]


def test_nothing_cites_files_outside_the_repository() -> None:
    found = [f"{p.relative_to(REPO)}: {word}" for p in _repo_text_files() for word in OUTSIDE
             if word in p.read_text(errors="replace")]
    assert not found, found


@pytest.mark.parametrize("page", ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))])
def test_docs_refer_to_files_and_tests_that_exist(page: str) -> None:
    text = (REPO / page).read_text()
    for path, _, test in re.findall(r"((?:shardfusion|tests|benchmarks|docs)/[\w/.-]+\.(?:py|md))(::(\w+))?", text):
        assert (REPO / path).exists(), f"{page} refers to {path}, which does not exist"
        if test:
            assert re.search(rf"def {test}\b", (REPO / path).read_text()), f"{page}: {path} has no test {test}"
    for link in re.findall(r"\]\(([\w./-]+\.md)\)", text):
        assert (REPO / page).parent.joinpath(link).exists(), f"{page} links to {link}, which does not exist"


def test_readme_is_short() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_test_files_have_distinct_basenames() -> None:
    """pytest imports test modules by basename (no packages under tests/): two files of one name in different
    folders stop the whole suite's collection."""
    seen: dict[str, Path] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a basename"
        seen[path.name] = path
