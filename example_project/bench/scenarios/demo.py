"""A short flood for the Quick start demo, sized for the embedded (SQLite) defaults."""

from bench.scenario import Scenario, Stream, tenants

SCENARIO = Scenario(
    name="demo",
    description=(
        "1 greedy tenant enqueues 60 jobs of 250 ms at t=0; 10 small tenants enqueue 2 each "
        "at t=0.5 s; concurrency 4."
    ),
    concurrency=4,
    streams=(
        Stream(tenants=("greedy",), jobs=60, seconds=0.25, greedy=True),
        Stream(tenants=tenants("small", 10), jobs=2, seconds=0.25, at=0.5),
    ),
)
