"""The jobs' own records, written by the test tasks with the database clock."""

from __future__ import annotations

from django.db import models


class JobRun(models.Model):
    """One execution of a test job: who ran it and when (database clock)."""

    task_id = models.CharField(max_length=255)
    tenant = models.CharField(max_length=255)
    queue = models.CharField(max_length=255, default="")
    pid = models.IntegerField()
    retries = models.IntegerField(default=0)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True)
    interrupted = models.BooleanField(
        default=False, help_text="Ended by an exception (a time limit), not by finishing."
    )

    class Meta:
        db_table = "testapp_jobrun"
