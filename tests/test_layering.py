"""The package's imports run one way (DESIGN.md, Layout): kernels and models import
nothing else of cswap, and nothing imports the command-line tools in cswap.cli."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Installed layout: kernels/ and models/ are cswap.kernels and cswap.models.
PACKAGES = {"cswap": ROOT / "cswap", "cswap.kernels": ROOT / "kernels", "cswap.models": ROOT / "models"}


def _modules():
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            if package == "cswap" and parts[0] in ("kernels", "models"):
                continue
            yield name, path, path.name == "__init__.py"


def _imports(name: str, path: Path, is_package: bool) -> set[str]:
    """Absolute names of the cswap modules `path` imports (anywhere in it, lazily too)."""
    found = set()
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "cswap"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here[: len(here) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] == "cswap":
                found |= {f"{base}.{a.name}" for a in node.names} | {base}
    return found


def test_nothing_outside_the_cli_imports_it():
    upward = [(name, imported) for name, path, pkg in _modules() if not name.startswith("cswap.cli")
              for imported in _imports(name, path, pkg) if imported.startswith("cswap.cli")]
    assert not upward, upward


def test_kernels_and_models_import_nothing_else_of_cswap():
    for leaf in ("cswap.kernels", "cswap.models"):
        stray = [(name, imported) for name, path, pkg in _modules() if name.startswith(leaf)
                 for imported in _imports(name, path, pkg) if not imported.startswith(leaf)]
        assert not stray, stray


def test_the_walk_sees_relative_imports():
    names = {name: (path, pkg) for name, path, pkg in _modules()}
    assert "cswap.models.data" in _imports("cswap.plan.sparsity", *names["cswap.plan.sparsity"])
    assert "cswap.models.data" in _imports("cswap.cli.train", *names["cswap.cli.train"])
