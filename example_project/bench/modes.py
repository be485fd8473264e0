"""The benchmark's modes: how the same scenario's jobs are run.

Each mechanism gets a mode of its own as it becomes available, plus the recommended
combination of all of them. Today the library has one mechanism (tenant slots), which is
therefore also the recommended combination.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    """A way to run the jobs: which task, and what it stands for."""

    name: str
    task: str
    description: str

    def queue(self, run: str) -> str:
        """The Celery queue of this mode's jobs in ``run``: one per mode and run, so that
        neither modes nor benchmark runs ever share a queue."""
        return f"bench.{run}.{self.name}"


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("plain", "bench.plain_job", "plain Celery task (FIFO)"),
        Mode("slots", "bench.slots_job", "FairTask, tenant slots (mechanism A)"),
    )
}

REFERENCE = "plain"
"""The mode every ratio's denominator comes from (except the ideal's)."""

RECOMMENDED = "slots"
"""The recommended combination: every mechanism available today."""
