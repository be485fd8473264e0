from __future__ import annotations

from django.apps import AppConfig


class BenchConfig(AppConfig):
    """The fairness benchmark and the demo: jobs that record when they ran."""

    name = "bench"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from bench import statements

        # Every process of the project counts the statements it sends to the library's
        # tables, so the benchmark can report them per job.
        statements.install()
