"""``manage.py bench_limits``: how fast queue places come back from a dead node, and whether
a busy node's heartbeat keeps up, with real worker nodes.

Needs PostgreSQL and the broker (the same services as ``fairbench``). Two figures:

1. **Reclaim**: a node holding every place of a limited queue is killed with SIGKILL; the
   time until its places are free again (a live node on another queue reaps them), as a
   multiple of ``FAIR_JOBS_WORKER_TIMEOUT``. Repeated ``--trials`` times.
2. **Heartbeat under load**: a CPU-bound job twice as long as the timeout runs in a solo
   and in a threads node on a queue limited to 1, with a second job waiting. Reported: the
   stalest the node's heartbeat row got (as a multiple of the interval), and whether the
   waiting job ever started beside the busy one (it must not: a starved heartbeat would
   get the live node reaped and its place given away).

Both use a short timeout (``--timeout``, interval a fifth of it) so that a run is quick.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from bench.models import JobRecord
from bench.runner import BenchError, WorkerNode, check_services, delete_queue
from django_fair_jobs.db import database_now
from django_fair_jobs.models import ParkedJob, QueueLimit, SlotLease, WorkerProcess
from django_fair_jobs.queue_limits import set_limits
from example.celery import app

TASK = "bench.plain_job"


class Command(BaseCommand):
    help = "Measure reclaim time after SIGKILL and heartbeat staleness under CPU load."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--trials", type=int, default=3, help="SIGKILL trials.")
        parser.add_argument(
            "--timeout", type=float, default=5.0, help="FAIR_JOBS_WORKER_TIMEOUT for the run."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if connection.vendor != "postgresql":
            raise CommandError("bench_limits needs PostgreSQL: set DATABASE_URL=postgres://...")
        try:
            check_services()
        except BenchError as exc:
            raise CommandError(str(exc)) from None
        timeout = float(options["timeout"])
        self.env = {
            "FAIR_JOBS_WORKER_TIMEOUT": str(timeout),
            "FAIR_JOBS_HEARTBEAT_INTERVAL": str(timeout / 5),
            "FAIR_JOBS_LIMIT_PLAIN_TASKS": "true",
        }
        os.environ.update(self.env)  # this process reaps and reads with the same values
        self.run_id = uuid.uuid4().hex[:8]
        self.logs = Path(tempfile.mkdtemp(prefix="bench_limits-"))
        self.nodes: list[WorkerNode] = []
        self.queues: list[str] = []
        try:
            reclaims = [self._reclaim(i, timeout) for i in range(options["trials"])]
            ratios = [r / timeout for r in reclaims]
            self.stdout.write(
                f"Reclaim after SIGKILL (timeout {timeout:g} s, interval {timeout / 5:g} s): "
                + ", ".join(f"{r:.2f} s" for r in reclaims)
                + f"; median {statistics.median(ratios):.2f}x, worst {max(ratios):.2f}x the "
                "timeout (target: under 1.5x)."
            )
            for pool in ("solo", "threads"):
                stalest, overlapped = self._busy(pool, timeout)
                self.stdout.write(
                    f"Heartbeat under a CPU-bound job, {pool} pool: stalest "
                    f"{stalest:.2f} s = {stalest / (timeout / 5):.2f}x the interval "
                    f"({stalest / timeout:.2f}x the timeout); waiting job started beside it: "
                    f"{'YES' if overlapped else 'no'}."
                )
                if overlapped:
                    raise CommandError(f"{pool}: a live busy node was over-admitted.")
        finally:
            for node in self.nodes:
                node.kill()
            for queue in self.queues:
                delete_queue(queue)
            JobRecord.objects.filter(run=self.run_id).delete()
            SlotLease.objects.filter(queue_limit__queue__in=self.queues).delete()
            ParkedJob.objects.filter(queue_limit__queue__in=self.queues).delete()
            QueueLimit.objects.filter(queue__in=self.queues).delete()

    def _node(
        self, name: str, queue: str, pool: str = "prefork", concurrency: int = 2
    ) -> WorkerNode:
        node = WorkerNode(
            f"{name}-{self.run_id}", queue, pool, concurrency, self.logs / f"{name}.log", self.env
        )
        self.nodes.append(node)
        node.wait_ready()
        return node

    def _queue(self, name: str, limit: int) -> str:
        queue = f"bench.{self.run_id}.{name}"
        self.queues.append(queue)
        set_limits(queue, max_jobs=limit)
        return queue

    def _job(self, queue: str, job: int, seconds: float, kind: str = "sleep") -> None:
        kwargs = {
            "run": self.run_id, "mode": "limits", "job": job, "tenant": "t",
            "enqueued_at": time.time(), "seconds": seconds, "kind": kind,
        }  # fmt: skip
        app.send_task(TASK, kwargs=kwargs, queue=queue)

    def _reclaim(self, trial: int, timeout: float) -> float:
        queue = self._queue(f"reap{trial}", 2)
        self._node(f"reaper{trial}", f"bench.{self.run_id}.idle")
        victim = self._node(f"victim{trial}", queue)
        for job in range(2):
            self._job(queue, job, 600)
        self._wait(lambda: QueueLimit.objects.get(queue=queue).current_jobs == 2, 30)
        victim.kill()
        killed = time.monotonic()
        self._wait(lambda: QueueLimit.objects.get(queue=queue).current_jobs == 0, 10 * timeout)
        return time.monotonic() - killed

    def _busy(self, pool: str, timeout: float) -> tuple[float, bool]:
        queue = self._queue(f"busy-{pool}", 1)
        node = self._node(f"busy-{pool}", queue, pool=pool, concurrency=2)
        base = 100 if pool == "solo" else 200
        self._job(queue, base, 2 * timeout, kind="cpu")
        self._job(queue, base + 1, 0.01)
        runs = JobRecord.objects.filter(run=self.run_id, job__in=[base, base + 1])
        self._wait(lambda: SlotLease.objects.filter(queue_limit__queue=queue).exists(), 30)
        stalest = 0.0
        deadline = time.monotonic() + 2 * timeout + 30
        while runs.count() < 2 and time.monotonic() < deadline:
            beats = WorkerProcess.objects.filter(node__startswith=f"busy-{pool}-{self.run_id}")
            now = database_now()
            for beat in beats.values_list("last_heartbeat_at", flat=True):
                stalest = max(stalest, (now - beat).total_seconds())
            time.sleep(0.05)
        records = list(runs.order_by("job").values_list("started_at", "finished_at"))
        if len(records) < 2:
            raise CommandError(f"{pool}: the jobs did not finish; see {self.logs}")
        (s1, e1), (s2, e2) = records
        node.stop()
        return stalest, s2 < e1 and s1 < e2

    @staticmethod
    def _wait(predicate: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise CommandError("timed out waiting for the workers")
            time.sleep(0.02)
