-- Tenant slots (mechanism A): take a slot at a job's start, park a job whose tenant is
-- at its limit, give the slot back, wake the oldest parked job.
-- PostgreSQL only, one named block each, loaded by django_fair_jobs.sql.queries().

-- name: acquire
-- Take a slot for a starting job, in one round trip. Returns one row: the status
-- ('held', 'full', 'duplicate' or 'stale'), the slot id when held, the number of
-- still-waiting parked rows of the job that were removed (the caller fixes parked_jobs),
-- and whether a newly taken slot left room to spare (below the limit, nobody parked): only
-- such a slot may be kept for the process's next job (hand_over).
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
    RETURNING s.id, s.current_jobs < COALESCE(s.max_jobs, %(limit)s) AND s.parked_jobs = 0
              AS spare
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
       (SELECT count(*) FROM unparked WHERE woken_at IS NULL),
       COALESCE((SELECT spare FROM taken), false);

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
-- committed first is seen in parked_jobs. With async_commit (FAIR_JOBS_ASYNC_RELEASE, and
-- only as a transaction of its own) the release commits without waiting for its WAL to
-- reach the disk: set_config(..., true) lasts until that commit. A crash of the server
-- may lose it; confirm_releases finds out and releases the slot again.
WITH gone AS (
    DELETE FROM fair_jobs_slotlease
     WHERE slot_id = %(slot_id)s AND task_id = %(task_id)s AND token = %(token)s
    RETURNING slot_id
)
UPDATE fair_jobs_tenantqueueslot AS s
   SET current_jobs = s.current_jobs - 1, updated_at = now()
  FROM gone
 WHERE s.id = gone.slot_id AND s.current_jobs > 0
RETURNING s.parked_jobs,
          CASE WHEN %(async_commit)s THEN set_config('synchronous_commit', 'off', true) END;

-- name: confirm_releases
-- Make this process's asynchronous releases durable, and redo those a crash of the server
-- lost. Each given lease (slot, task id, token) still there was released by a commit that
-- never reached the disk: it is deleted and its slot's counter decremented, fenced by the
-- token as in release. The statement also refreshes the process's heartbeat, so that it
-- writes and its own commit waits for the WAL flush, which covers every commit that came
-- before it: every release it found gone is then on disk. Returns a row per slot released
-- again (its id and parked_jobs), or one with NULLs, each with whether the process row was
-- there (0: reaped, nothing confirmed).
WITH held(slot_id, task_id, token) AS (
    SELECT * FROM unnest(%(slot_ids)s::bigint[], %(task_ids)s::text[], %(tokens)s::uuid[])
), gone AS (
    DELETE FROM fair_jobs_slotlease AS l
     USING held AS h
     WHERE l.slot_id = h.slot_id AND l.task_id = h.task_id AND l.token = h.token
    RETURNING l.slot_id
), ordered AS (
    -- Several slot rows: locked in id order, as every statement that holds two does.
    SELECT id FROM fair_jobs_tenantqueueslot
     WHERE id IN (SELECT slot_id FROM gone)
     ORDER BY id
       FOR NO KEY UPDATE
), freed AS (
    UPDATE fair_jobs_tenantqueueslot AS s
       SET current_jobs = greatest(s.current_jobs - g.n, 0), updated_at = now()
      FROM (SELECT slot_id, count(*)::int AS n FROM gone GROUP BY slot_id) AS g
     WHERE s.id = g.slot_id AND (SELECT count(*) FROM ordered) >= 0
    RETURNING s.id, s.parked_jobs
), beat AS (
    UPDATE fair_jobs_workerprocess SET last_heartbeat_at = now()
     WHERE id = %(process_id)s
    RETURNING id
), durable AS (
    -- The commit waits for the disk even where the session's default does not.
    SELECT CASE WHEN current_setting('synchronous_commit') = 'off'
                THEN set_config('synchronous_commit', 'local', true) END AS was_off
)
SELECT (SELECT count(*) FROM beat), f.id, f.parked_jobs, d.was_off
  FROM durable AS d LEFT JOIN freed AS f ON true;

