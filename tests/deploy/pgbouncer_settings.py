"""Settings of the worker processes that ``tests/deploy/test_pgbouncer.py`` starts: the
suite's settings, with the psycopg ``OPTIONS`` of ``FAIR_JOBS_TEST_DB_OPTIONS`` (a JSON
object), which a DATABASE_URL cannot carry (its query string gives strings, and Django
turns server-side binding on only for ``True``)."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES, env

DATABASES["default"]["OPTIONS"] = env.json("FAIR_JOBS_TEST_DB_OPTIONS", default={})
