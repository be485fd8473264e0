"""Django application configuration."""

from __future__ import annotations

from django.apps import AppConfig


class FairJobsConfig(AppConfig):
    """The ``fair_jobs`` app: registers system checks and Celery signal handlers."""

    name = "django_fair_jobs"
    label = "fair_jobs"
    verbose_name = "Fair jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported for their side effects only: check registration, signal wiring, and
        # the heartbeat's registration hook (identity.on_register), so that a process
        # that registers from any path starts its heartbeat and maintenance threads.
        from django_fair_jobs import checks, maintenance, signals  # noqa: F401
