-- The statements django-fair-jobs runs on PostgreSQL, one named block each.
-- Each is a single statement (one round trip in autocommit) whose data-modifying CTEs
-- commit together. Success is judged by what the statement returns, never by a read
-- followed by a write. Other databases use the ORM path of each room's store.py instead.

-- name: acquire
-- Take a slot for a starting job, in one round trip. Returns one row: the status
-- ('held', 'full', 'duplicate' or 'stale'), the slot id when held, and the number of
-- still-waiting parked rows of the job that were removed (the caller fixes parked_jobs).
-- * woken_ok: a re-published parked job (woken) may take a new slot only while its parked
--   row exists; the first copy to start deletes it (unparked), so later copies are
--   'stale'.
-- * own: the job already has a lease on this slot whose holder is gone (a reservation
--   made for it when it was woken, or a process that stopped beating): it claims it with
--   a new token, so the old holder's release is fenced off. Never a second slot. Any copy
--   may claim it, woken or not: a dead holder's lease means the job did not finish. The
--   token in the WHERE makes a second claimant, re-checking the row after the first
--   committed, find it changed and claim nothing.
-- * live: the lease is held by a live process, or was claimed under us: 'duplicate'.
--   So is a lease that also holds a place in a limited queue (taken on the queue path):
--   only the queue path may claim it, since only its release gives the place back.
-- * taken: otherwise the slot row is created on first use (race free: ON CONFLICT) and
--   its counter incremented only while below the limit, the lease written alongside.
--   Two concurrent deliveries of one task id collide on the lease's unique key and the
--   loser's whole statement rolls back.
WITH existing AS (
    SELECT l.id, l.slot_id, l.token, l.queue_limit_id,
           (l.process_id IS NOT NULL AND EXISTS (
                SELECT 1 FROM fair_jobs_workerprocess AS w
                 WHERE w.id = l.process_id
                   AND w.last_heartbeat_at >= now() - make_interval(secs => %(timeout)s)
           )) AS live
      FROM fair_jobs_slotlease AS l
      JOIN fair_jobs_tenantqueueslot AS s ON s.id = l.slot_id
     WHERE s.tenant = %(tenant)s AND s.queue = %(queue)s AND l.task_id = %(task_id)s
), woken_ok AS (
    SELECT (NOT %(woken)s
            OR EXISTS (SELECT 1 FROM fair_jobs_parkedjob WHERE task_id = %(task_id)s)) AS ok
), own AS (
    UPDATE fair_jobs_slotlease AS l
       SET process_id = %(process_id)s, token = %(token)s, acquired_at = now()
      FROM existing AS e
     WHERE l.id = e.id AND l.token = e.token AND NOT e.live AND e.queue_limit_id IS NULL
    RETURNING l.slot_id
), taken AS (
    INSERT INTO fair_jobs_tenantqueueslot AS s
           (tenant, queue, max_jobs, default_max_jobs, current_jobs, parked_jobs,
            deferred_total, created_at, updated_at)
    SELECT %(tenant)s, %(queue)s, NULL, %(limit)s, 1, 0, 0, now(), now()
     WHERE NOT EXISTS (SELECT 1 FROM existing) AND (SELECT ok FROM woken_ok)
    ON CONFLICT (tenant, queue) DO UPDATE
       SET current_jobs = s.current_jobs + 1,
           default_max_jobs = EXCLUDED.default_max_jobs,
           updated_at = now()
     WHERE s.current_jobs < COALESCE(s.max_jobs, EXCLUDED.default_max_jobs)
    RETURNING s.id
), lease AS (
    INSERT INTO fair_jobs_slotlease (slot_id, task_id, token, process_id, acquired_at)
    SELECT id, %(task_id)s, %(token)s, %(process_id)s, now() FROM taken
    RETURNING slot_id
), held AS (
    SELECT slot_id FROM own UNION ALL SELECT slot_id FROM lease
), unparked AS (
    DELETE FROM fair_jobs_parkedjob AS p
     USING held
     WHERE p.task_id = %(task_id)s AND p.slot_id = held.slot_id
    RETURNING p.woken_at
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM held) THEN 'held'
            WHEN EXISTS (SELECT 1 FROM existing) THEN 'duplicate'
            WHEN NOT (SELECT ok FROM woken_ok) THEN 'stale'
            ELSE 'full' END,
       (SELECT slot_id FROM held),
       (SELECT count(*) FROM unparked WHERE woken_at IS NULL);

