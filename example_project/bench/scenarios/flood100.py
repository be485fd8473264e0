"""``flood`` with jobs of 100 ms: the library's cost against longer jobs."""

from bench.scenario import Scenario, Stream, tenants

SCENARIO = Scenario(
    name="flood100",
    description=(
        "1 greedy tenant enqueues 600 jobs of 100 ms at t=0; 20 small tenants enqueue "
        "3 each at t=0.5 s; concurrency 4."
    ),
    concurrency=4,
    streams=(
        Stream(tenants=("greedy",), jobs=600, seconds=0.1, greedy=True),
        Stream(tenants=tenants("small", 20), jobs=3, seconds=0.1, at=0.5),
    ),
)
