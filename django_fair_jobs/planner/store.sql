-- The fair planner (mechanism C): claim a planned task's run lock.
-- PostgreSQL only, one named block each, loaded by django_fair_jobs.sql.queries().

-- name: claim_planner
-- Take a task's planner lock for a run, in one round trip: the row is created on first use,
-- and taken only if its next run is due and no run holds the lock (or the holder's TTL has
-- passed). The winner schedules the next run one interval on. Returns a row if taken.
INSERT INTO fair_jobs_plannerrun AS r
       (task_name, next_run_at, locked_until, lock_token, virtual_time, last_run_at,
        last_promoted, last_latency, last_skipped)
VALUES (%(task_name)s, now() + make_interval(secs => %(interval)s),
        now() + make_interval(secs => %(ttl)s), %(token)s, 0, now(), 0, NULL, false)
ON CONFLICT (task_name) DO UPDATE
   SET locked_until = EXCLUDED.locked_until, lock_token = EXCLUDED.lock_token,
       next_run_at = EXCLUDED.next_run_at, last_run_at = EXCLUDED.last_run_at
 WHERE r.next_run_at <= now() AND (r.locked_until IS NULL OR r.locked_until < now())
RETURNING 1;
