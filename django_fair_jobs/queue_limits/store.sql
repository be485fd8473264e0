-- Queue limits (mechanism D): acquire, park, release and wake on a limited queue.
-- PostgreSQL only, one named block each, loaded by django_fair_jobs.sql.queries().

-- name: acquire_limited
-- Take a place in a limited queue, and the tenant's slot if the job has a tenant, both
-- or neither, in one round trip. Returns one row: the status, the lease's queue row and
-- tenant slot when 'held', and the still-waiting parked rows of the job that were removed
-- (in a queue's line, on a tenant slot; the caller fixes those counters).
-- Statuses: 'held'; 'queue_full' (the queue, or its per-worker limit on this node, is at
-- its limit); 'full' (the tenant is); 'unlimited' (no row: take the tenant path);
-- 'new_tenant' (create the tenant's slot row, then try again); 'duplicate' (the job holds
-- a lease here already: postponed until that copy ends or is reaped); 'reserved' (it holds
-- a reservation made on its tenant slot before the queue was limited: drop it and try
-- again); 'stale' (a copy of a woken job another copy started).
-- * q, t: the queue row, then the tenant row, are locked first (t waits for q through its
--   WHERE), always in that order, so the verdict reads the latest counters and no other
--   statement can take a place in between. Every statement locks queue rows before
--   tenant rows, so two of them never wait for each other in a cycle.
-- * running: jobs per node id, on the queue row itself, so one lock covers both limits.
-- * queue_taken, tenant_taken, lease: written only if the verdict is 'held'; the tenant
--   row is updated after the queue row (it reads queue_taken).
WITH q AS (
    SELECT id, max_jobs, max_jobs_per_worker, current_jobs,
           COALESCE((running ->> %(node)s)::int, 0) AS on_node
      FROM fair_jobs_queuelimit
     WHERE queue = %(queue)s
       FOR UPDATE
), t AS (
    SELECT id, current_jobs, COALESCE(max_jobs, %(limit)s) AS max_jobs
      FROM fair_jobs_tenantqueueslot
     WHERE tenant = %(tenant)s AND queue = %(queue)s AND EXISTS (SELECT 1 FROM q)
       FOR UPDATE
), existing AS (
    SELECT l.process_id IS NULL AND l.queue_limit_id IS NULL AS reserved
      FROM fair_jobs_slotlease AS l
     WHERE l.task_id = %(task_id)s
       AND (l.queue_limit_id = (SELECT id FROM q) OR l.slot_id = (SELECT id FROM t))
), woken_ok AS (
    SELECT (NOT %(woken)s
            OR EXISTS (SELECT 1 FROM fair_jobs_parkedjob WHERE task_id = %(task_id)s)) AS ok
), verdict AS (
    SELECT CASE
        WHEN q.id IS NULL THEN 'unlimited'
        WHEN EXISTS (SELECT 1 FROM existing WHERE reserved) THEN 'reserved'
        WHEN EXISTS (SELECT 1 FROM existing) THEN 'duplicate'
        WHEN NOT (SELECT ok FROM woken_ok) THEN 'stale'
        WHEN %(tenant)s::text IS NOT NULL AND t.id IS NULL THEN 'new_tenant'
        WHEN q.current_jobs >= q.max_jobs OR q.on_node >= q.max_jobs_per_worker
            THEN 'queue_full'
        WHEN t.current_jobs >= t.max_jobs THEN 'full'
        ELSE 'held' END AS status
      FROM (SELECT 1) AS one LEFT JOIN q ON true LEFT JOIN t ON true
), queue_taken AS (
    UPDATE fair_jobs_queuelimit AS ql
       SET current_jobs = ql.current_jobs + 1,
           running = jsonb_set(ql.running, ARRAY[%(node)s],
                               to_jsonb(COALESCE((ql.running ->> %(node)s)::int, 0) + 1)),
           updated_at = now()
     WHERE ql.id = (SELECT id FROM q) AND (SELECT status FROM verdict) = 'held'
    RETURNING ql.id
), tenant_taken AS (
    UPDATE fair_jobs_tenantqueueslot AS s
       SET current_jobs = s.current_jobs + 1, default_max_jobs = %(limit)s, updated_at = now()
     WHERE s.id = (SELECT id FROM t) AND EXISTS (SELECT 1 FROM queue_taken)
    RETURNING s.id
), lease AS (
    INSERT INTO fair_jobs_slotlease
           (slot_id, queue_limit_id, node_id, task_id, token, process_id, acquired_at)
    SELECT (SELECT id FROM tenant_taken), id, %(node)s::uuid, %(task_id)s, %(token)s,
           %(process_id)s, now()
      FROM queue_taken
    RETURNING queue_limit_id, slot_id
), unparked AS (
    DELETE FROM fair_jobs_parkedjob AS p
     WHERE p.task_id = %(task_id)s AND EXISTS (SELECT 1 FROM lease)
    RETURNING p.woken_at, p.queue_limit_id
)
SELECT (SELECT status FROM verdict),
       (SELECT queue_limit_id FROM lease),
       (SELECT slot_id FROM lease),
       (SELECT count(*) FROM unparked WHERE woken_at IS NULL AND queue_limit_id IS NOT NULL),
       (SELECT count(*) FROM unparked WHERE woken_at IS NULL AND queue_limit_id IS NULL);

-- name: park_limited
-- Park a job of a limited queue in the queue's line, whatever blocked it (the queue, its
-- per-worker limit on this node, or the tenant), but only if it is still blocked when both
-- rows are locked (queue first, then tenant): the queue row's parked_jobs is raised under
-- its lock, and every release of the queue updates that row, so a release that commits
-- after this wakes someone and one that committed before leaves room ('room': acquire
-- again). A woken job that is parked again keeps its row, and so its place in line.
WITH waiting AS (
    SELECT 1 FROM fair_jobs_parkedjob
     WHERE task_id = %(task_id)s AND woken_at IS NULL
), woken_ok AS (
    SELECT (NOT %(woken)s
            OR EXISTS (SELECT 1 FROM fair_jobs_parkedjob WHERE task_id = %(task_id)s)) AS ok
), q AS (
    SELECT id, max_jobs, max_jobs_per_worker, current_jobs,
           COALESCE((running ->> %(node)s)::int, 0) AS on_node
      FROM fair_jobs_queuelimit
     WHERE queue = %(queue)s
       FOR UPDATE
), t AS (
    SELECT id, current_jobs, COALESCE(max_jobs, %(limit)s) AS max_jobs
      FROM fair_jobs_tenantqueueslot
     WHERE tenant = %(tenant)s AND queue = %(queue)s AND EXISTS (SELECT 1 FROM q)
       FOR UPDATE
), blocked AS (
    SELECT COALESCE(q.current_jobs >= q.max_jobs, false)
           OR COALESCE(q.on_node >= q.max_jobs_per_worker, false)
           OR COALESCE(t.current_jobs >= t.max_jobs, false) AS yes
      FROM q LEFT JOIN t ON true
), line AS (
    UPDATE fair_jobs_queuelimit AS ql
       SET parked_jobs = ql.parked_jobs + 1,
           deferred_total = ql.deferred_total + 1,
           updated_at = now()
     WHERE ql.id = (SELECT id FROM q)
       AND (SELECT yes FROM blocked)
       AND NOT EXISTS (SELECT 1 FROM waiting)
       AND (SELECT ok FROM woken_ok)
    RETURNING ql.id
), parked AS (
    INSERT INTO fair_jobs_parkedjob AS p
           (slot_id, queue_limit_id, task_id, task_name, signature, default_max_jobs,
            parked_at, woken_at, wake_count)
    SELECT (SELECT id FROM t), id, %(task_id)s, %(task_name)s, %(signature)s, %(limit)s,
           now(), NULL, 0
      FROM line
    ON CONFLICT (task_id) DO UPDATE
       SET woken_at = NULL, slot_id = EXCLUDED.slot_id,
           queue_limit_id = EXCLUDED.queue_limit_id, signature = EXCLUDED.signature,
           task_name = EXCLUDED.task_name, default_max_jobs = EXCLUDED.default_max_jobs
    RETURNING p.id
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM parked) THEN 'parked'
            WHEN EXISTS (SELECT 1 FROM waiting) THEN 'already_parked'
            WHEN NOT (SELECT ok FROM woken_ok) THEN 'stale'
            ELSE 'room' END;

