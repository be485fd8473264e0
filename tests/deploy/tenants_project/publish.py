"""Create two tenants and publish one job of each task from each tenant's schema, and one
from the public schema, where the resolver gives no tenant (it waits in the line of the jobs
without a tenant).

Run as ``python -m tests.deploy.tenants_project.publish`` with the project's settings;
prints one line per publish."""

from __future__ import annotations

import tests.deploy.tenants_project.celery_app  # noqa: F401  # django.setup(), the app

TENANTS = ("tenant_a", "tenant_b")


def main() -> None:
    """Publish, then say what the public schema's publish did."""
    from django_tenants.utils import tenant_context  # type: ignore[import-untyped]

    from django_fair_jobs.dispatch.models import DispatchJob
    from tests.deploy.tenants_project.customers.models import Client, Domain
    from tests.deploy.tenants_project.notes.tasks import ALL, dispatched_fair_first

    Client.objects.get_or_create(schema_name="public", name="public")
    for schema in TENANTS:
        client = Client.objects.create(schema_name=schema, name=schema)
        Domain.objects.create(domain=f"{schema}.example.com", tenant=client, is_primary=True)
        with tenant_context(client):
            for task in ALL:
                print(schema, task.name, task.delay(schema).id, flush=True)
    # No tenant in the public schema: the job is not refused, it waits in the line of the
    # jobs without a tenant (a countdown keeps it there for the test to see).
    held = dispatched_fair_first.apply_async(("public",), countdown=3600)
    row = DispatchJob.objects.get(task_id=held.id)
    print(f"public held: {row.tenant!r} {row.task_id}", flush=True)


if __name__ == "__main__":
    main()
