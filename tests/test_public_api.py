"""The public API is deliberate: every name README tells users to touch is importable from the
package, and every name in ``__all__`` is documented in README; the names docs/design.md lists as removed
are gone, and what replaces each is a knob; its knobs table names every knob."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import thunder_cudnn_safe as tcs

#: Names README quotes from cuDNN, libcudnn, thunder and torch (a keyword), not from this package.
FOREIGN = {"build_operation_graph", "enable_gqa", "rowsum", "thunderfx", "validate"}
ROOT = Path(__file__).resolve().parents[1]
#: README: every name it quotes exists
README = (ROOT / "README.md").read_text()
DESIGN = (ROOT / "docs" / "design.md").read_text()


def _section(title: str, text: str = README) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


#: docs/design.md's note of the names removed in 0.1.0 (and what replaces each)
REMOVED = _section("Removed in 0.1.0", DESIGN)


def test_every_exported_name_is_documented_in_readme():
    missing = [name for name in tcs.__all__ if f"`{name}" not in README]
    assert missing == [], f"exported but not in README: {missing}"


def test_every_exported_name_exists():
    assert [name for name in tcs.__all__ if not hasattr(tcs, name)] == []
    assert len(set(tcs.__all__)) == len(tcs.__all__)


def test_every_exported_function_is_named_and_documented_as_itself():
    """``help(tcs.varlen_info)`` shows the function's own name and docstring, not a counter method's
    (``Counts.info``) or the graph cache's ``info``: exported functions are functions of their own."""
    import inspect

    functions = {name: getattr(tcs, name) for name in tcs.__all__ if callable(getattr(tcs, name))}
    functions = {name: f for name, f in functions.items() if not inspect.isclass(f)}
    wrong = [name for name, f in functions.items() if getattr(f, "__name__", None) != name or not inspect.getdoc(f)]
    assert wrong == [], wrong


def test_every_readme_name_is_importable():
    dotted = set(re.findall(r"\bthunder_cudnn_safe\.([A-Za-z_]\w*)", README))
    api = {m.removesuffix("()") for m in re.findall(r"`([A-Za-z_]\w*(?:\(\))?)`", _section("Public API"))} - FOREIGN
    calls = set(re.findall(r"`([a-z_]\w*)\(", README)) - FOREIGN  # `clear_cache()`, `explain(q, k, v)`, ...
    missing = []
    for name in sorted(dotted | api | calls):
        try:
            hasattr(tcs, name) or importlib.import_module(f"thunder_cudnn_safe.{name}")  # a name or a submodule
        except ImportError:
            missing.append(name)
    assert missing == []
    for name in ("DeclineCode", "CopyReason", "cudnn_rules", "config", "Decline"):
        assert name in tcs.__all__


def test_the_knobs_table_names_every_knob_and_its_variable():
    knobs = _section("Knobs", DESIGN)
    for knob in tcs.config.KNOBS.values():
        assert f"`{knob.name}`" in knobs and f"`{knob.env}`" in knobs, knob.name


def test_readme_removed_names_are_gone_and_their_replacements_are_knobs():
    rows = [line.split(" | ") for line in REMOVED.splitlines() if line.startswith("| `")]
    assert len(rows) >= 8
    for removed, instead in rows:
        for dotted in re.findall(r"`([A-Za-z_][\w.]*)", removed):
            *module, name = dotted.split(".")
            if module:
                owners = [importlib.import_module(".".join(["thunder_cudnn_safe", *module]))]
            else:  # a bare name: in no module of the package
                owners = [m for n, m in sys.modules.items() if n.split(".")[0] == "thunder_cudnn_safe"]
            for owner in owners:
                assert not hasattr(owner, name), f"{owner.__name__}.{name}"
                assert name not in getattr(owner, "__all__", ()), f"{owner.__name__}.{name}"
        for knob in re.findall(r"config\.set\((.*?)\)`", instead):
            names = re.findall(r"(?:^|, )(\w+)=", knob)
            assert names and set(names) <= set(tcs.config.KNOBS), knob
        for knob in re.findall(r"config\.KNOBS\[\"(\w+)\"\]", instead):
            assert knob in tcs.config.KNOBS, knob
        for name in re.findall(r"config\.(\w+)`", instead):
            assert hasattr(tcs.config, name), name


def test_readme_rules_are_entries_of_cudnn_rules():
    """``cudnn_rules.X`` in README is a rule users can compare ``Decline.rule`` with."""
    for name in set(re.findall(r"cudnn_rules\.([A-Z_0-9]+)\b", README)):
        assert hasattr(tcs.cudnn_rules, name), name


def test_every_counter_is_described_in_one_place():
    """Each public counter (``*_info``, and ``copy_stats``, ``cached_graphs``) is described in docs/counters.md,
    with what it returns, and nowhere else: docs/design.md had a copy of README's counters that lacked
    ``varlen_info``, ``gate_info`` and ``plan_cache_info``."""
    root = Path(__file__).resolve().parents[1]
    counters = (root / "docs" / "counters.md").read_text()
    names = [n for n in tcs.__all__ if n.endswith("_info") and not n.startswith("reset_")]
    names += ["copy_stats", "cached_graphs"]
    assert {"varlen_info", "gate_info", "plan_cache_info", "cache_info"} <= set(names)
    assert [n for n in names if f"`{n}()` ->" not in counters] == []
    elsewhere = [
        f"{path.relative_to(root)}: {n}"
        for path in (root / "README.md", *sorted((root / "docs").glob("*.md")))
        if path.name != "counters.md"
        for n in names
        if f"`{n}()` ->" in path.read_text()
    ]
    assert elsewhere == [], f"counters described outside docs/counters.md: {elsewhere}"
