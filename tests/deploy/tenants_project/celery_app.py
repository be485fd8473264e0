"""The project's Celery app: tenant-schemas-celery's, which puts the publisher's schema in
each message and runs each job in it."""

from __future__ import annotations

import os

import django
from tenant_schemas_celery.app import CeleryApp  # type: ignore[import-untyped]

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.deploy.tenants_project.settings")
django.setup()

app = CeleryApp("tenants_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["tests.deploy.tenants_project.notes"])
