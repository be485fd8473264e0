"""Named SQL blocks, loaded once from the ``.sql`` files beside this module.

Raw SQL is used only where the ORM cannot say it in one round trip (data-modifying CTEs,
``ON CONFLICT``, ``SKIP LOCKED``); keeping it in one file lets the docs print it as is.
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@cache
def queries(dialect: str = "postgresql") -> dict[str, str]:
    """Return ``{name: statement}`` for the ``-- name:`` blocks of ``<dialect>.sql``."""
    text = files(__package__).joinpath(f"{dialect}.sql").read_text(encoding="utf-8")
    parts = _NAME.split(text)
    result: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
        result[name] = "\n".join(lines).strip().rstrip(";")
    return result
