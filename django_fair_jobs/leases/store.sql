-- Leases, shared by tenant slots and queue limits: reap the leases of dead holders, put
-- woken jobs that never started back in line.
-- PostgreSQL only, one named block each, loaded by django_fair_jobs.sql.queries().

-- name: reap
-- Release the slots of leases whose holder is gone: the process has not beaten within
-- the timeout (or its row is missing), or a reservation for a woken job was never
-- claimed. Every queue and every tenant slot is covered, whoever runs it. Dead process
-- rows are deleted in the same statement (kept while fair dispatch has a running job of
-- theirs, below). Two reapers at once are safe: the second one's DELETE finds the rows
-- gone and decrements nothing. Returns ('leases', NULL, n), then ('queue', id, n) and
-- ('slot', id, n) per row released.
-- * queues: each queue row loses the reaped leases in its total and in each node's count
--   of running. Queue rows are locked before tenant rows, as in every statement.
WITH dead AS (
    -- A dead process's row is the only record of its node, which fair dispatch's reap
    -- reads (a lost pool child, or its whole node?): kept while it has a running job there.
    DELETE FROM fair_jobs_workerprocess AS p
     WHERE p.last_heartbeat_at < now() - make_interval(secs => %(timeout)s)
       AND NOT EXISTS (SELECT 1 FROM fair_jobs_dispatchjob AS j
                        WHERE j.process_id = p.id AND j.state = 3)
    RETURNING p.id
), gone AS (
    DELETE FROM fair_jobs_slotlease AS l
     WHERE (l.process_id IS NULL
            AND l.acquired_at < now() - make_interval(secs => %(timeout)s))
        OR (l.process_id IS NOT NULL
            -- A lease claimed within the timeout is spared: its new holder may have
            -- registered after this statement's snapshot was taken.
            AND l.acquired_at < now() - make_interval(secs => %(timeout)s)
            AND NOT EXISTS (
                SELECT 1 FROM fair_jobs_workerprocess AS w
                 WHERE w.id = l.process_id
                   AND w.last_heartbeat_at >= now() - make_interval(secs => %(timeout)s)))
    RETURNING l.slot_id, l.queue_limit_id, l.node_id::text AS node
), by_node AS (
    SELECT queue_limit_id, COALESCE(node, '') AS node, count(*) AS n
      FROM gone WHERE queue_limit_id IS NOT NULL GROUP BY 1, 2
), by_queue AS (
    SELECT queue_limit_id, sum(n)::int AS n, jsonb_object_agg(node, n) AS nodes
      FROM by_node GROUP BY 1
), queues AS (
    UPDATE fair_jobs_queuelimit AS q
       SET current_jobs = GREATEST(q.current_jobs - c.n, 0),
           running = COALESCE((
               SELECT jsonb_object_agg(r.key, r.value::int - COALESCE((c.nodes ->> r.key)::int, 0))
                 FROM jsonb_each_text(q.running) AS r
                WHERE r.value::int - COALESCE((c.nodes ->> r.key)::int, 0) > 0), '{}'::jsonb),
           updated_at = now()
      FROM by_queue AS c
     WHERE q.id = c.queue_limit_id
    RETURNING q.id, c.n
), counted AS (
    SELECT slot_id, count(*) AS n FROM gone WHERE slot_id IS NOT NULL GROUP BY slot_id
), ordered AS (
    -- The tenant rows in id order (after the queue rows): a process trading one slot for
    -- another (release_and_acquire) holds the lower row while it waits for the higher.
    SELECT id FROM fair_jobs_tenantqueueslot
     WHERE id IN (SELECT slot_id FROM counted) AND (SELECT count(*) FROM queues) >= 0
     ORDER BY id
       FOR NO KEY UPDATE
), slots AS (
    UPDATE fair_jobs_tenantqueueslot AS s
       SET current_jobs = GREATEST(s.current_jobs - counted.n, 0), updated_at = now()
      FROM counted
     WHERE s.id = counted.slot_id AND (SELECT count(*) FROM ordered) >= 0
    RETURNING s.id, counted.n::int AS n
)
SELECT 'leases', NULL::bigint, (SELECT count(*) FROM gone)::int
UNION ALL SELECT 'queue', id, n FROM queues
UNION ALL SELECT 'slot', id, n FROM slots
UNION ALL SELECT 'processes', NULL::bigint, (SELECT count(*) FROM dead)::int;

-- name: requeue_lost_wakes
-- A woken job that never started goes back to waiting, keeping its place: on a tenant
-- slot once its reservation was reaped (its message was lost between the wake and the
-- publish), in a queue's line (woken without a reservation) once the timeout passed.
-- A late copy of its message still starts it once: the first copy to start deletes the
-- parked row. Returns one row per tenant slot or queue touched.
WITH lost AS (
    UPDATE fair_jobs_parkedjob AS p
       SET woken_at = NULL
     WHERE p.woken_at < now() - make_interval(secs => %(timeout)s)
       AND (p.queue_limit_id IS NOT NULL
            OR NOT EXISTS (SELECT 1 FROM fair_jobs_slotlease AS l
                            WHERE l.slot_id = p.slot_id AND l.task_id = p.task_id))
    RETURNING p.slot_id, p.queue_limit_id
), queues AS (
    UPDATE fair_jobs_queuelimit AS q
       SET parked_jobs = q.parked_jobs + c.n
      FROM (SELECT queue_limit_id, count(*) AS n FROM lost
             WHERE queue_limit_id IS NOT NULL GROUP BY 1) AS c
     WHERE q.id = c.queue_limit_id
    RETURNING q.id
), ordered AS (
    -- The tenant rows in id order, after the queue rows (see reap).
    SELECT id FROM fair_jobs_tenantqueueslot
     WHERE id IN (SELECT slot_id FROM lost WHERE queue_limit_id IS NULL)
       AND (SELECT count(*) FROM queues) >= 0
     ORDER BY id
       FOR NO KEY UPDATE
), slots AS (
    UPDATE fair_jobs_tenantqueueslot AS s
       SET parked_jobs = s.parked_jobs + c.n
      FROM (SELECT slot_id, count(*) AS n FROM lost
             WHERE queue_limit_id IS NULL GROUP BY 1) AS c
     WHERE s.id = c.slot_id AND (SELECT count(*) FROM ordered) >= 0
    RETURNING s.id
)
SELECT id FROM queues UNION ALL SELECT id FROM slots;
