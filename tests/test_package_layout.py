"""The package's layout is its architecture: each subpackage imports only the layers its docstring names.

A new import that crosses a layer (a rule importing the dispatcher, a mask reading a runtime) fails here,
so the data flow a reader sees in the tree stays the one the code follows.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import thunder_cudnn_safe

PACKAGE = pathlib.Path(thunder_cudnn_safe.__file__).parent
#: Top-level modules every subpackage may import.
PLUMBING = {"_compat", "_env", "_version", "config", "errors", "caches", "codegen", "lru", "telemetry"}
#: What each subpackage may import besides the plumbing (plan and rules are one layer: see plan/__init__.py).
ALLOWED = {
    "masks": set(),
    "plan": {"masks", "rules"},
    "rules": {"masks", "plan"},
    "graphs": {"plan", "rules"},
    "runtimes": {"graphs", "plan", "rules", "masks"},
    "dispatch": {"runtimes", "graphs", "plan", "rules", "masks"},
    "integration": {"dispatch", "runtimes", "graphs", "plan", "rules", "masks"},
}


def _imported_parts(path: pathlib.Path) -> set[str]:
    """The package's subpackages and top-level modules ``path`` imports, at module level or inside a function."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the package imports absolutely)"
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            dotted = name.split(".")
            if dotted[0] != "thunder_cudnn_safe":
                continue
            if len(dotted) > 1:
                parts.add(dotted[1])
            else:  # from thunder_cudnn_safe import config
                parts.update(a.name for a in node.names)
    return parts


def test_every_subpackage_is_listed_and_documented():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(ALLOWED)
    for name in subpackages:
        tree = ast.parse((PACKAGE / name / "__init__.py").read_text())
        doc = ast.get_docstring(tree)
        assert doc and "May import" in doc, f"{name}/__init__.py must say what it owns and what it may import"
        assert len(tree.body) == 1, f"{name}/__init__.py holds its docstring only (no import cycles through it)"


@pytest.mark.parametrize("subpackage", sorted(ALLOWED))
def test_subpackage_imports_only_its_layers(subpackage):
    allowed = ALLOWED[subpackage] | PLUMBING | {subpackage}
    for path in sorted((PACKAGE / subpackage).glob("*.py")):
        crossing = _imported_parts(path) - allowed
        assert not crossing, f"{path.relative_to(PACKAGE)} imports {sorted(crossing)}, outside its layers"


def test_plumbing_imports_no_subpackage():
    for name in sorted(PLUMBING):
        crossing = _imported_parts(PACKAGE / f"{name}.py") & set(ALLOWED)
        assert not crossing, f"{name}.py imports {sorted(crossing)}: plumbing sits below every subpackage"


def test_readme_map_matches_the_tree():
    readme = (PACKAGE.parent / "README.md").read_text()
    section = readme.split("## Map of the repository", 1)[1].split("```", 2)[1]
    for name in ALLOWED:
        assert f"  {name}/" in section, f"README's map lacks {name}/"


#: The longest class or function the package allows itself (issue 35: a unit a newcomer can read whole).
UNIT_LINE_LIMIT = 120


def test_no_class_or_function_is_over_the_unit_limit():
    """Every class and function, docstring included, is at most UNIT_LINE_LIMIT lines (``Dispatcher`` was 129)."""
    over = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > UNIT_LINE_LIMIT
    ]
    assert not over, over
