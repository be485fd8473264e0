"""Tasks of both class orders, dispatched (a ``FairTask`` without options) and planned
(``fair_plan``); none takes its tenant from its arguments: the resolver gives the schema."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.db import connection
from tenant_schemas_celery.task import TenantTask  # type: ignore[import-untyped]

from django_fair_jobs import tenants
from django_fair_jobs.task import FairTask
from tests.deploy.tenants_project.notes.models import Note

PLAN = {"enqueue_interval": 0.5, "enqueue_jobs": 10}


class FairThenTenant(FairTask, TenantTask):  # type: ignore[misc]
    """``FairTask`` first in the bases."""

    abstract = True


class TenantThenFair(TenantTask, FairTask):  # type: ignore[misc]
    """``TenantTask`` first in the bases."""

    abstract = True


def _note(task: Any, kind: str) -> None:
    # The type checker reads the suite's settings, where this app is not installed.
    Note._default_manager.create(
        task=task.name.rsplit(".", 1)[-1],
        schema=connection.schema_name,  # type: ignore[attr-defined]  # django-tenants' backend
        tenant=tenants.request_tenant(task, (kind,), {}) or "",
    )


@shared_task(base=FairThenTenant, bind=True)
def dispatched_fair_first(self: Any, kind: str) -> None:
    """Fair dispatch (no options), ``FairTask`` first."""
    _note(self, kind)


@shared_task(base=TenantThenFair, bind=True)
def dispatched_tenant_first(self: Any, kind: str) -> None:
    """Fair dispatch (no options), ``TenantTask`` first."""
    _note(self, kind)


@shared_task(base=FairThenTenant, bind=True, fair_plan=PLAN)
def planned_fair_first(self: Any, kind: str) -> None:
    """Planned, ``FairTask`` first."""
    _note(self, kind)


@shared_task(base=TenantThenFair, bind=True, fair_plan=PLAN)
def planned_tenant_first(self: Any, kind: str) -> None:
    """Planned, ``TenantTask`` first."""
    _note(self, kind)


ALL = (dispatched_fair_first, dispatched_tenant_first, planned_fair_first, planned_tenant_first)
"""Every task of the project."""