-- name: release_limited
-- Release a job's place in a limited queue and its tenant slot together, fenced by the
-- holder's token. Returns no row if the lease was gone (reaped, or taken over), else the
-- parked_jobs of the queue row and of the tenant row after the release: the caller wakes
-- the queue's line (and a tenant slot's own waiters, left from before the queue was
-- limited). The tenant row is updated after the queue row (it reads queue).
WITH gone AS (
    DELETE FROM fair_jobs_slotlease
     WHERE queue_limit_id = %(queue_limit_id)s AND task_id = %(task_id)s
       AND token = %(token)s
    RETURNING slot_id, queue_limit_id, node_id::text AS node
), queue AS (
    UPDATE fair_jobs_queuelimit AS q
       SET current_jobs = GREATEST(q.current_jobs - 1, 0),
           running = CASE WHEN COALESCE((q.running ->> gone.node)::int, 0) <= 1
                          THEN q.running - gone.node
                          ELSE jsonb_set(q.running, ARRAY[gone.node],
                                         to_jsonb((q.running ->> gone.node)::int - 1)) END,
           updated_at = now()
      FROM gone
     WHERE q.id = gone.queue_limit_id
    RETURNING q.parked_jobs
), tenant AS (
    UPDATE fair_jobs_tenantqueueslot AS s
       SET current_jobs = s.current_jobs - 1, updated_at = now()
      FROM gone
     WHERE s.id = gone.slot_id AND s.current_jobs > 0 AND EXISTS (SELECT 1 FROM queue)
    RETURNING s.parked_jobs
)
SELECT (SELECT parked_jobs FROM queue), (SELECT parked_jobs FROM tenant) FROM gone;

