"""Each script that installs an extra runs with that extra alone.

``scripts/demo.sh`` installs ``.[demo]`` and ``scripts/bench.sh`` installs ``.[bench]`` (each
through ``scripts/venv.sh``), but
all scripts share ``.venv``: once ``scripts/test.sh`` has installed the ``dev`` extras, a
command that imports a package its own extra lacks still works, and only a newcomer's fresh
clone shows the failure. These tests run each script's management command in a process where
importing any installed distribution outside the script's extra (and what it depends on)
fails, as it would in a venv with only that extra.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import ROOT

PROJECT = "django-fair-jobs"

# Run in the child: refuse every top-level module that belongs only to distributions
# outside the allowed set, then run manage.py with the given arguments.
_CHILD = r"""
import importlib.abc, importlib.metadata, json, os, re, runpy, sys

allowed = set(json.loads(sys.argv[1]))
def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()
owners = importlib.metadata.packages_distributions()

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        dists = {canon(d) for d in owners.get(top, ())}
        if dists and not dists & allowed:
            raise ModuleNotFoundError(
                f"No module named {name!r} (distribution {sorted(dists)} is not in this "
                "script's extra)", name=name)
        return None

sys.meta_path.insert(0, Refuse())
sys.argv = sys.argv[2:]
if sys.argv[0] == "-c":
    exec(sys.argv[1])
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _closure(extra: str) -> set[str]:
    """Canonical names of the project and every distribution ``PROJECT[extra]`` installs."""
    from importlib.metadata import PackageNotFoundError, distribution

    seen: set[str] = set()
    done: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str]]] = [(PROJECT, frozenset({extra}))]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, extras) in done:
            continue
        done.add((key, extras))
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # an optional dependency this interpreter does not need (a marker)
        seen.add(key)
        for raw in dist.requires or ():
            req = Requirement(raw)
            wanted = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in wanted):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return seen


def _script_commands() -> list[tuple[str, str, str]]:
    """(script, extra, management command) for each script that installs an extra other
    than ``dev`` and runs a ``manage.py`` command."""
    found = []
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        text = script.read_text()
        extra = re.search(r"^\. scripts/venv\.sh (\w+)$", text, re.MULTILINE)
        command = re.search(r"manage\.py (\w+)", text)
        if extra and command and extra.group(1) != "dev":
            found.append((script.name, extra.group(1), command.group(1)))
    return found


def _run_with_only(extra: str, *argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    import json

    return subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(sorted(_closure(extra))), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _env(tmp_path: Path) -> dict[str, str]:
    import os

    # The demo's embedded defaults: no DATABASE_URL, no broker URL (SQLite files).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE")
    }
    env["DEMO_DIR"] = str(tmp_path / "demo")
    return env


def test_scripts__each_installs_an_extra_and_runs_a_command() -> None:
    # The parametrised test below reads the scripts; this one keeps it from passing by
    # finding none.
    found = {script: (extra, command) for script, extra, command in _script_commands()}
    assert found["demo.sh"] == ("demo", "run_demo")
    assert found["bench.sh"] == ("bench", "fairbench")


@pytest.mark.parametrize(("script", "extra", "command"), _script_commands())
def test_script_command__imports_only_its_extra(
    script: str, extra: str, command: str, tmp_path: Path
) -> None:
    result = _run_with_only(
        extra, "example_project/manage.py", command, "--help", env=_env(tmp_path)
    )
    assert result.returncode == 0, (
        f"{script} installs .[{extra}] but `manage.py {command}` needs more:\n{result.stderr}"
    )
    assert "usage:" in result.stdout


def test_import_guard__refuses_a_package_outside_the_extra(tmp_path: Path) -> None:
    # The guard itself: psycopg is installed here (dev extras) but is not in `demo`.
    result = _run_with_only("demo", "-c", "import psycopg", env=_env(tmp_path))
    assert result.returncode != 0
    assert "is not in this script's extra" in result.stderr
