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
EXTRAS = {"numpy", "tqdm", "matplotlib", "safetensors", "transformers"}
# Library modules that may import an extra inside a function (an optional feature that raises ImportError naming the
# package when called), never at module level: {module: extras}.
LAZY_EXTRAS = {"checkpoint/streaming.py": {"safetensors"}}
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
        for name in _imports(path):
            if name.split(".")[0] in lazy:
                continue  # checked below: inside a function only
            assert name.split(".")[0] not in EXTRAS, f"{path.relative_to(REPO)} imports {name}"
            assert not name.startswith("shardfusion.train"), f"{path.relative_to(REPO)} imports the job ({name})"
        for name in _imports(path, in_functions=False):
            assert name.split(".")[0] not in lazy, f"{path.relative_to(REPO)} imports {name} at module level"


def test_import_shardfusion_loads_no_job_module() -> None:
    # torch itself may import numpy or tqdm when they are installed; the lazily imported extras must stay unloaded
    lazy = sorted(set().union(*LAZY_EXTRAS.values()))
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
