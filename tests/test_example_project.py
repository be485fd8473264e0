"""The example project's commands run against the library as shipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from tests.conftest import ROOT, database_url

pytestmark = pytest.mark.django_db(transaction=True)


def run_manage(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DEMO_DIR": str(tmp_path),
        "DJANGO_SETTINGS_MODULE": "example.settings",
    }
    return subprocess.run(
        [sys.executable, "example_project/manage.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_bench_slots__measures_and_leaves_counters_at_zero(tmp_path: Path) -> None:
    result = run_manage(tmp_path, "bench_slots", "--seconds", "1", "--clients", "2")
    if connection.vendor != "postgresql":
        # It measures PostgreSQL against pgbench; elsewhere it must say so, not crash.
        assert result.returncode != 0
        assert "needs PostgreSQL" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| acquire, slot free | 1 |" in result.stdout
    assert "| release, nobody parked | 1 |" in result.stdout
    assert "Slot counter after the run: 0 (must be 0)." in result.stdout
