"""Lint: no private name (``_x``) is imported across packages of packdata.

A module may import ``_private`` names only from modules of its own package
(``packdata/conversion/ray.py`` from ``packdata.conversion.load``), never from
another room. import-linter checks which modules import which; this checks names.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _package(module: str, root: Path) -> str:
    """The room of ``module``: ``packdata`` or its subpackage holding it (a subpackage is its own room)."""
    parts = module.split(".")
    if not (root.joinpath(*parts) / "__init__.py").is_file():  # a plain module: the package around it
        parts = parts[:-1]
    return ".".join(parts[:2])


def _source(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The module ``from ... import`` reads, relative imports resolved; None outside packdata."""
    if node.level == 0:
        name = node.module or ""
        return name if name == "packdata" or name.startswith("packdata.") else None
    parts = module.split(".") if is_package else module.split(".")[:-1]  # the package the import is relative to
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def main(root: Path) -> int:
    problems = []
    for path in sorted((root / "packdata").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _source(node, module, path.name == "__init__.py")
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if source and private and _package(source, root) != _package(module, root):
                problems.append(f"{path}:{node.lineno}: {module} imports {', '.join(private)} from {source}")
    print("\n".join(problems) or "no private names cross a package")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