-- name: park
-- Park a job whose acquire failed, but only if the slot is still full when the row lock
-- is held: the decision is made on the latest row version, and parked_jobs is raised on
-- that same row, so a release that commits after this sees parked_jobs > 0 and wakes
-- someone, and a release that committed before leaves room and the answer is 'room'.
-- A job already waiting (a duplicate delivery) is not parked twice: 'already_parked'.
-- A re-parked woken job keeps its row, and so its place in line; a woken copy whose row
-- is gone (another copy started the job) never creates a new one: 'stale'.
WITH waiting AS (
    SELECT 1 FROM fair_jobs_parkedjob
     WHERE task_id = %(task_id)s AND woken_at IS NULL
), woken_ok AS (
    SELECT (NOT %(woken)s
            OR EXISTS (SELECT 1 FROM fair_jobs_parkedjob WHERE task_id = %(task_id)s)) AS ok
), slot AS (
    UPDATE fair_jobs_tenantqueueslot AS s
       SET parked_jobs = s.parked_jobs + 1,
           deferred_total = s.deferred_total + 1,
           updated_at = now()
     WHERE s.tenant = %(tenant)s AND s.queue = %(queue)s
       AND s.current_jobs >= COALESCE(s.max_jobs, %(limit)s)
       AND NOT EXISTS (SELECT 1 FROM waiting)
       AND (SELECT ok FROM woken_ok)
    RETURNING s.id
), parked AS (
    INSERT INTO fair_jobs_parkedjob AS p
           (slot_id, task_id, task_name, signature, default_max_jobs, parked_at, woken_at,
            wake_count)
    SELECT id, %(task_id)s, %(task_name)s, %(signature)s, %(limit)s, now(), NULL, 0 FROM slot
    ON CONFLICT (task_id) DO UPDATE
       SET woken_at = NULL, slot_id = EXCLUDED.slot_id, queue_limit_id = NULL,
           signature = EXCLUDED.signature, task_name = EXCLUDED.task_name,
           default_max_jobs = EXCLUDED.default_max_jobs
    RETURNING p.id
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM parked) THEN 'parked'
            WHEN EXISTS (SELECT 1 FROM waiting) THEN 'already_parked'
            WHEN NOT (SELECT ok FROM woken_ok) THEN 'stale'
            ELSE 'room' END;

-- name: release
-- Give a slot back, fenced by the holder: the lease is deleted only with the holder's
-- token, and the counter is decremented only if that delete found the lease. RETURNING
-- shows the latest row version (after any wait for the row lock), so a park that
-- committed first is seen in parked_jobs.
WITH gone AS (
    DELETE FROM fair_jobs_slotlease
     WHERE slot_id = %(slot_id)s AND task_id = %(task_id)s AND token = %(token)s
    RETURNING slot_id
)
UPDATE fair_jobs_tenantqueueslot AS s
   SET current_jobs = s.current_jobs - 1, updated_at = now()
  FROM gone
 WHERE s.id = gone.slot_id AND s.current_jobs > 0
RETURNING s.parked_jobs;

