"""Many tenants at a steady pace; one of them turns greedy halfway through."""

from bench.scenario import Scenario, Stream, tenants

SCENARIO = Scenario(
    name="steady",
    description=(
        "24 tenants enqueue 20 jobs of 40 ms each as Poisson arrivals at 1 job/s; at "
        "t=8 s tenant-00 turns greedy and adds 800 more at 100 jobs/s; concurrency 4."
    ),
    concurrency=4,
    streams=(
        Stream(tenants=tenants("tenant", 24), jobs=20, seconds=0.04, rate=1.0),
        Stream(tenants=("tenant-00",), jobs=800, seconds=0.04, at=8.0, rate=100.0, greedy=True),
    ),
)
