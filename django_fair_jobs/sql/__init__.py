"""Named SQL blocks, loaded once from the ``.sql`` files of the package.

Raw SQL is used only where the ORM cannot say it in one round trip (data-modifying CTEs,
``ON CONFLICT``, ``SKIP LOCKED``). Each mechanism keeps its statements beside its store
(``slots/store.sql``, ``queue_limits/store.sql``, ...); this loader reads them by path under the
package, never by importing the rooms, so that it stays at the bottom layer. The docs print
the files as they are, in the order of :data:`STATEMENT_FILES`.

Every statement is a single statement (one round trip in autocommit) whose data-modifying
CTEs commit together. Success is judged by what the statement returns, never by a read
followed by a write. Other databases use the ORM path of each room's store instead.
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files
from typing import Any

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)

STATEMENT_FILES = (
    "slots/store.sql",
    "leases/store.sql",
    "maintenance/store.sql",
    "reroute/store.sql",
    "queue_limits/store.sql",
    "planner/store.sql",
    "dispatch/store.sql",
)
"""The files of the named statements the library runs on PostgreSQL, paths under the
package, in the order the docs print them."""


def read(path: str) -> str:
    """The text of the package's file ``path`` (a path under the package)."""
    return files("django_fair_jobs").joinpath(path).read_text(encoding="utf-8")


def blocks(text: str) -> dict[str, str]:
    """``{name: statement}`` for the ``-- name:`` blocks of ``text``, comment lines left
    out; a name given twice is an error."""
    parts = _NAME.split(text)
    result: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in result:
            raise ValueError(f"the SQL block {name!r} is defined twice")
        lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
        result[name] = "\n".join(lines).strip().rstrip(";")
    return result


@cache
def queries(dialect: str = "postgresql") -> dict[str, str]:
    """Return ``{name: statement}``: with ``"postgresql"``, every named statement of
    :data:`STATEMENT_FILES`; with another name, the blocks of ``sql/<name>.sql`` (such as
    ``"dispatch"``, the functions a migration installs)."""
    if dialect != "postgresql":
        return blocks(read(f"sql/{dialect}.sql"))
    merged: dict[str, str] = {}
    for path in STATEMENT_FILES:
        found = blocks(read(path))
        twice = sorted(set(found) & set(merged))
        if twice:
            raise ValueError(f"the SQL blocks {twice} are defined twice ({path})")
        merged.update(found)
    return merged


def install_functions(apps: Any, schema_editor: Any) -> None:
    """A migration's ``RunPython`` step that installs fair dispatch's functions again, in
    place (same signatures): :func:`install_dispatch_functions`."""
    install_dispatch_functions(schema_editor)


def install_dispatch_functions(schema_editor: Any) -> None:
    """Install fair dispatch's functions (the ``functions`` block of ``sql/dispatch.sql``)
    with a migration's ``schema_editor``, on PostgreSQL only: other databases use the ORM
    store. A migration that changes a function's signature or result columns drops the
    old one first, in its own statement."""
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(queries("dispatch")["functions"], params=None)