-- name: wake_queue
-- Wake the oldest job in a limited queue's line that can start now: the queue has room
-- cluster-wide (and is not paused per worker), and the job's tenant slot has room under
-- the job's own limit, so a job blocked by its tenant never holds up the line. No place is
-- reserved: which node the message reaches is not known yet, and it takes its place (and
-- checks that node's per-worker limit) when it starts; if it cannot, it is parked again
-- with its old place. The queue row is locked first, so wakers of one queue take turns.
WITH q AS (
    SELECT id, max_jobs, max_jobs_per_worker, current_jobs
      FROM fair_jobs_queuelimit
     WHERE id = %(queue_limit_id)s
       FOR UPDATE
), pick AS (
    SELECT p.id
      FROM fair_jobs_parkedjob AS p
      LEFT JOIN fair_jobs_tenantqueueslot AS s ON s.id = p.slot_id
     WHERE p.queue_limit_id = (SELECT id FROM q)
       AND p.woken_at IS NULL
       AND (SELECT (max_jobs IS NULL OR current_jobs < max_jobs)
                   AND COALESCE(max_jobs_per_worker, 1) > 0 FROM q)
       AND (s.id IS NULL OR s.current_jobs < COALESCE(s.max_jobs, p.default_max_jobs))
     ORDER BY p.id
     LIMIT 1
       FOR UPDATE OF p
), line AS (
    UPDATE fair_jobs_queuelimit AS ql
       SET parked_jobs = GREATEST(ql.parked_jobs - 1, 0)
      FROM pick
     WHERE ql.id = (SELECT id FROM q)
    RETURNING ql.id
), woken AS (
    UPDATE fair_jobs_parkedjob AS p
       SET woken_at = now(), wake_count = p.wake_count + 1
      FROM pick, line
     WHERE p.id = pick.id
    RETURNING p.task_id, p.signature, p.wake_count
)
SELECT task_id, signature, wake_count FROM woken;
