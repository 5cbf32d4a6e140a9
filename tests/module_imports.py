"""What a source file imports, read from its syntax tree: the import tests' one reader."""

from __future__ import annotations

import ast
from pathlib import Path


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (inside functions too);
    ``from a import b`` counts ``a`` and ``a.b`` (b may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names
