"""A fresh Django project written to a directory, for the tests that run ``manage.py`` in a
subprocess (the checks, and a project that has not migrated): its ``manage.py`` and Celery
app, with each test's settings and tasks."""

from __future__ import annotations

from pathlib import Path

BASE_FILES = {
    "manage.py": """
import os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
from django.core.management import execute_from_command_line
execute_from_command_line(sys.argv)
""",
    "proj/__init__.py": "from .celery import app as celery_app\n",
    "proj/celery.py": """
import os
from celery import Celery
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
""",
    "shop/__init__.py": "",
}
"""The files every such project has: ``manage.py``, the project package ``proj`` with its
Celery app, and the app ``shop`` (its ``tasks.py`` is the test's)."""


def write_project(directory: Path, files: dict[str, str]) -> Path:
    """Write :data:`BASE_FILES` and ``files`` (``proj/settings.py``, ``shop/tasks.py``, ...)
    under ``directory``; returns it."""
    for name, text in {**BASE_FILES, **files}.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return directory
