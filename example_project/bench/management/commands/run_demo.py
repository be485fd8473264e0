"""``manage.py run_demo``: the Quick start demo, a short flood on whatever services are set.

The benchmark's ``demo`` scenario (see ``fairbench``), written under ``DEMO_DIR``, then
what to try next.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import CommandParser

from bench.management.commands import fairbench


class Command(fairbench.Command):
    """Run the short ``demo`` flood, plain Celery against fair dispatch, and say what next."""

    help = (
        "The fairness demo: a short flood, plain Celery against fair dispatch, and the ideal "
        "(--modes runs others too)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.set_defaults(scenario="demo", output=Path(settings.DEMO_DIR), modes="plain,dispatch")

    def handle(self, *args: Any, **options: Any) -> None:
        super().handle(*args, **options)
        report = self.report
        plain = report["summaries"].get("plain")
        fair = report["summaries"].get("dispatch")
        ideal = report["summaries"].get("ideal")
        self.stdout.write("")
        if plain and fair and ideal and plain["small_wait_p95"] and fair["small_wait_p95"]:
            self.stdout.write(
                f"Small tenants' p95 wait: {fair['small_wait_p95']:.2f} s with fair dispatch "
                f"against {plain['small_wait_p95']:.2f} s with plain Celery (an ideal fair "
                f"scheduler: {ideal['small_wait_p95']:.2f} s); all jobs done in "
                f"{fair['makespan']:.1f} s against {plain['makespan']:.1f} s."
            )
        self.stdout.write("")
        self.stdout.write("Next steps:")
        self.stdout.write(
            "  * The full benchmark, on PostgreSQL and Redis (see docs/benchmarks.md):\n"
            "      bash scripts/bench.sh flood\n"
            "  * This demo against PostgreSQL and Redis:\n"
            '      .venv/bin/pip install -e ".[postgres,redis]"\n'
            "      DATABASE_URL=postgres://postgres@127.0.0.1:5432/fair_jobs_example \\\n"
            "      CELERY_BROKER_URL=redis://127.0.0.1:6379/0 "
            ".venv/bin/python example_project/manage.py run_demo"
        )
        self.stdout.write(
            "  * The admin, where a running worker's tenants, lines and jobs show (the demo's\n"
            "    workers have stopped, so start one and send jobs, as docs/quickstart.md does):\n"
            "      .venv/bin/python example_project/manage.py createsuperuser\n"
            "      .venv/bin/python example_project/manage.py runserver\n"
            "    then open http://127.0.0.1:8000/admin/fair_jobs/"
        )
