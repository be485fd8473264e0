-- Fair dispatch: the statements that call the functions of sql/dispatch.sql.
-- PostgreSQL only, one named block each, loaded by django_fair_jobs.sql.queries().

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

-- name: dispatch_lock_line
-- Cancel, first step: lock the tenant's line row, in the order dispatch takes its locks
-- (the line, then its jobs).
SELECT t.id FROM fair_jobs_dispatchtenant AS t
 WHERE t.queue = %(queue)s AND t.tenant = %(tenant)s
   FOR UPDATE;

-- name: dispatch_cancel
-- Cancel, second step: delete up to %(max)s of the tenant's jobs not yet dispatched
-- (scheduled or waiting) on the queue, of one task or of all (%(task_name)s NULL); the
-- line's waiting count lowers by the waiting rows deleted and its head moves to the
-- oldest waiting row left (the subquery sees the rows as before the DELETE, so it leaves
-- out the deleted ones). Returns the cancelled task ids.
WITH gone AS (
    DELETE FROM fair_jobs_dispatchjob AS j
     WHERE j.id IN (SELECT c.id FROM fair_jobs_dispatchjob AS c
                     WHERE c.queue = %(queue)s AND c.tenant = %(tenant)s AND c.state IN (0, 1)
                       AND (%(task_name)s::text IS NULL OR c.task_name = %(task_name)s)
                     ORDER BY c.id LIMIT %(max)s)
       AND j.state IN (0, 1)
    RETURNING j.id, j.task_id, j.state
), line AS (
    UPDATE fair_jobs_dispatchtenant AS t
       SET waiting = t.waiting - (SELECT count(*) FROM gone WHERE gone.state = 1),
           head_id = (SELECT min(j.id) FROM fair_jobs_dispatchjob AS j
                       WHERE j.queue = t.queue AND j.tenant = t.tenant AND j.state = 1
                         AND j.id NOT IN (SELECT gone.id FROM gone))
     WHERE t.queue = %(queue)s AND t.tenant = %(tenant)s
       AND EXISTS (SELECT 1 FROM gone)
)
SELECT task_id FROM gone;
