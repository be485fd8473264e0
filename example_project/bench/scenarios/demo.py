"""A short flood for the Quick start demo, sized for the embedded (SQLite) defaults."""

from bench.scenario import Scenario, Stream, tenants

SCENARIO = Scenario(
    name="demo",
    description=(
        "1 greedy tenant enqueues 80 jobs of 100 ms at t=0; 10 small tenants enqueue 2 each "
        "at t=0.5 s; concurrency 4."
    ),
    concurrency=4,
    streams=(
        Stream(tenants=("greedy",), jobs=80, seconds=0.1, greedy=True),
        Stream(tenants=tenants("small", 10), jobs=2, seconds=0.1, at=0.5),
    ),
)
