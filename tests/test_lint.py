"""The tree stays ruff-clean (configuration in pyproject.toml) and its functions short."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency: pip install -e '.[test]'"
    result = subprocess.run([ruff, "check", "--no-cache", str(REPO)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


MAX_LINES = 80
# Dashboard data (one panel list per dashboard) and benchmarks' ``main`` may be longer.
LONG_ALLOWED = {"deploy/grafana/generate.py"}


def test_every_function_fits_on_a_screen() -> None:
    long = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith((".", "build/")) or "/." in rel or rel in LONG_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES and not (rel.startswith("benchmarks/") and node.name == "main"):
                    long.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these:\n" + "\n".join(long)
