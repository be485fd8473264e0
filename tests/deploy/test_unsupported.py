"""A worker refuses at start the pools and broker transports the library does not
support, saying what to use instead, rather than misbehaving at its first job."""

from __future__ import annotations

import subprocess
import sys

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
        ("threads", "amqp", None),
        ("solo", "sqlalchemy", None),
        ("eventlet", "redis", "eventlet pool"),
        ("gevent", "redis", "gevent pool"),
        # No SQS, Azure or Google broker runs here: the names are what the worker reads.
        ("prefork", "sqs", "sqs broker transport"),
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
