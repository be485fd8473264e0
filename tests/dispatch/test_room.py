"""The dispatch room's boundary: it imports only the layers below it, no other mechanism."""

from __future__ import annotations

import ast
from pathlib import Path

import django_fair_jobs

PACKAGE = Path(django_fair_jobs.__file__).parent

BELOW = {
    "conf",
    "errors",
    "headers",
    "validation",
    "routing",
    "broker",
    "db",
    "sql",
    "tenants",
    "models",
}
"""The package's layers 0 and 1 (settings, errors, names, schema): what a room may import."""


def imported_modules(path: Path) -> set[str]:
    """Every ``django_fair_jobs`` module ``path`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "django_fair_jobs":
                found |= {f"django_fair_jobs.{a.name}" for a in node.names}
            elif node.module.startswith("django_fair_jobs."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("django_fair_jobs")}
    return found


def test_dispatch_room__imports_no_other_mechanism() -> None:
    files = sorted((PACKAGE / "dispatch").glob("*.py"))
    assert len(files) >= 4  # __init__, models, store, store_orm: the check reads them
    outside = {
        f"{path.name}: {module}"
        for path in files
        for module in imported_modules(path)
        if module.split(".")[1] not in BELOW | {"dispatch"}
    }
    assert not outside, outside


def test_imported_modules__sees_function_local_and_package_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from django_fair_jobs import slots\n"
        "def f():\n    from django_fair_jobs.planner import run\n"
    )
    assert imported_modules(sample) == {"django_fair_jobs.slots", "django_fair_jobs.planner"}
