"""Skews this process's wall clock by ``FAIR_JOBS_CHAOS_SKEW`` seconds (the chaos suite puts
this directory first on a worker's ``PYTHONPATH``): ``time.time``, ``time.time_ns`` and
``datetime.now``/``utcnow``/``today`` all read the skewed clock. Monotonic clocks, which
only measure intervals, are left alone, as on a machine whose clock is set wrong.

Python level, not libfaketime: libfaketime's interception of timed waits hangs Python's
``threading.Event.wait``, which Celery relies on.
"""

from __future__ import annotations

import datetime as _datetime
import os
import time as _time
from typing import Any

SKEW = float(os.environ.get("FAIR_JOBS_CHAOS_SKEW", "0"))

if SKEW:
    _real_time, _real_time_ns = _time.time, _time.time_ns
    _time.time = lambda: _real_time() + SKEW
    _time.time_ns = lambda: _real_time_ns() + int(SKEW * 1e9)
    _OFFSET = _datetime.timedelta(seconds=SKEW)

    class _SkewedDatetime(_datetime.datetime):
        __slots__ = ()  # the same layout as datetime's, which C extensions check

        @classmethod
        def now(cls, tz: _datetime.tzinfo | None = None) -> Any:
            return super().now(tz) + _OFFSET

        @classmethod
        def utcnow(cls) -> Any:
            return super().utcnow() + _OFFSET

        @classmethod
        def today(cls) -> Any:
            return super().today() + _OFFSET

    _datetime.datetime = _SkewedDatetime  # type: ignore[misc]