-- name: wake
-- Hand a free slot to the oldest waiting parked job of the slot that can use it: the slot
-- is acquired on the job's behalf (same conditional increment as acquire), a lease with no
-- process is reserved for its task id, and the row is marked woken with a new wake number
-- that the re-published message carries.
-- * The slot row is locked first (an InitPlan, before any parked row), the same order as
--   acquire and park, so wakers of one slot queue on it and never skip a job that another
--   waker held without waking.
-- * A job is picked only if there is room under its own limit (tasks sharing a queue may
--   have different limits) and its task holds no lease on the slot (a duplicate copy is
--   running), so neither can block the jobs behind it.
WITH locked AS (
    SELECT id, current_jobs, max_jobs
      FROM fair_jobs_tenantqueueslot
     WHERE id = %(slot_id)s
       FOR UPDATE
), pick AS (
    SELECT p.id, p.default_max_jobs
      FROM fair_jobs_parkedjob AS p
     WHERE p.slot_id = (SELECT id FROM locked)
       AND p.woken_at IS NULL
       AND p.queue_limit_id IS NULL
       AND (SELECT current_jobs < COALESCE(max_jobs, p.default_max_jobs) FROM locked)
       AND NOT EXISTS (SELECT 1 FROM fair_jobs_slotlease AS l
                        WHERE l.slot_id = p.slot_id AND l.task_id = p.task_id)
     ORDER BY p.id
     LIMIT 1
       FOR UPDATE
), slot AS (
    UPDATE fair_jobs_tenantqueueslot AS s
       SET current_jobs = s.current_jobs + 1,
           parked_jobs = GREATEST(s.parked_jobs - 1, 0),
           updated_at = now()
      FROM pick
     WHERE s.id = %(slot_id)s AND s.current_jobs < COALESCE(s.max_jobs, pick.default_max_jobs)
    RETURNING s.id
), woken AS (
    UPDATE fair_jobs_parkedjob AS p
       SET woken_at = now(), wake_count = p.wake_count + 1
      FROM pick, slot
     WHERE p.id = pick.id
    RETURNING p.task_id, p.signature, p.wake_count
), lease AS (
    INSERT INTO fair_jobs_slotlease (slot_id, task_id, token, process_id, acquired_at)
    SELECT %(slot_id)s, task_id, %(token)s, NULL, now() FROM woken
)
SELECT task_id, signature, wake_count FROM woken;

-- name: reap
-- Give back the slots of leases whose holder is gone: the process has not beaten within
-- the timeout (or its row is missing), or a reservation for a woken job was never
-- claimed. Every queue and every tenant slot is covered, whoever runs it. Dead process
-- rows are deleted in the same statement. Two reapers at once are safe: the second one's
-- DELETE finds the rows gone and decrements nothing. Returns ('leases', NULL, n), then
-- ('queue', id, n) and ('slot', id, n) per row given back.
-- * queues: each queue row loses the reaped leases in its total and in each node's count
--   of running. Queue rows are locked before tenant rows, as in every statement.
WITH dead AS (
    DELETE FROM fair_jobs_workerprocess
     WHERE last_heartbeat_at < now() - make_interval(secs => %(timeout)s)
    RETURNING id
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
), slots AS (
    UPDATE fair_jobs_tenantqueueslot AS s
       SET current_jobs = GREATEST(s.current_jobs - counted.n, 0), updated_at = now()
      FROM counted
     WHERE s.id = counted.slot_id AND (SELECT count(*) FROM queues) >= 0
    RETURNING s.id, counted.n::int AS n
)
SELECT 'leases', NULL::bigint, (SELECT count(*) FROM gone)::int
UNION ALL SELECT 'queue', id, n FROM queues
UNION ALL SELECT 'slot', id, n FROM slots
UNION ALL SELECT 'processes', NULL::bigint, (SELECT count(*) FROM dead)::int;

-- name: claim_maintenance
-- Every process beats, but a maintenance pass runs at most once per interval across the
-- cluster: the caller whose upsert returns a row runs it.
INSERT INTO fair_jobs_maintenance AS m (name, last_run_at)
VALUES (%(name)s, now())
ON CONFLICT (name) DO UPDATE
   SET last_run_at = now()
 WHERE m.last_run_at < now() - make_interval(secs => %(interval)s)
RETURNING 1;

