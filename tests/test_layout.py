"""The shape of the package (DESIGN.md's layout): a few entries at the top of headlab/,
no module over LONGEST lines, and no private name (``_x``) imported from another package
of headlab: what two packages share is public where it lives, or lives where it is used.
`lint-imports` checks the layering; this checks what import-linter cannot."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "headlab"
TOP = 23  # entries at the top of headlab/ (modules and packages, __init__ and __main__ too)
LONGEST = 450  # lines


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _dotted(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(dotted: str) -> str:
    """The package (or top-level module) a module belongs to: ``headlab.X``."""
    return ".".join(dotted.split(".")[:2])


def private_imports_across_packages() -> list[str]:
    found = []
    for path in _modules():
        importer = _dotted(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if not (node.module == "headlab" or node.module.startswith("headlab.")):
                continue
            source = node.module
            for alias in node.names:
                # `from headlab.a import _b`: _b is a name of headlab.a, or its submodule
                owner = source if source != "headlab" else f"headlab.{alias.name}"
                if alias.name.startswith("_") and not alias.name.startswith("__") and (
                        _unit(owner) != _unit(importer)):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: "
                                 f"from {source} import {alias.name}")
    return found


def test_no_private_name_is_imported_from_another_package():
    assert private_imports_across_packages() == []


def test_the_checker_sees_a_private_import_across_packages(tmp_path, monkeypatch):
    """The scan itself: a private name from another package is found, one from the same
    package or a relative import is not."""
    pkg = tmp_path / "headlab"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "a" / "x.py").write_text("from headlab.b.y import _hidden\n"
                                    "from headlab.a.z import _ours\nfrom .z import _rel\n")
    (pkg / "b" / "y.py").write_text("from headlab.a import _x\nfrom headlab.b import _own\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    assert private_imports_across_packages() == [
        "headlab/a/x.py:1: from headlab.b.y import _hidden",
        "headlab/b/y.py:1: from headlab.a import _x",
    ]


def test_the_top_of_the_package_stays_small():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= TOP, (
        f"headlab/ has {len(entries)} entries, more than {TOP}: {entries}; put the new "
        "module in the package of its step of the data flow (docs/architecture.md)")


def test_no_module_is_longer_than_the_limit():
    lengths = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines())
               for p in _modules()}
    assert {p: n for p, n in lengths.items() if n > LONGEST} == {}
