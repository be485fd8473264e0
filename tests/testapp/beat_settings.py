"""Settings of the beat test's processes (tests/deploy/test_beat.py): the suite's, with
no URLs.

The suite's URLs import the suite's tasks (``tests.testapp.views``), and the system checks
a worker runs at start load the URLs: the suite's planned tasks, whose short intervals make
a worker's planner thread look every 0.2 s, would then be in the beat test's worker too.
"""

from __future__ import annotations

from typing import Any

from tests.settings import *  # noqa: F403

ROOT_URLCONF = "tests.testapp.beat_settings"
urlpatterns: list[Any] = []
"""No URLs (this module is its own URLconf)."""
