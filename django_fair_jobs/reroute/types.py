"""The values rerouting's stores answer with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recorded:
    """The answer of recording an enqueue: the count within each rule's window (in rule
    order, the enqueue itself included) and the 0-based index of the rule that picks the
    queue (the last one whose count is above its threshold), or None."""

    counts: tuple[int, ...]
    rule: int | None


@dataclass(frozen=True)
class Deciding:
    """The job an enqueue counts for: if a rule reroutes it, its decision row (for
    explain) is stored by the same statement that counts it. ``queue`` is the declared
    queue the job was published to; ``enforced`` is False in shadow mode."""

    task_id: str
    queue: str
    enforced: bool
