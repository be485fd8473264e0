"""What the demo jobs record about themselves."""

from __future__ import annotations

from django.db import models


class ImportRun(models.Model):
    """One import job: when it was enqueued, started and finished (seconds, same host)."""

    mode = models.CharField(max_length=20)
    tenant = models.CharField(max_length=255)
    enqueued_at = models.FloatField()
    started_at = models.FloatField()
    finished_at = models.FloatField(null=True)
