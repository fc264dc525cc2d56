"""The package's layout is its architecture: each subpackage imports only the layers its docstring names.

A new import that crosses a layer (a rule importing the dispatcher, a mask reading a runtime) fails here,
so the data flow a reader sees in the tree stays the one the code follows. The layers form no cycle, no
import of the package hides inside a function, and only :data:`THUNDER_LAYER` imports thunder.
"""

from __future__ import annotations

import ast
import io
import pathlib

import pytest
import torch

import thunder_cudnn_safe

PACKAGE = pathlib.Path(thunder_cudnn_safe.__file__).parent
#: Top-level modules every subpackage may import.
PLUMBING = {"_compat", "_env", "_version", "config", "errors", "caches", "codegen", "lru", "telemetry"}
#: What each subpackage may import besides the plumbing, bottom layer first (no cycle: see the test below).
ALLOWED = {
    "masks": set(),
    "layouts": set(),
    "rules": {"layouts", "masks"},
    "routing": {"layouts", "rules", "masks"},
    "graphs": {"layouts", "rules"},
    "runtimes": {"graphs", "layouts", "routing", "rules", "masks"},
    "dispatch": {"runtimes", "graphs", "layouts", "routing", "rules", "masks"},
    "integration": {"dispatch", "runtimes", "graphs", "layouts", "routing", "rules", "masks"},
}
#: The one subpackage that meets thunder: it registers the executors and reads thunder's proxies and traces.
THUNDER_LAYER = "integration"


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


def test_the_layers_form_no_cycle():
    """Each layer may import only layers listed before it in ALLOWED: a cycle (routing and rules importing each other,
    as they did until issue 41) cannot be allowed."""
    order = list(ALLOWED)
    for name, below in ALLOWED.items():
        above = {other for other in below if order.index(other) >= order.index(name)}
        assert not above, f"{name} may import {sorted(above)}, which are not below it"


def _function_local_imports(path: pathlib.Path) -> list[str]:
    """Imports of the package inside a function or method of ``path`` (where a cycle used to hide)."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                module = node.module if isinstance(node, ast.ImportFrom) else None
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module or ""]
                if isinstance(node, ast.Import | ast.ImportFrom) and any(
                    n.split(".")[0] == "thunder_cudnn_safe" for n in names
                ):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} in {fn.name}")
    return found


def test_no_module_imports_the_package_inside_a_function():
    local = [f for path in sorted(PACKAGE.rglob("*.py")) for f in _function_local_imports(path)]
    assert not local, f"function-local imports of the package (import at module level, from a lower layer): {local}"


def _imports_thunder(path: pathlib.Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(n.split(".")[0] == "thunder" for n in names):
            return True
    return False


def test_only_the_thunder_layer_imports_thunder():
    readers = {str(path.relative_to(PACKAGE)) for path in sorted(PACKAGE.rglob("*.py")) if _imports_thunder(path)}
    outside = sorted(r for r in readers if not r.startswith(f"{THUNDER_LAYER}/"))
    assert not outside, f"{outside} import thunder: only {THUNDER_LAYER}/ meets thunder"
    assert readers, "the test reads no import of thunder at all"


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


def _module_name(path: pathlib.Path) -> str:
    return ".".join(("thunder_cudnn_safe", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def _imported_modules(path: pathlib.Path) -> set[str]:
    """The package's modules ``path`` imports anywhere, a type-only import (``if TYPE_CHECKING:``) included:
    ``from a.b import c`` counts as ``a.b.c`` where that is a module, else as ``a.b``."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names if a.name.startswith("thunder_cudnn_safe"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("thunder_cudnn_safe"):
            for alias in node.names:
                sub = PACKAGE.joinpath(*f"{node.module}.{alias.name}".split(".")[1:])
                is_module = sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
                modules.add(f"{node.module}.{alias.name}" if is_module else node.module)
    return modules


def test_no_module_imports_a_module_that_calls_it():
    """A module's callers sit above it, so it never names them, not even for a type: a helper handed its caller
    (``capture.prebuild(disp)`` typed ``Dispatcher`` under ``TYPE_CHECKING``) reaches back up through it. The
    graph of module imports, type-only imports included, has no cycle."""
    # (a module run as ``__main__`` may import itself by name: runtimes/aot.py's child process)
    graph = {(m := _module_name(p)): _imported_modules(p) - {m} for p in sorted(PACKAGE.rglob("*.py"))}
    cycles = []

    def visit(module: str, path: list[str], done: set[str]) -> None:
        for nxt in sorted(graph.get(module, ())):
            if nxt in path:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in done:
                visit(nxt, [*path, nxt], done)
        done.add(module)

    done: set[str] = set()
    for module in graph:
        if module not in done:
            visit(module, [module], done)
    assert not cycles, f"modules that import (or type-import) a module importing them: {sorted(set(cycles))}"


#: The library objects the layers call (tensors, strings, files; cuDNN's graphs below): a call of one of their
#: methods' names is not a call into the package, whatever else defines the name too.
LIBRARY_TYPES = (torch.Tensor, str, bytes, dict, list, tuple, set, pathlib.Path, io.BufferedWriter, io.TextIOWrapper)


def _library_names() -> set[str]:
    names = set().union(*(dir(t) for t in LIBRARY_TYPES))
    try:
        import cudnn

        names |= set(dir(cudnn.pygraph)) | set(dir(cudnn.tensor))
    except (ImportError, AttributeError):  # no frontend: its methods cannot be told from the package's
        pytest.skip("cudnn-frontend is not importable")
    return names


def _names_by_layer() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Per subpackage (the plumbing: ""): every name it defines (functions, methods, class attributes and fields),
    and the methods of its classes."""
    defined: dict[str, set[str]] = {}
    methods: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = path.relative_to(PACKAGE).parts[0] if path.parent != PACKAGE else ""
        names, own = defined.setdefault(layer, set()), methods.setdefault(layer, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        own.add(item.name)
                    targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
    return defined, methods


@pytest.mark.parametrize("subpackage", sorted(ALLOWED))
def test_no_lower_layer_calls_a_method_only_a_higher_layer_defines(subpackage):
    """A lower layer handed an object of a higher layer (typed ``Any``, so no import shows it) and calling its
    method calls back up: ``fallback.run_oversized_bias(disp, ...)`` calling ``disp.run_fallback``. A call
    ``x.name(...)`` in a module of ``subpackage`` where ``name`` is a method of a class only layers above it
    define (no name of its own layer, the layers it may import, the plumbing or the libraries it calls) is one."""
    defined, methods = _names_by_layer()
    below = ALLOWED[subpackage] | {subpackage, ""}
    visible = set().union(*(defined.get(layer, set()) for layer in below)) | _library_names()
    above = set().union(*(names for layer, names in methods.items() if layer not in below))
    only_above = {name for name in above - visible if not name.startswith("__")}
    calls = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.func.attr}()"
        for path in sorted((PACKAGE / subpackage).glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in only_above
    ]
    assert not calls, f"calls back up into a higher layer's methods: {calls}"