-- name: rewake_lost
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
), slots AS (
    UPDATE fair_jobs_tenantqueueslot AS s
       SET parked_jobs = s.parked_jobs + c.n
      FROM (SELECT slot_id, count(*) AS n FROM lost
             WHERE queue_limit_id IS NULL GROUP BY 1) AS c
     WHERE s.id = c.slot_id AND (SELECT count(*) FROM queues) >= 0
    RETURNING s.id
)
SELECT id FROM queues UNION ALL SELECT id FROM slots;

-- name: record_enqueue
-- Count one enqueue of a tenant under a counting key and pick the rerouting rule, in one
-- round trip. Returns one row: the count within each rule's window, in rule order and the
-- current enqueue included, and the 1-based index of the LAST rule whose count is above
-- its threshold (NULL: no rule matches).
-- * counter: the (key, tenant) row is created on first use and its total incremented
--   under the row lock, so concurrent enqueues are serialized and none is lost. Its
--   second never goes back, even when a later transaction read an earlier clock.
-- * bucket: what the total was after this second's last enqueue.
-- * counts: the total minus the newest bucket before the window [second - per, second];
--   with no such bucket, nothing older is held and the whole total is in the window.
--   Only buckets at least one second old are read, two index probes per rule however
--   many enqueues the window holds.
-- * rerouted: one more job sent to the picked rule's queue.
-- Old buckets are left to prune_windows, which keeps this statement short.
WITH counter AS (
    INSERT INTO fair_jobs_tenantwindow AS w (key, tenant, total, last_second, created_at)
    VALUES (%(key)s, %(tenant)s, 1,
            floor(extract(epoch FROM COALESCE(%(at)s::timestamptz, now())))::bigint, now())
    ON CONFLICT (key, tenant) DO UPDATE
       SET total = w.total + 1,
           last_second = GREATEST(w.last_second, EXCLUDED.last_second)
    RETURNING w.id, w.total, w.last_second
), bucket AS (
    INSERT INTO fair_jobs_windowbucket AS b (window_id, second, cum)
    SELECT id, last_second, total FROM counter
    ON CONFLICT (window_id, second) DO UPDATE SET cum = GREATEST(b.cum, EXCLUDED.cum)
), counts AS (
    SELECT r.ord, r.threshold, r.queue,
           c.total - COALESCE((
               SELECT b.cum FROM fair_jobs_windowbucket AS b
                WHERE b.window_id = c.id AND b.second < c.last_second - r.per
                ORDER BY b.second DESC LIMIT 1), 0) AS n
      FROM counter AS c,
           unnest(%(pers)s::bigint[], %(thresholds)s::bigint[], %(queues)s::text[])
               WITH ORDINALITY AS r(per, threshold, queue, ord)
), picked AS (
    SELECT ord, queue FROM counts WHERE n > threshold ORDER BY ord DESC LIMIT 1
), rerouted AS (
    INSERT INTO fair_jobs_reroutecount AS rc
           (tenant, task_name, queue, total, first_at, last_at)
    SELECT %(tenant)s, %(task_name)s, queue, 1, now(), now() FROM picked
    ON CONFLICT (tenant, task_name, queue) DO UPDATE
       SET total = rc.total + 1, last_at = now()
)
SELECT (SELECT array_agg(n ORDER BY ord) FROM counts), (SELECT ord FROM picked);

