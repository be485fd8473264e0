"""Example Django project using django-fair-jobs."""

from __future__ import annotations

from example.celery import app as celery_app

__all__ = ["celery_app"]
