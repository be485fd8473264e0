-- Fair dispatch's statements (PostgreSQL), calling sql/dispatch.sql; loaded by sql.queries().

-- name: dispatch_enqueue
-- Store a job in its tenant's line, dispatching while the queue has room.
-- by: the negative number the enqueue drew (its receipt): sent again after a lost reply
-- (again), the same statement answers with what its first try did.
SELECT job_id, job_message FROM fair_jobs_enqueue(
    %(queue)s, %(tenant)s, %(task_name)s, %(task_id)s, %(message)s, %(delay)s,
    %(not_before)s, %(weight)s, %(cap)s, %(on_loss)s::smallint, true, %(by)s, %(again)s);

-- name: dispatch_stage
-- Inside the caller's transaction: the jobs' rows alone, aside (state 0) and due at once
-- (or at their countdown or ETA), so that they commit with the caller's data and lock
-- nothing another step waits for. The dispatch after the commit (or the due poll) puts
-- them in their lines.
INSERT INTO fair_jobs_dispatchjob
       (queue, tenant, task_name, task_id, message, state, not_before, enqueued_at,
        publish_failures, republished, cap, weight, on_loss)
SELECT j.queue, j.tenant, j.task_name, j.task_id, j.message, 0,
       COALESCE(j.not_before, now() + make_interval(secs => j.delay)), now(), 0, 0,
       j.cap, j.weight, j.on_loss
  FROM unnest(%(queues)s::text[], %(tenants)s::text[], %(task_names)s::text[],
              %(task_ids)s::text[], %(messages)s::text[], %(delays)s::double precision[],
              %(not_befores)s::timestamptz[], %(weights)s::double precision[],
              %(caps)s::integer[], %(on_losses)s::smallint[])
       AS j(queue, tenant, task_name, task_id, message, delay, not_before, weight, cap,
            on_loss)
RETURNING id;

-- name: dispatch_enqueue_many
-- Store many jobs (bulk_enqueue) in one round trip, then dispatch each of their queues once.
SELECT job_id, job_message FROM fair_jobs_enqueue_many(
    %(queues)s, %(tenants)s, %(task_names)s, %(task_ids)s, %(messages)s,
    %(delays)s::double precision[], %(not_befores)s::timestamptz[],
    %(weights)s::double precision[], %(caps)s::integer[], %(on_losses)s::smallint[]);

-- name: dispatch_start
-- With async_commit (FAIR_JOBS_DISPATCH_ASYNC_COMMIT, the start a transaction of its own)
-- its commit does not wait for the WAL flush: set_config(..., true) lasts until that
-- commit. A crash of the server may lose it; dispatch_confirm_beat and dispatch_restart
-- make it again at the process's next heartbeat.
SELECT s.status, s.cap,
       CASE WHEN %(async_commit)s THEN set_config('synchronous_commit', 'off', true) END
  FROM fair_jobs_dispatch_start(%(job)s, %(process)s) AS s;

