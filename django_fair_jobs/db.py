"""Database helpers every room shares (layer 0: imports nothing of the package)."""

from __future__ import annotations

from collections.abc import Callable

from django.db import connections, transaction


def after_commit(action: Callable[[], object], using: str) -> bool:
    """Run ``action`` once the caller's transaction on ``using`` commits, if the caller is
    inside ``atomic()``, and return True; else return False, and the caller runs it now.

    For whatever publishes to the broker rows written in the caller's transaction (a
    wake-up's reservation, a dispatched job): published before the commit, the message can
    reach a worker that does not see the rows yet, and the row lock would be held across
    broker I/O until the caller's transaction ends. On a rollback nothing is published,
    which is right: the rows are gone too."""
    if not connections[using].in_atomic_block:
        return False
    transaction.on_commit(action, using=using)
    return True
