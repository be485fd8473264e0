"""Product imports: the same work as a plain Celery task and as a fair one."""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task

from django_fair_jobs import FairTask
from shop.models import ImportRun


def _import(mode: str, merchant: str, enqueued_at: float, seconds: float) -> None:
    run = ImportRun.objects.create(
        mode=mode, tenant=merchant, enqueued_at=enqueued_at, started_at=time.time()
    )
    time.sleep(seconds)  # stands in for parsing and saving a product file
    ImportRun.objects.filter(pk=run.pk).update(finished_at=time.time())


class PerMerchant(FairTask):
    """Imports are fair per merchant: at most 2 of one merchant's imports at once."""

    fair_max_jobs = 2

    @classmethod
    def fair_tenant(cls, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs.get("merchant")


@shared_task(queue="imports_plain")
def plain_import(merchant: str, enqueued_at: float, seconds: float) -> None:
    """A plain Celery task: FIFO, one merchant can take every worker."""
    _import("plain", merchant, enqueued_at, seconds)


@shared_task(base=PerMerchant, queue="imports")
def fair_import(merchant: str, enqueued_at: float, seconds: float) -> None:
    """The same import as a FairTask."""
    _import("fair", merchant, enqueued_at, seconds)
