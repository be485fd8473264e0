"""The test matrix: every supported Python, Django and Celery together.

Run it with ``bash scripts/matrix.sh`` (it installs nox and finds pyenv's interpreters), or
``nox`` if you have it. ``nox -l`` lists the sessions:

* ``tests(py3.13-dj6.1-cel5.6)``: the suite on PostgreSQL with worker processes, on one
  combination (the chaos subset, which starts its own PostgreSQL server, runs in the main
  cell, ``scripts/test.sh``);
* ``fast(py3.12-dj6.0-cel5.5)``: the suite on PostgreSQL without the tests that start
  worker processes.

Both kinds leave out ``tests/test_example_project.py``: it tests the example project's
commands (the benchmark and the demo), not the library on a cell's versions, and runs in
the main cell.

Every combination is a session of both kinds; ``nox -s tests`` runs them all (hours),
``nox -t ci`` the cells CI runs beside the main one (``bash scripts/test.sh``), and
``bash scripts/matrix.sh --ci`` runs them two at once: the ``ci-workers`` cell beside the
``ci-fast`` cell. The services are those of ``scripts/test.sh``, but each kind of cell has
a database and broker numbers of its own (``DATABASE_URL``, ``CELERY_BROKER_URL`` and
``CELERY_RESULT_BACKEND`` override them, for every cell alike).
"""

from __future__ import annotations

import os
from typing import Any

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["fast"]

PYTHONS = ("3.11", "3.12", "3.13")
DJANGOS = ("5.2", "6.0", "6.1")
CELERYS = ("5.5", "5.6", "5.7")

CI_TESTS = {("3.13", "6.1", "5.6")}
"""Cells whose PostgreSQL suite with workers CI runs (the main one, 3.11 / 5.2 / 5.7, is
``scripts/test.sh``, with the chaos subset). With :data:`CI_FAST`, CI runs each supported
Python, Django and Celery once: the main cell takes the first of each, this cell the last
Python and Django with the middle Celery, and the fast cell the rest."""
CI_FAST = {("3.12", "6.0", "5.5")}
"""Cells CI runs without worker processes."""
EXAMPLE_PROJECT = "--ignore=tests/test_example_project.py"
"""Left out of every cell: the example project's commands are tested in the main cell."""


def _supported(python: str, django: str) -> bool:
    # Django 6.0 and later need Python 3.12 or later.
    return not (django >= "6.0" and python < "3.12")


def _cells(ci: set[tuple[str, str, str]], kind: str) -> list[Any]:
    return [
        nox.param(
            python,
            django,
            celery,
            id=f"py{python}-dj{django}-cel{celery}",
            tags=["ci", f"ci-{kind}"] if (python, django, celery) in ci else [],
        )
        for python in PYTHONS
        for django in DJANGOS
        for celery in CELERYS
        if _supported(python, django)
    ]


def _install(session: nox.Session, django: str, celery: str) -> None:
    session.install("-e", ".[test]", f"Django~={django}.0", f"celery~={celery}.0")
    session.run(
        "python", "-c", "import django, celery; print('Django', django.__version__, "
        "'Celery', celery.__version__)",
    )  # fmt: skip


SERVICES = {
    "workers": ("fair_jobs_workers", 11, 10),
    "fast": ("fair_jobs_fast", 9, 8),
}
"""Per kind of cell: its database (the suite's test database is ``test_`` + this) and its
broker and result backend's Redis numbers, none of them ``scripts/test.sh``'s (``fair_jobs``,
15 to 12), so that a cell of each kind can run beside the other and beside the main suite."""


def _services(kind: str) -> dict[str, str]:
    database, broker, backend = SERVICES[kind]
    return {
        "DATABASE_URL": os.environ.get(
            "DATABASE_URL", f"postgres://postgres@127.0.0.1:5432/{database}"
        ),
        "CELERY_BROKER_URL": os.environ.get(
            "CELERY_BROKER_URL", f"redis://127.0.0.1:6379/{broker}"
        ),
        "CELERY_RESULT_BACKEND": os.environ.get(
            "CELERY_RESULT_BACKEND", f"redis://127.0.0.1:6379/{backend}"
        ),
    }


@nox.session
@nox.parametrize(("python", "django", "celery"), _cells(CI_TESTS, "workers"))
def tests(session: nox.Session, django: str, celery: str) -> None:
    """The suite on PostgreSQL with real worker processes; the chaos subset is the main
    cell's (it tests the protocol against faults, not this combination's versions)."""
    _install(session, django, celery)
    subset = ["-m", "not chaos", EXAMPLE_PROJECT]
    session.run("python", "-m", "pytest", *subset, *session.posargs, env=_services("workers"))


@nox.session
@nox.parametrize(("python", "django", "celery"), _cells(CI_FAST, "fast"))
def fast(session: nox.Session, django: str, celery: str) -> None:
    """The suite on PostgreSQL without the tests that start worker processes.

    Tests marked ``workers`` or ``chaos`` are left out; SQLite is left to the main cell."""
    _install(session, django, celery)
    subset = ["-m", "not workers and not chaos", EXAMPLE_PROJECT]
    session.run("python", "-m", "pytest", *subset, *session.posargs, env=_services("fast"))
