"""The example project's Celery app."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import task_prerun

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example.settings")

app = Celery("example")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@task_prerun.connect
def close_old_connections(**kwargs: Any) -> None:
    """Before each task, drop connections that are broken or older than CONN_MAX_AGE.

    With CELERY_DB_REUSE_MAX set, Celery keeps connections between tasks; this makes it
    safe: a connection that failed (a restarted server, a task interrupted mid-query) is
    closed here and, with CONN_HEALTH_CHECKS, checked before it is used again.
    """
    from django.db import close_old_connections as close

    close()