-- name: prune_windows
-- Delete what the maximum window no longer needs. Returns how many windows went.
-- * idle: tenants idle for longer than the maximum window leave nothing behind: their
--   window rows with their buckets, and their reroute counts. An enqueue racing the delete
--   either committed first (the row is no longer idle when re-checked, and stays) or waits
--   for the delete and then inserts a fresh row.
-- * old: in the other windows, buckets older than the maximum window, except the newest of
--   them (the anchor), which a window of exactly the maximum length still reads. One index
--   probe per window finds it; later enqueues only read newer buckets.
WITH idle AS (
    DELETE FROM fair_jobs_tenantwindow
     WHERE last_second < floor(extract(epoch FROM now()))::bigint - %(max_window)s
    RETURNING id
), buckets AS (
    DELETE FROM fair_jobs_windowbucket WHERE window_id IN (SELECT id FROM idle)
), old AS (
    DELETE FROM fair_jobs_windowbucket AS b
     USING fair_jobs_tenantwindow AS w
     CROSS JOIN LATERAL (
         SELECT max(x.second) AS anchor FROM fair_jobs_windowbucket AS x
          WHERE x.window_id = w.id
            AND x.second < floor(extract(epoch FROM now()))::bigint - %(max_window)s
     ) AS a
     WHERE b.window_id = w.id AND b.second < a.anchor
), reroutes AS (
    DELETE FROM fair_jobs_reroutecount
     WHERE last_at < now() - make_interval(secs => %(max_window)s)
)
SELECT count(*) FROM idle;

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
-- Give back a job's place in a limited queue and its tenant slot together, fenced by the
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

-- name: dispatch_enqueue
-- Fair dispatch: store a job in its tenant's line, dispatching while the queue has room
-- (the functions are in dispatch.sql).
SELECT job_id, job_signature FROM fair_jobs_enqueue(
    %(queue)s, %(tenant)s, %(task_name)s, %(task_id)s, %(signature)s, %(not_before)s,
    %(weight)s, %(cap)s, true);

-- name: dispatch_enqueue_many
-- Fair dispatch: store many jobs (bulk_enqueue) in one round trip, then dispatch each of
-- their queues once.
SELECT job_id, job_signature FROM fair_jobs_enqueue_many(
    %(queues)s, %(tenants)s, %(task_names)s, %(task_ids)s, %(signatures)s,
    %(not_befores)s::timestamptz[], %(weights)s::double precision[], %(caps)s::integer[]);

-- name: dispatch_start
SELECT status, cap FROM fair_jobs_dispatch_start(%(job)s, %(process)s);

-- name: dispatch_end
SELECT job_id, job_signature
  FROM fair_jobs_dispatch_end(%(job)s, %(process)s, %(ended)s, %(delay)s, %(max)s);

-- name: dispatch_next
SELECT job_id, job_signature FROM fair_jobs_dispatch(%(queue)s, %(max)s);

-- name: dispatch_failures
SELECT publish_failures FROM fair_jobs_dispatchjob WHERE id = %(job)s;

-- name: dispatch_task_rows
SELECT id, process_id FROM fair_jobs_dispatchjob
 WHERE task_id = %(task_id)s AND state = ANY(%(states)s);

-- name: dispatch_orphans
-- Running jobs whose process stopped beating (or is gone).
SELECT j.id, j.process_id, j.task_name FROM fair_jobs_dispatchjob AS j
 WHERE j.state = 3 AND NOT EXISTS (
       SELECT 1 FROM fair_jobs_workerprocess AS w
        WHERE w.id = j.process_id
          AND w.last_heartbeat_at >= now() - make_interval(secs => %(timeout)s));

-- name: dispatch_lost
-- Dispatched jobs not started in time: returned to be published again, clock restarted.
UPDATE fair_jobs_dispatchjob SET dispatched_at = now()
 WHERE state = 2 AND dispatched_at < now() - make_interval(secs => %(lost_after)s)
RETURNING id, signature;

-- name: dispatch_queues_with_room
SELECT q.queue FROM fair_jobs_dispatchqueue AS q
 WHERE q.in_flight < q.capacity + q.slack ORDER BY q.queue;

-- name: dispatch_due_queues
-- Fair dispatch: which of these queues hold countdowns or ETAs that came due (a probe of
-- the partial index fair_jobs_dispatch_due per queue; nothing is read when none is due).
SELECT q.queue FROM unnest(%(queues)s::text[]) AS q(queue)
 WHERE EXISTS (SELECT 1 FROM fair_jobs_dispatchjob AS j
                WHERE j.queue = q.queue AND j.state = 0 AND j.not_before <= now())
 ORDER BY q.queue;
