"""Timing helpers shared by the ``bench_*`` commands."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(action: Callable[[], Any], repeat: int) -> float:
    """The median wall time of ``repeat`` calls of ``action``, in seconds (the median, so
    that one call slowed by the machine's other work does not move the figure)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
