"""The functions fair dispatch runs on PostgreSQL are the ones the package ships (D21 of the
dispatch review): a change to ``sql/dispatch.sql`` needs a migration that installs it
again, and the database migrated by the test run holds exactly the file's functions."""

from __future__ import annotations

import hashlib
import importlib
import pkgutil
import re

import pytest
from django.db import connection

from django_fair_jobs import migrations, sql

FUNCTION = re.compile(r"CREATE OR REPLACE FUNCTION (\w+)\(.*?\$\$\n(.*?)\$\$(?:;|\Z)", re.DOTALL)


def shipped() -> dict[str, str]:
    """``{name: body}`` of the functions block of ``sql/dispatch.sql``."""
    return {name: body for name, body in FUNCTION.findall(sql.queries("dispatch")["functions"])}


def test_the_file_changed__a_migration_installs_it_again() -> None:
    digests = []
    for info in sorted(pkgutil.iter_modules(migrations.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{migrations.__name__}.{info.name}")
        if hasattr(module, "FUNCTIONS_DIGEST"):
            digests.append((info.name, module.FUNCTIONS_DIGEST))
    assert digests, "no migration installs sql/dispatch.sql"
    latest, digest = digests[-1]
    now = hashlib.sha256(sql.queries("dispatch")["functions"].encode()).hexdigest()
    assert digest == now, (
        f"sql/dispatch.sql changed since migration {latest} installed it: add a migration "
        f"that installs it again (RunPython, as {latest} does) with FUNCTIONS_DIGEST = {now!r}"
    )


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's functions")
@pytest.mark.django_db
def test_installed_functions__exactly_the_files() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT p.proname, p.prosrc FROM pg_proc AS p"
            " JOIN pg_namespace AS n ON n.oid = p.pronamespace"
            " WHERE n.nspname = current_schema() AND p.proname LIKE 'fair_jobs_%%'"
        )
        installed = dict(cursor.fetchall())
    expected = shipped()
    assert sorted(installed) == sorted(expected)
    for name, body in expected.items():
        assert installed[name].strip() == body.strip(), name
