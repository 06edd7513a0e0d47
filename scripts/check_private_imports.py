"""Lint: no private name (``_x``) is imported across packages of packdata.

A module may import ``_private`` names only from modules of its own package
(``packdata/conversion/ray.py`` from ``packdata.conversion.load``), never from
another room. import-linter checks which modules import which; this checks names.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def main(root: Path) -> int:
    problems = []
    for path in sorted((root / "packdata").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.ImportFrom) or not node.module or not node.module.startswith("packdata"):
                continue
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private and _package(node.module) != _package(module):
                problems.append(f"{path}:{node.lineno}: {module} imports {', '.join(private)} from {node.module}")
    print("\n".join(problems) or "no private names cross a package")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
