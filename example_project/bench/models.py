"""What benchmark jobs record about themselves."""

from __future__ import annotations

from django.db import models


class JobRecord(models.Model):
    """One execution of one benchmark job (a job run twice leaves two rows).

    Times are ``time.time()`` seconds taken on the same host by the publisher
    (``enqueued_at``) and by the job itself (``started_at``, ``finished_at``).
    """

    run = models.CharField(max_length=32)
    mode = models.CharField(max_length=32)
    job = models.IntegerField()
    tenant = models.CharField(max_length=255)
    enqueued_at = models.FloatField()
    started_at = models.FloatField()
    finished_at = models.FloatField()
    pid = models.IntegerField()

    class Meta:
        indexes = [models.Index(fields=["run", "mode"], name="bench_jobrecord_run_mode")]


class StatementCount(models.Model):
    """Statements one worker process sent to the library's tables during a mode."""

    run = models.CharField(max_length=32)
    mode = models.CharField(max_length=32)
    pid = models.IntegerField()
    statements = models.BigIntegerField()
    on_path = models.BigIntegerField(default=0)
    """Of them, those sent by the thread that runs the jobs."""
    commits = models.BigIntegerField(default=0)
    """The library's durable commits (``bench.statements.commits``)."""
