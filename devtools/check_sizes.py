"""`make lint`: no product module over 400 lines, no function over 60. A module that grows past it is
split where its parts have names of their own; a function, into named steps.

    python -m devtools.check_sizes
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = ("flows", "tasks", "raytrain_driver", "raytrain_tasks", "deployments")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def oversized(root: Path) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            lines = len(text.splitlines())
            name = path.relative_to(root)
            if lines > MAX_MODULE_LINES:
                found.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES})")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{name}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def main() -> int:
    found = oversized(Path(__file__).resolve().parent.parent)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
