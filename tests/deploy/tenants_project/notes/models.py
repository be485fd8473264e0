"""The row each job of the project writes, in the schema it runs in."""

from __future__ import annotations

from django.db import models


class Note(models.Model):
    """One job's run: which task, and the schema and fair tenant it ran under."""

    task = models.CharField(max_length=100)
    schema = models.CharField(max_length=100)
    tenant = models.CharField(max_length=255)
