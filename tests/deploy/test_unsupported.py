"""A worker refuses at start the pools and broker transports the library does not
support, saying what to use instead, rather than misbehaving at its first job."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import ROOT


def _start_worker(broker_env: dict[str, str], *options: str) -> subprocess.CompletedProcess[str]:
    """Run ``celery worker`` with ``options`` until it exits (it should not start)."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker", "-Q", "fair",
         "--without-gossip", "--without-mingle", "--without-heartbeat", *options],
        cwd=ROOT, env=broker_env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_gevent_pool__refused_at_start__prefork_or_threads_named(
    broker_env: dict[str, str],
) -> None:
    done = _start_worker(broker_env, "-P", "gevent", "-c", "2")
    assert done.returncode != 0, done.stdout + done.stderr
    assert "the gevent pool is not supported" in done.stderr
    assert "-P threads" in done.stderr
    assert " ready." not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("pool", "transport", "refused"),
    [
        ("prefork", "redis", None),
        ("prefork", "rediss", None),
        ("prefork", "sentinel", None),
        ("threads", "amqp", None),
        ("threads", "pyamqp", None),
        ("solo", "sqlalchemy", None),
        ("solo", "sqla", None),
        ("solo", "filesystem", None),
        ("celery.concurrency.prefork:TaskPool", "memory", None),
        ("eventlet", "redis", "eventlet pool"),
        ("gevent", "redis", "gevent pool"),
        # No SQS, Azure or Google broker runs here: the names are what the worker reads.
        ("prefork", "sqs", "sqs broker transport"),
        ("prefork", "kombu.transport.SQS:Transport", "sqs broker transport"),
        ("celery.concurrency.gevent:TaskPool", "redis", "gevent pool"),
        ("prefork", "azureservicebus", "azureservicebus broker transport"),
        ("prefork", "gcpubsub", "gcpubsub broker transport"),
    ],
)
def test_refuse_unsupported__by_pool_and_transport_name(
    pool: str, transport: str, refused: str | None
) -> None:
    from types import SimpleNamespace

    from django_fair_jobs.signals import refuse_unsupported

    worker = SimpleNamespace(pool_cls=pool, _conninfo=SimpleNamespace(transport_cls=transport))
    if refused is None:
        refuse_unsupported(worker)
    else:
        with pytest.raises(SystemExit, match=refused):
            refuse_unsupported(worker)


def test_unflagged_transport__allowed_for_an_app_without_fair_tasks(celery_app: Any) -> None:
    from types import SimpleNamespace

    from django_fair_jobs.signals import refuse_unsupported

    sqs = SimpleNamespace(transport_cls="sqs")
    # An app whose only task is a plain one (not a FairTask): nothing of it can park.
    only_plain = SimpleNamespace(tasks={"plain.add": SimpleNamespace(name="plain.add")})
    refuse_unsupported(SimpleNamespace(pool_cls="prefork", _conninfo=sqs, app=only_plain))
    # The suite's app has fair tasks, which can park (a worker imports them before
    # worker_init).
    celery_app.loader.import_default_modules()
    with pytest.raises(SystemExit, match="sqs broker transport"):
        refuse_unsupported(SimpleNamespace(pool_cls="prefork", _conninfo=sqs, app=celery_app))