-- name: dispatch_start_ending
-- A start that carries the ends its process has not flushed yet (the jobs it ran before
-- this one): the start first (its job's row; a job back in its line has every line taken
-- in order before, fair_jobs_dispatch_lock_lines, and one that went back after that
-- check is left there, this copy a duplicate), then the ends as one flush of many
-- (their rows, then their lines, then each queue's room dispatched), so one round trip
-- and one commit serve both. Each call takes the one before it as an argument, which
-- makes them run in this order, whatever the plan. One row per job to publish, or one
-- with NULLs.
SELECT s.status, s.cap, e.job_id, e.job_message,
       CASE WHEN %(async_commit)s THEN set_config('synchronous_commit', 'off', true) END
  FROM fair_jobs_dispatch_lock_lines(ARRAY[%(job)s]::bigint[], %(jobs)s::bigint[]) AS l
 CROSS JOIN LATERAL fair_jobs_dispatch_start(
       CASE WHEN l IS NOT NULL THEN %(job)s END, %(process)s, l) AS s
  LEFT JOIN LATERAL fair_jobs_dispatch_end_many(
       CASE WHEN s.status IS NOT NULL THEN %(jobs)s::bigint[] END, %(process)s, %(max)s
  ) AS e ON true;

-- name: dispatch_restart
-- Make again the starts of a process that did not wait for the disk, in job order: a
-- start a crash lost left its row dispatched (or back in its line), and the start runs it
-- here again. The others (running here, or ended and gone: most of them) are only looked
-- up by their key, nothing called or written. ended: the ends the same transaction makes
-- again after it, whose lines are taken in order with those of jobs back in their lines.
SELECT s.status
  FROM fair_jobs_dispatch_lock_lines(%(jobs)s::bigint[], %(ended)s::bigint[]) AS l
 CROSS JOIN fair_jobs_dispatchjob AS j
 CROSS JOIN LATERAL fair_jobs_dispatch_start(
       CASE WHEN l IS NOT NULL THEN j.id END, %(process)s) AS s
 WHERE j.id = ANY(%(jobs)s::bigint[]) AND j.state IN (1, 2)
 ORDER BY j.id;

-- name: dispatch_confirm_beat
-- The process's row, written by a commit that waits for the disk even where the session's
-- default does not: WAL is flushed in order, so every commit of the process that did not
-- wait (a start, an end) and came before it is on disk once it returns. No row (the
-- process was reaped): nothing is written, nothing is confirmed.
UPDATE fair_jobs_workerprocess SET last_heartbeat_at = now()
 WHERE id = %(process)s
RETURNING CASE WHEN current_setting('synchronous_commit') = 'off'
               THEN set_config('synchronous_commit', 'local', true) END;

-- name: dispatch_end
SELECT job_id, job_message
  FROM fair_jobs_dispatch_end(%(job)s, %(process)s, %(outcome)s, %(delay)s, %(block)s,
                              %(max)s, %(again)s);

-- name: dispatch_end_many
-- With async_commit, as dispatch_start: confirmed (made again) at the next heartbeat. The
-- setting is made on the left of an outer join, so once whether or not the room went to
-- any job (one row with NULLs then).
SELECT e.job_id, e.job_message
  FROM (SELECT CASE WHEN %(async_commit)s
                    THEN set_config('synchronous_commit', 'off', true) END) AS c(off)
  LEFT JOIN LATERAL fair_jobs_dispatch_end_many(%(jobs)s::bigint[], %(process)s, %(max)s,
                                                %(again)s) AS e ON true;

-- name: dispatch_next
-- by: the negative number the dispatch drew (a job's id is positive), kept on each job
-- it dispatches (dispatched_by) for dispatch_sent_again.
SELECT job_id, job_message FROM fair_jobs_dispatch(%(queue)s, %(max)s, %(by)s);

-- name: dispatch_sent_again
-- A dispatch sent again after its reply was lost: the jobs its first try dispatched that
-- have not started (never published), found by its number among the queue's jobs in
-- flight (the partial index fair_jobs_dispatch_flight).
SELECT j.id, j.message FROM fair_jobs_dispatchjob AS j
 WHERE j.queue = %(queue)s AND j.state = 2 AND j.dispatched_by = %(by)s
 ORDER BY j.id;

-- name: dispatch_make_lines
-- The lines of tenants whose due jobs have none yet (jobs stored inside their caller's
-- transaction for a new tenant), in a statement of its own that holds nothing else, made
-- in byte order (COLLATE "C", as enqueue_many and end_many take lines, whatever the
-- database's collation), so that its inserts wait for no one out of order; the next
-- dispatch moves the jobs in.
INSERT INTO fair_jobs_dispatchtenant AS t
       (queue, tenant, weight, cap, waiting, in_flight, pass_value, served_pass, head_id,
        dispatched_total, blocked)
SELECT %(queue)s, x.tenant, 1.0, NULL, 0, 0, fair_jobs_dispatch_vt(%(queue)s), 0, NULL, 0,
       false
  FROM (SELECT DISTINCT j.tenant COLLATE "C" AS tenant FROM fair_jobs_dispatchjob AS j
         WHERE j.queue = %(queue)s AND j.state = 0 AND j.not_before <= now()
           AND NOT EXISTS (SELECT 1 FROM fair_jobs_dispatchtenant AS l
                            WHERE l.queue = j.queue AND l.tenant = j.tenant)
         ORDER BY 1) AS x
ON CONFLICT (queue, tenant) DO NOTHING
RETURNING t.id;

-- name: dispatch_failures
SELECT publish_failures FROM fair_jobs_dispatchjob WHERE id = %(job)s;

-- name: dispatch_task_rows
SELECT id, process_id FROM fair_jobs_dispatchjob
 WHERE task_id = %(task_id)s AND state = ANY(%(states)s);

-- name: dispatch_orphans
-- Running jobs whose process stopped beating (or is gone), and whether each goes back to
-- its line, as Celery would redeliver it: a task with acks_late and
-- reject_on_worker_lost (on_loss 2) always; one with acks_late alone (on_loss 1) only when
-- its whole node is gone (the broker redelivers an unacknowledged message then; a lost
-- pool child's job is acknowledged and fails).
SELECT j.id, j.process_id,
       j.on_loss = 2 OR (j.on_loss = 1 AND NOT EXISTS (
           SELECT 1 FROM fair_jobs_workerprocess AS dead
             JOIN fair_jobs_workerprocess AS alive ON alive.node_id = dead.node_id
            WHERE dead.id = j.process_id AND alive.id <> dead.id
              AND alive.last_heartbeat_at >= now() - make_interval(secs => %(timeout)s)))
  FROM fair_jobs_dispatchjob AS j
 WHERE j.state = 3 AND NOT EXISTS (
       SELECT 1 FROM fair_jobs_workerprocess AS w
        WHERE w.id = j.process_id
          AND w.last_heartbeat_at >= now() - make_interval(secs => %(timeout)s));

-- name: dispatch_lost
-- Dispatched jobs not started in time, on queues with live capacity: their message may be
-- lost (a purged queue, a publisher that died); returned to be published again. Each copy
-- doubles the wait before the next (at most 64 times lost_after), so a message that is
-- only slow (behind a long job, prefetched by a busy node) is not copied every pass. The
-- wait counts from the server's start at the earliest: a crash of the server may have lost
-- the start of a job that runs (FAIR_JOBS_DISPATCH_ASYNC_COMMIT), and its process makes it
-- again at its next heartbeat, normally well within lost_after.
UPDATE fair_jobs_dispatchjob AS j SET dispatched_at = now(), republished = j.republished + 1
 WHERE j.state = 2
   AND greatest(j.dispatched_at, pg_postmaster_start_time()) < now() - make_interval(
           secs => %(lost_after)s * power(2, LEAST(j.republished, 6)))
   AND EXISTS (SELECT 1 FROM fair_jobs_dispatchqueue AS q
                WHERE q.queue = j.queue AND q.capacity > 0)
RETURNING j.id, j.message;

-- name: dispatch_queues_with_room
SELECT q.queue FROM fair_jobs_dispatchqueue AS q
 WHERE fair_jobs_dispatch_room(q.queue) > 0
   AND EXISTS (SELECT 1 FROM fair_jobs_dispatchjob AS j
                WHERE j.queue = q.queue AND j.state IN (0, 1))
 ORDER BY q.queue;

-- name: dispatch_room
-- How many more jobs each queue may have in flight now (fair_jobs_dispatch_room).
SELECT q.queue, fair_jobs_dispatch_room(q.queue) FROM fair_jobs_dispatchqueue AS q
 ORDER BY q.queue;

-- name: dispatch_in_flight
-- Jobs dispatched or running per queue, counted from their rows.
SELECT j.queue, count(*) FROM fair_jobs_dispatchjob AS j
 WHERE j.state IN (2, 3) GROUP BY j.queue ORDER BY j.queue;

-- name: dispatch_set_capacity
-- One queue's capacity, slack and live nodes, written by maintenance alone, each queue in
-- a statement of its own (no transaction holds two queues' rows). Returns the queue if
-- its room grew.
WITH old AS (
    SELECT q.capacity + q.slack AS room FROM fair_jobs_dispatchqueue AS q
     WHERE q.queue = %(queue)s
)
INSERT INTO fair_jobs_dispatchqueue AS q (queue, capacity, slack, nodes, updated_at)
VALUES (%(queue)s, %(capacity)s, %(slack)s, %(nodes)s, now())
ON CONFLICT (queue) DO UPDATE
   SET capacity = excluded.capacity, slack = excluded.slack, nodes = excluded.nodes,
       updated_at = now()
 WHERE (q.capacity, q.slack, q.nodes)
       IS DISTINCT FROM (excluded.capacity, excluded.slack, excluded.nodes)
RETURNING q.queue, q.capacity + q.slack > COALESCE((SELECT room FROM old), 0) AS grew;

-- name: dispatch_unblock
-- Lines kept out of the selection whose room came back (fair_jobs_dispatch_free: below
-- their cap, the tenant slot's max_jobs, else the task's; their tenant slot, if any, not
-- full). Returns their queues. A line another step holds is skipped, not waited for (an
-- end unblocks its line itself; the maintenance pass takes the rest).
WITH freed AS (
    SELECT t.id FROM fair_jobs_dispatchtenant AS t
     WHERE t.blocked
       AND (%(tenant)s::text IS NULL OR t.tenant = %(tenant)s)
       AND (%(queue)s::text IS NULL OR t.queue = %(queue)s)
       AND fair_jobs_dispatch_free(t.queue, t.tenant, t.in_flight, t.cap)
     ORDER BY t.id
       FOR UPDATE OF t SKIP LOCKED
)
UPDATE fair_jobs_dispatchtenant AS t SET blocked = false
  FROM freed WHERE t.id = freed.id
RETURNING t.queue;

-- name: dispatch_recount
SELECT queue, tenant, waiting_was, waiting, in_flight_was, in_flight
  FROM fair_jobs_dispatch_recount();

-- name: dispatch_due_queues
-- Fair dispatch: which of these queues have jobs to dispatch now: countdowns or ETAs that
-- came due (a probe of the partial index fair_jobs_dispatch_due), or a line with jobs
-- waiting (a probe of fair_jobs_dispatch_next) while the queue has room. The second finds
-- the room an end left while an enqueue was committing: neither saw the other, so neither
-- dispatched. The room is counted only for a queue with a line waiting.
SELECT q.queue FROM unnest(%(queues)s::text[]) AS q(queue)
 WHERE EXISTS (SELECT 1 FROM fair_jobs_dispatchjob AS j
                WHERE j.queue = q.queue AND j.state = 0 AND j.not_before <= now())
    OR (EXISTS (SELECT 1 FROM fair_jobs_dispatchtenant AS t
                 WHERE t.queue = q.queue AND t.head_id IS NOT NULL AND NOT t.blocked)
        AND fair_jobs_dispatch_room(q.queue) > 0)
 ORDER BY q.queue;

-- name: dispatch_lock_line
-- Cancel, first step: lock the tenant's line row, in the lock order of every step that
-- takes waiting jobs (the line, then its jobs). A tenant with jobs stored inside their
-- caller's transaction may have no line yet, nor one with only failed jobs (a failed job
-- put back meanwhile goes to its line): it is made here, as dispatch_make_lines would, so
-- that no dispatch makes it and moves the jobs in while the cancel runs.
INSERT INTO fair_jobs_dispatchtenant AS t
       (queue, tenant, weight, cap, waiting, in_flight, pass_value, served_pass, head_id,
        dispatched_total, blocked)
SELECT %(queue)s::text, %(tenant)s::text, 1.0, NULL, 0, 0,
       fair_jobs_dispatch_vt(%(queue)s::text), 0, NULL, 0, false
 WHERE EXISTS (SELECT 1 FROM fair_jobs_dispatchjob AS j
                WHERE j.queue = %(queue)s::text AND j.tenant = %(tenant)s::text
                  AND j.state IN (0, 1, 4))
ON CONFLICT (queue, tenant) DO UPDATE SET blocked = t.blocked
RETURNING t.id;

-- name: dispatch_cancel
-- Cancel, second step: delete up to %(max)s of the tenant's jobs not yet dispatched
-- (scheduled or waiting) or failed (in no line, holding no room) on the queue, of one
-- task or of all (%(task_name)s NULL); the line's waiting count lowers by the waiting rows
-- deleted and its head moves to the oldest waiting row left (the subquery sees the rows
-- as before the DELETE, so it leaves out the deleted ones). Returns the cancelled task
-- ids and whether each had failed, oldest first.
WITH gone AS (
    DELETE FROM fair_jobs_dispatchjob AS j
     WHERE j.id IN (SELECT c.id FROM fair_jobs_dispatchjob AS c
                     WHERE c.queue = %(queue)s AND c.tenant = %(tenant)s AND c.state IN (0, 1, 4)
                       AND (%(task_name)s::text IS NULL OR c.task_name = %(task_name)s)
                     ORDER BY c.id LIMIT %(max)s)
       AND j.state IN (0, 1, 4)
    RETURNING j.id, j.task_id, j.state
), line AS (
    UPDATE fair_jobs_dispatchtenant AS t
       SET waiting = t.waiting - (SELECT count(*) FROM gone WHERE gone.state = 1),
           (head_id, cap) = (SELECT j.id, j.cap FROM fair_jobs_dispatchjob AS j
                              WHERE j.queue = t.queue AND j.tenant = t.tenant AND j.state = 1
                                AND j.id NOT IN (SELECT gone.id FROM gone)
                              ORDER BY j.id LIMIT 1)
     WHERE t.queue = %(queue)s AND t.tenant = %(tenant)s
       AND EXISTS (SELECT 1 FROM gone)
)
SELECT task_id, state = 4 AS failed FROM gone ORDER BY id;
