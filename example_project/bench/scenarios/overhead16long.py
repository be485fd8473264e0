"""``overhead16`` six times longer: the library's cost per job in the steady state."""

from bench.scenario import Scenario, Stream

SCENARIO = Scenario(
    name="overhead16long",
    description=(
        "16 tenants enqueue 750 no-op jobs each at t=0 (12,000 in all); as overhead16, but "
        "long enough that a run's start and end (workers not yet or no longer all busy) "
        "weigh little; concurrency 4."
    ),
    concurrency=4,
    # Far above the concurrency: no tenant ever waits for a slot.
    tenant_limit=1000,
    streams=(Stream(tenants=tuple(f"t{i:02}" for i in range(16)), jobs=750, seconds=0.0),),
)