-- name: hand_over
-- Hand the slot a process kept from its finished job (FAIR_JOBS_SLOT_HANDOFF) to the next
-- job it starts of the same tenant and queue, in one statement instead of a release and an
-- acquire: the lease is renamed to the new task id under a new token, so the finished
-- job's release is fenced off, and the counter is left as it is (one slot, held all along).
-- The slot row is read, not locked or written (no wait on a hot tenant row). No row: the
-- caller releases the kept slot (waking a parked job) and acquires as usual. That is the
-- answer when jobs are parked on the slot (they go first), when the slot is over its
-- limit (lowered meanwhile), or when the new job already has a lease or a parked row (a
-- duplicate copy, which acquire tells apart). A copy of the job that takes a lease on the
-- slot meanwhile collides on the lease's unique key, and this statement rolls back.
-- Returns the slot id, and whether the slot has room to spare (see acquire).
UPDATE fair_jobs_slotlease AS l
   SET task_id = %(task_id)s, token = %(token)s, acquired_at = now()
  FROM fair_jobs_tenantqueueslot AS s
 WHERE l.slot_id = %(slot_id)s AND l.task_id = %(held_task_id)s AND l.token = %(held_token)s
   AND l.queue_limit_id IS NULL
   AND s.id = l.slot_id
   AND s.parked_jobs = 0
   AND s.current_jobs <= COALESCE(s.max_jobs, %(limit)s)
   AND NOT EXISTS (SELECT 1 FROM fair_jobs_slotlease AS d
                    WHERE d.slot_id = l.slot_id AND d.task_id = %(task_id)s)
   AND NOT EXISTS (SELECT 1 FROM fair_jobs_parkedjob AS p WHERE p.task_id = %(task_id)s)
RETURNING l.slot_id, s.current_jobs < COALESCE(s.max_jobs, %(limit)s);

-- name: release_and_acquire
-- Release the slot a process kept from its finished job (FAIR_JOBS_SLOT_HANDOFF) and take
-- a slot of another tenant or queue for the next job it starts, in one statement instead
-- of two: release's and acquire's CTEs (see each), one transaction. The caller never
-- passes the kept slot's own tenant and queue (one row would be updated twice; hand_over
-- serves that case).
-- * locked: both slot rows are locked in id order (an InitPlan of the writes that lock a
--   slot row or come after one), so two processes trading slots the other way round queue
--   on the lower row instead of deadlocking, each holding the row the other waits for.
--   Statements that write several slot rows (reap, requeue_lost_wakes, confirm_releases)
--   lock them in id order too. The slot to take may have no row yet: acquire's INSERT
--   creates it.
-- * The rows are locked in the order lease, slots, parked job, as release and reap (lease
--   before slot) and park and wake (slot before parked job) do: a woken job's claim of its
--   lease (own) comes first, its parked row (unparked) only once the slots are locked.
-- * A copy of the next job taking a lease meanwhile collides on the lease's unique key
--   and the whole statement rolls back, the release with it: the caller releases alone.
-- Returns acquire's row, then the released slot's parked_jobs (NULL: the kept lease was
-- gone, nothing released).
WITH locked AS (
    SELECT id FROM fair_jobs_tenantqueueslot
     WHERE id = %(held_slot_id)s OR (tenant = %(tenant)s AND queue = %(queue)s)
     ORDER BY id
       FOR NO KEY UPDATE
), gone AS (
    DELETE FROM fair_jobs_slotlease
     WHERE slot_id = %(held_slot_id)s AND task_id = %(held_task_id)s
       AND token = %(held_token)s
    RETURNING slot_id
), freed AS (
    UPDATE fair_jobs_tenantqueueslot AS s
       SET current_jobs = s.current_jobs - 1, updated_at = now()
      FROM gone
     WHERE s.id = gone.slot_id AND s.current_jobs > 0
       AND (SELECT count(*) FROM locked) >= 0
    RETURNING s.parked_jobs
), existing AS (
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
       AND (SELECT count(*) FROM locked) >= 0
    ON CONFLICT (tenant, queue) DO UPDATE
       SET current_jobs = s.current_jobs + 1,
           default_max_jobs = EXCLUDED.default_max_jobs,
           updated_at = now()
     WHERE s.current_jobs < COALESCE(s.max_jobs, EXCLUDED.default_max_jobs)
    RETURNING s.id, s.current_jobs < COALESCE(s.max_jobs, %(limit)s) AND s.parked_jobs = 0
              AS spare
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
       AND (SELECT count(*) FROM locked) >= 0
    RETURNING p.woken_at
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM held) THEN 'held'
            WHEN EXISTS (SELECT 1 FROM existing) THEN 'duplicate'
            WHEN NOT (SELECT ok FROM woken_ok) THEN 'stale'
            ELSE 'full' END,
       (SELECT slot_id FROM held),
       (SELECT count(*) FROM unparked WHERE woken_at IS NULL),
       COALESCE((SELECT spare FROM taken), false),
       (SELECT parked_jobs FROM freed);

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
