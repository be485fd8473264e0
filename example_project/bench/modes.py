"""The benchmark's modes: how the same scenario's jobs are run.

Each mechanism gets a mode of its own as it becomes available, plus the recommended
combination of all of them (the planner, tenant slots, rerouting and a queue limit on the
slow queue).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REROUTE_RULE: dict[str, Any] = {"threshold": 20, "per": 10}
"""The rerouting rule of the modes that reroute: a tenant's jobs past its 20th within
10 seconds go to the mode's slow queue. Steady tenants (1 job/s) stay under it; a flood
crosses it at once."""


@dataclass(frozen=True)
class Mode:
    """A way to run the jobs: which task, and what it stands for."""

    name: str
    task: str
    description: str
    reroutes: bool = False
    """True: the task's rules send a tenant past :data:`REROUTE_RULE` to
    :meth:`slow_queue`, and the workers consume both queues (the documented setup)."""

    caps_slow_queue: bool = False
    """True: the slow queue gets a queue limit of a quarter of the workers
    (:func:`slow_queue_limit`), so rerouted jobs of every tenant together never take more."""

    shadow: bool = False
    """True: the workers and the publisher run with ``FAIR_JOBS_ENFORCE = False``: every
    rule is evaluated and recorded, nothing is enforced (the cost of shadow mode)."""

    handoff: float = 0.0
    """Seconds of ``FAIR_JOBS_SLOT_HANDOFF`` for the workers (0: off): a process hands a
    finished job's slot to its next job of the same tenant."""

    async_release: bool = False
    """True: the workers run with ``FAIR_JOBS_ASYNC_RELEASE``: a slot's release commits
    without waiting for the disk."""

    opt_in: bool = False
    """True: measured only when asked for by name (``--modes``)."""

    def queue(self, run: str) -> str:
        """The Celery queue of this mode's jobs in ``run``: one per mode and run, so that
        neither modes nor benchmark runs ever share a queue."""
        return f"bench.{run}.{self.name}"

    def slow_queue(self, run: str) -> str:
        """Where the rules of a rerouting mode send a greedy tenant's jobs in ``run``."""
        return f"{self.queue(run)}.slow"

    def queues(self, run: str) -> list[str]:
        """Every queue the mode's workers consume in ``run``."""
        return [self.queue(run), self.slow_queue(run)] if self.reroutes else [self.queue(run)]

    def rules(self, run: str) -> list[dict[str, Any]]:
        """The ``fair_reroute`` of the mode's task in ``run`` (none if it does not
        reroute)."""
        return [{"queue": self.slow_queue(run), **REROUTE_RULE}] if self.reroutes else []


def slow_queue_limit(workers: int) -> int:
    """The queue limit of the slow queue in the modes that cap it: a quarter of the
    workers (at least 1), leaving the rest to the tenants that stay under the rule."""
    return max(1, workers // 4)


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("plain", "bench.plain_job", "plain Celery task (FIFO)"),
        Mode("slots", "bench.slots_job", "FairTask, tenant slots (mechanism A)"),
        Mode(
            "reroute",
            "bench.reroute_job",
            "FairTask, sliding-window rerouting only (mechanism B)",
            reroutes=True,
        ),
        Mode(
            "queue-limits",
            "bench.queue_limits_job",
            "FairTask, rerouting to a slow queue capped by a queue limit (mechanisms B + D)",
            reroutes=True,
            caps_slow_queue=True,
        ),
        Mode("planner", "bench.planner_job", "FairTask, the fair planner only (mechanism C)"),
        Mode(
            "dispatch",
            "bench.dispatch_job",
            "FairTask, fair dispatch: the next job chosen when a worker frees (recommended)",
        ),
        Mode(
            "combined",
            "bench.combined_job",
            "FairTask, planner, tenant slots, rerouting and the capped slow queue (all)",
            reroutes=True,
            caps_slow_queue=True,
        ),
        Mode(
            "slots-handoff",
            "bench.slots_job",
            "FairTask, tenant slots with slot handoff (FAIR_JOBS_SLOT_HANDOFF = 1)",
            handoff=1.0,
            opt_in=True,
        ),
        Mode(
            "slots-async",
            "bench.slots_job",
            "FairTask, tenant slots released without waiting for the disk "
            "(FAIR_JOBS_ASYNC_RELEASE)",
            async_release=True,
            opt_in=True,
        ),
        Mode(
            "slots-handoff-async",
            "bench.slots_job",
            "FairTask, tenant slots with slot handoff and asynchronous releases",
            handoff=1.0,
            async_release=True,
            opt_in=True,
        ),
        Mode(
            "shadow",
            "bench.combined_job",
            "the combined task in shadow mode: every rule evaluated and recorded, none enforced",
            reroutes=True,
            caps_slow_queue=True,
            shadow=True,
            opt_in=True,
        ),
    )
}

DEFAULT_MODES: tuple[str, ...] = tuple(name for name, m in MODES.items() if not m.opt_in)
"""The modes a run without ``--modes`` measures: shadow mode, slot handoff and asynchronous
releases are asked for by name."""

REFERENCE = "plain"
"""The mode every ratio's denominator comes from (except the ideal's)."""

RECOMMENDED = "dispatch"
"""The recommended setup: fair dispatch (one option on the task)."""
