"""The package layering docs/architecture.md ("Layout") states, held by the code.

Each package of :data:`LAYERS` imports only packages before it in the list, at module level and
inside functions alike; the one documented exception is :data:`UPWARD`. ``deploy``, ``mixfleet``,
``benchmarks`` and ``tests`` sit on top: they may import anything, and nothing in :data:`LAYERS`
imports them. Inside ``engine``, each folder of :data:`ENGINE_LAYERS` (the pipeline: kernels, the
model, the runtime that schedules it, the server that translates HTTP into the runtime's requests)
imports only the engine's folders before it in the list. No module imports a module-private
(underscore) name of :mod:`core.sglang_contract`'s modules: a name another module needs is public.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = (
    "core",
    "weight_sync",
    "engine",
    "clients",
    "fleet",
    "launcher",
    "replica",
    "router",
    "trainer",
    "validate",
    "images",
)
TOP = ("deploy", "mixfleet", "benchmarks", "tests")
ENGINE_LAYERS = ("kernels", "model", "runtime", "server")
# (file, module) pairs allowed to point up, each inside one function (docs/architecture.md).
UPWARD = {
    ("weight_sync/convert.py", "engine.model.calibrate"),
    ("weight_sync/base_model.py", "engine.model.tokenizer"),
}


def imported_modules(path: Path) -> list[str]:
    """Absolute modules ``path`` imports (relative imports stay in the package and are skipped)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def test_every_layered_package_imports_only_lower_ones() -> None:
    wrong = []
    for rank, package in enumerate(LAYERS):
        allowed = set(LAYERS[: rank + 1])
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for module in imported_modules(path):
                top = module.split(".")[0]
                if top not in LAYERS and top not in TOP:
                    continue  # the standard library or a dependency
                if top not in allowed and (rel, module) not in UPWARD:
                    wrong.append(f"{rel} imports {module}")
    assert not wrong, "imports against the layering of docs/architecture.md:\n" + "\n".join(wrong)


def test_every_top_level_package_is_placed() -> None:
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages <= set(LAYERS) | set(TOP), sorted(packages - set(LAYERS) - set(TOP))


def test_every_engine_folder_imports_only_lower_ones() -> None:
    wrong = []
    for rank, folder in enumerate(ENGINE_LAYERS):
        allowed = set(ENGINE_LAYERS[: rank + 1])
        for path in sorted((REPO / "engine" / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for module in imported_modules(path):
                parts = module.split(".")
                if parts[0] == "engine" and (len(parts) < 2 or parts[1] not in allowed):
                    wrong.append(f"{rel} imports {module}")
    assert not wrong, "imports against the engine's layering of docs/architecture.md:\n" + "\n".join(wrong)


def test_every_engine_module_is_in_a_layer() -> None:
    folders = {p.parent.relative_to(REPO / "engine").as_posix() for p in (REPO / "engine").rglob("*.py")}
    assert folders <= {".", *ENGINE_LAYERS}, sorted(folders - {".", *ENGINE_LAYERS})


def test_no_product_module_imports_another_modules_private_name() -> None:
    """A name another module imports is public where it is defined (a private module of a package,
    ``weight_sync.formats._common``, is imported whole by its siblings); tests and benchmarks may
    reach into a module's privates."""
    wrong = []
    for top in (*LAYERS, "deploy", "mixfleet"):
        for path in sorted((REPO / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [a.name for a in node.names if a.name[0] == "_" and a.name != "__version__"]
                    private = [
                        n
                        for n in names
                        if (REPO / (node.module or "").replace(".", "/") / f"{n}.py").exists()
                    ]
                    wrong.extend(
                        f"{path.relative_to(REPO)} imports {node.module}.{n}"
                        for n in names
                        if n not in private
                    )
    assert not wrong, "make these public in the module that defines them:\n" + "\n".join(wrong)
