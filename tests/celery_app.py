"""The Celery app that the test suite's worker processes run."""

from __future__ import annotations

import os

import django
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

app = Celery("tests")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["tests.testapp"])
# The chaos suite's workload (tests/chaos/).
app.autodiscover_tasks(["tests.testapp"], related_name="chaos_tasks")
# Canvas and autoretry (tests/deploy/test_canvas.py).
app.autodiscover_tasks(["tests.testapp"], related_name="canvas_tasks")
