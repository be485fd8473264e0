-- Fair dispatch on PostgreSQL: one function per step of a job, so that each step is one
-- round trip (one statement in autocommit, one transaction). A migration installs the
-- block and records its digest (FUNCTIONS_DIGEST); a change here ships as a new migration
-- that installs it again, and tests/dispatch/test_functions.py fails until one does.
-- The statements that call them are named blocks of dispatch/store.sql.
--
-- Lock order. No step locks or writes a row shared by a whole queue: a queue's room is
-- read (its capacity, written by maintenance only, less the jobs in flight, counted).
--   0. An enqueue's receipt, before anything else: its key is new, and only a second try
--      of the same enqueue (after a lost reply) waits for it.
--   1. A dispatched or running job's row, then its tenant's line (start, end).
--   2. A tenant's line, then its scheduled or waiting jobs (enqueue, the due step, the
--      selection, cancel, the start of a job that went back to its line).
--   3. A limited queue's dispatch turn (fair_jobs_dispatch), last: whoever holds it waits
--      for no line (SKIP LOCKED) and no row a waiter holds.
-- A step waits only for the line of its own job; any other line is taken with SKIP LOCKED
-- (skipped, never waited for). Two steps wait for several lines, enqueue_many and
-- end_many, and take them in (queue, tenant) order by byte value (COLLATE "C", the order
-- Python sorts them in). Every function runs with a lock_timeout of 2 s: a wait the order
-- allows is short, and a longer one fails fast (the caller tries again).
-- States: 0 scheduled (a countdown not yet due, or stored inside its caller's transaction
-- and not yet in its line), 1 waiting, 2 dispatched, 3 running, 4 failed (never published).

-- name: functions

-- The virtual time of p_queue: the highest pass at which a tenant was served (each line
-- keeps the pass of its last service), the stride floor at which a tenant whose line was
-- empty re-enters, so that it banks no credit for its idle time. One index probe.
-- PL/pgSQL, not SQL, here and in fair_jobs_dispatch_room: PL/pgSQL keeps its plans for the
-- session, while a SQL function called from PL/pgSQL is planned again at every call
-- (before PostgreSQL 18), which cost more than the rest of a dispatch.
CREATE OR REPLACE FUNCTION fair_jobs_dispatch_vt(p_queue text)
RETURNS double precision
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT COALESCE(max(t.served_pass), 0.0) FROM fair_jobs_dispatchtenant AS t
             WHERE t.queue = p_queue);
END;
$$;

-- Whether a line may be chosen with p_in_flight jobs in flight and the cap p_cap of its
-- head's task: below its tenant slot's max_jobs (which overrides the task's cap), else
-- below p_cap, and its tenant slot (if any) not full. Lines that fail it are blocked, out
-- of the selection's index; dispatch_unblock puts them back by it, and each step that
-- moves a line's head other than by a dispatch (the due step, an older job's enqueue, a
-- start from the line, a cancel) sets blocked by it for the new head's cap; the due step
-- keeps a block the fence made (a line blocked though its old head's cap left room).
CREATE OR REPLACE FUNCTION fair_jobs_dispatch_free(
    p_queue text, p_tenant text, p_in_flight integer, p_cap integer
)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_slot record;
BEGIN
    SELECT s.max_jobs, s.current_jobs INTO v_slot FROM fair_jobs_tenantqueueslot AS s
     WHERE s.tenant = p_tenant AND s.queue = p_queue;
    IF NOT FOUND THEN
        RETURN p_cap IS NULL OR p_in_flight < p_cap;
    END IF;
    RETURN p_in_flight < COALESCE(v_slot.max_jobs, p_cap, p_in_flight + 1)
       AND v_slot.current_jobs < COALESCE(v_slot.max_jobs, p_cap, v_slot.current_jobs + 1);
END;
$$;

-- How many more jobs p_queue may have in flight now: its live capacity plus slack, less
-- its jobs dispatched or running (counted from their rows, a few at most), bounded by its
-- queue limit and its per-worker limit times its live nodes; a paused queue has none. The
-- queue limit's places taken count every job that holds one (current_jobs) and every
-- job in flight that holds none: dispatched, started before its fence takes its place,
-- or ended with its place released and its end not yet flushed. A lease is matched to
-- the running row of its task id and process (a retry's new row shares the task id, and
-- a copy the reap put back may run again elsewhere), counted once. Nothing is locked:
-- two concurrent dispatches of a queue without a limit may both see the same room (a
-- small overshoot of the slack); those of a limited queue take turns (fair_jobs_dispatch).
CREATE OR REPLACE FUNCTION fair_jobs_dispatch_room(p_queue text)
RETURNS integer
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (
        WITH flight AS (
            SELECT count(*) AS in_flight
              FROM fair_jobs_dispatchjob AS j
             WHERE j.queue = p_queue AND j.state IN (2, 3)
        )
        SELECT GREATEST(LEAST(
                   q.capacity + q.slack - f.in_flight,
                   CASE WHEN l.max_jobs IS NOT NULL THEN
                       l.max_jobs - l.current_jobs - f.in_flight
                       + (SELECT count(*) FROM fair_jobs_slotlease AS s
                           WHERE s.queue_limit_id = l.id
                             AND EXISTS (SELECT 1 FROM fair_jobs_dispatchjob AS j
                                          WHERE j.task_id = s.task_id AND j.queue = p_queue
                                            AND j.state = 3
                                            AND j.process_id = s.process_id))
                   END,
                   q.nodes * l.max_jobs_per_worker - f.in_flight), 0)::integer
          FROM fair_jobs_dispatchqueue AS q
         CROSS JOIN flight AS f
          LEFT JOIN fair_jobs_queuelimit AS l ON l.queue = q.queue
         WHERE q.queue = p_queue);
END;
$$;

-- Move p_queue's jobs that came due (countdowns, ETAs, jobs stored inside their caller's
-- transaction) into their lines, each line taken with SKIP LOCKED before its jobs: a line
-- another step holds keeps its due jobs for the next dispatch. It creates no line (an
-- INSERT waits for any transaction that changed the same key, here another tenant's
-- line): a job stored inside its caller's transaction for a tenant with no line yet gets
-- one from dispatch_make_lines, which the dispatch after the commit runs first.
CREATE OR REPLACE FUNCTION fair_jobs_dispatch_due(p_queue text)
RETURNS void
LANGUAGE plpgsql SET lock_timeout = '2s' AS $$
DECLARE
    v_tenants text[];
    v_vt double precision;
BEGIN
    SELECT array_agg(DISTINCT j.tenant) INTO v_tenants
      FROM fair_jobs_dispatchjob AS j
     WHERE j.queue = p_queue AND j.state = 0 AND j.not_before <= now();
    IF v_tenants IS NULL THEN
        RETURN;
    END IF;
    v_vt := fair_jobs_dispatch_vt(p_queue);
    WITH locked AS (
        SELECT t.id, t.tenant FROM fair_jobs_dispatchtenant AS t
         WHERE t.queue = p_queue AND t.tenant = ANY(v_tenants)
         ORDER BY t.id
           FOR UPDATE SKIP LOCKED
    ), due AS (
        UPDATE fair_jobs_dispatchjob AS j SET state = 1
          FROM locked
         WHERE j.queue = p_queue AND j.tenant = locked.tenant AND j.state = 0
           AND j.not_before <= now()
        RETURNING j.tenant, j.id, j.cap, j.weight
    ), moved AS (
        SELECT due.tenant, count(*) AS n, min(due.id) AS first_id,
               (array_agg(due.cap ORDER BY due.id))[1] AS first_cap,
               (array_agg(due.weight ORDER BY due.id DESC)
                   FILTER (WHERE due.weight IS NOT NULL))[1] AS weight
          FROM due GROUP BY due.tenant
    )
    UPDATE fair_jobs_dispatchtenant AS t
       SET waiting = t.waiting + m.n,
           head_id = CASE WHEN t.head_id IS NULL OR m.first_id < t.head_id
                          THEN m.first_id ELSE t.head_id END,
           cap = CASE WHEN t.head_id IS NULL OR m.first_id < t.head_id
                      THEN m.first_cap ELSE t.cap END,
           -- A line blocked though its old head's cap left it room was blocked by the
           -- fence (a refused job, come due now): it stays blocked until its room comes
           -- back, or the job would go round the broker to the same refusal.
           blocked = CASE WHEN t.head_id IS NULL OR m.first_id < t.head_id
                          THEN NOT fair_jobs_dispatch_free(p_queue, t.tenant, t.in_flight,
                                                           m.first_cap)
                               OR (t.blocked AND fair_jobs_dispatch_free(
                                       p_queue, t.tenant, t.in_flight, t.cap))
                          ELSE t.blocked END,
           pass_value = CASE WHEN t.head_id IS NULL THEN GREATEST(t.pass_value, v_vt)
                             ELSE t.pass_value END,
           weight = COALESCE(m.weight, t.weight)
      FROM moved AS m
     WHERE t.queue = p_queue AND t.tenant = m.tenant;
END;
$$;

-- Dispatch up to p_max jobs of p_queue while it has room: each to the tenant with jobs
-- waiting that has the fewest jobs in flight per weight, then the lowest virtual time,
-- then the oldest job, and that is below its cap (its tenant slot's max_jobs override, or
-- the cap of the task of its oldest job). A line found at its cap is marked blocked, which
-- takes it out of the selection's index until its room comes back (an end of its jobs, a
-- limit changed, the maintenance pass), so the choice stays one index probe however many
-- tenants cannot be chosen. Returns the jobs to publish. Due jobs join their lines first.
-- p_by: the job whose end made the room (an end's step), or the negative number a
-- dispatch that is not an end's drew (an enqueue's too); kept on each job dispatched
-- (dispatched_by), so that the step sent again after a lost reply finds them. NULL for a
-- bulk enqueue's dispatch. p_ended_line, p_ended: a line its caller holds whose count in
-- flight is p_ended too high (the jobs of an end, not yet taken off) and which, by its
-- true count, its caller found first in the selection's index: it is chosen first,
-- without the selection (which would lock the index's first line for nothing), and one
-- update of it says the end and the dispatch, instead of two new versions of it (each an
-- entry in every index of the line table); if it is not dispatched into (no room, at its
-- cap, its head gone), the end's update is made on its own.
CREATE OR REPLACE FUNCTION fair_jobs_dispatch(
    p_queue text, p_max integer, p_by bigint DEFAULT NULL, p_ended_line bigint DEFAULT NULL,
    p_ended integer DEFAULT 0
)
RETURNS TABLE (job_id bigint, job_message text)
LANGUAGE plpgsql SET lock_timeout = '2s' AS $$
DECLARE
    v_room integer;
    v_line fair_jobs_dispatchtenant%ROWTYPE;
    v_slot integer;
    v_limit integer;
    v_less integer := CASE WHEN p_ended_line IS NULL THEN 0 ELSE p_ended END;
BEGIN
    -- The probe alone, not the call: a call costs more than the probe, and most
    -- dispatches find nothing due.
    IF EXISTS (SELECT 1 FROM fair_jobs_dispatchjob AS j
                WHERE j.queue = p_queue AND j.state = 0 AND j.not_before <= now()) THEN
        PERFORM fair_jobs_dispatch_due(p_queue);
    END IF;
    -- A queue with a limit: its dispatches take turns (a lock of the transaction keyed by
    -- the queue, no row), and the room is read after the turn is taken, so two at once
    -- never both fill what the limit leaves (the fence would refuse the excess).
    IF EXISTS (SELECT 1 FROM fair_jobs_queuelimit AS l WHERE l.queue = p_queue) THEN
        PERFORM pg_advisory_xact_lock(1718773348, hashtext(p_queue));
    END IF;
    v_room := LEAST(COALESCE(fair_jobs_dispatch_room(p_queue), 0), p_max);
    WHILE v_room > 0 LOOP
        IF v_less > 0 THEN
            -- The ended line, which the caller holds and found first by its true count:
            -- taken without the selection, which would lock the index's first line.
            SELECT t.* INTO v_line FROM fair_jobs_dispatchtenant AS t
             WHERE t.id = p_ended_line AND t.head_id IS NOT NULL;
            IF NOT FOUND THEN
                -- Its head left meanwhile (cancelled): the end's update on its own.
                UPDATE fair_jobs_dispatchtenant AS t
                   SET in_flight = GREATEST(t.in_flight - v_less, 0), blocked = false
                 WHERE t.id = p_ended_line;
                v_less := 0;
                CONTINUE;
            END IF;
            v_line.in_flight := GREATEST(v_line.in_flight - v_less, 0);
        ELSE
            SELECT t.* INTO v_line FROM fair_jobs_dispatchtenant AS t
             WHERE t.queue = p_queue AND t.head_id IS NOT NULL AND NOT t.blocked
             ORDER BY floor(t.in_flight / t.weight), t.pass_value, t.head_id
             LIMIT 1
               FOR UPDATE OF t SKIP LOCKED;
            EXIT WHEN NOT FOUND;
        END IF;
        SELECT s.max_jobs INTO v_slot FROM fair_jobs_tenantqueueslot AS s
         WHERE s.tenant = v_line.tenant AND s.queue = p_queue;
        v_limit := COALESCE(v_slot, v_line.cap);
        IF v_limit IS NOT NULL AND v_line.in_flight >= v_limit THEN
            UPDATE fair_jobs_dispatchtenant AS t
               SET blocked = true, in_flight = GREATEST(t.in_flight - v_less, 0)
             WHERE t.id = v_line.id;
            v_less := 0;
            CONTINUE;
        END IF;
        -- One statement: the head job is dispatched and its line moves on to its oldest
        -- other waiting job (the statement's snapshot still sees the head as waiting).
        WITH taken AS (
            UPDATE fair_jobs_dispatchjob AS j
               SET state = 2, dispatched_at = now(), dispatched_by = p_by
             WHERE j.id = v_line.head_id AND j.state = 1
            RETURNING j.id, j.message
        ), following AS (
            SELECT j.id, j.cap FROM fair_jobs_dispatchjob AS j
             WHERE j.queue = p_queue AND j.tenant = v_line.tenant AND j.state = 1
               AND j.id <> v_line.head_id
             ORDER BY j.id LIMIT 1
        )
        UPDATE fair_jobs_dispatchtenant AS t
           SET in_flight = GREATEST(t.in_flight - v_less, 0) + 1,
               waiting = t.waiting - 1,
               pass_value = t.pass_value + 1.0 / t.weight,
               served_pass = t.pass_value,
               dispatched_total = t.dispatched_total + 1,
               head_id = f.id,
               cap = f.cap,
               blocked = COALESCE(GREATEST(t.in_flight - v_less, 0) + 1
                                  >= COALESCE(v_slot, f.cap), false)
          FROM taken LEFT JOIN following AS f ON true
         WHERE t.id = v_line.id
        RETURNING taken.id, taken.message INTO job_id, job_message;
        IF NOT FOUND THEN
            -- A head that left the line another way (cancelled): recount, go on.
            UPDATE fair_jobs_dispatchtenant AS t
               SET (head_id, cap) = (SELECT j.id, j.cap FROM fair_jobs_dispatchjob AS j
                                      WHERE j.queue = t.queue AND j.tenant = t.tenant
                                        AND j.state = 1 ORDER BY j.id LIMIT 1),
                   waiting = (SELECT count(*) FROM fair_jobs_dispatchjob AS j
                               WHERE j.queue = t.queue AND j.tenant = t.tenant AND j.state = 1),
                   in_flight = GREATEST(t.in_flight - v_less, 0),
                   blocked = t.blocked AND v_less = 0
             WHERE t.id = v_line.id;
            v_less := 0;
            CONTINUE;
        END IF;
        v_less := 0;
        RETURN NEXT;
        v_room := v_room - 1;
    END LOOP;
    IF v_less > 0 THEN
        UPDATE fair_jobs_dispatchtenant AS t
           SET in_flight = GREATEST(t.in_flight - v_less, 0), blocked = false
         WHERE t.id = p_ended_line;
    END IF;
END;
$$;

-- Store a job in its tenant's line (or aside, with a countdown or ETA not yet due: its due
-- time is the database's now() plus p_delay seconds, or p_not_before) and, if p_dispatch,
-- dispatch while the queue has room. Waits only for its own tenant's line, which an older
-- job may reach after a newer one (its id drawn first, its commit later): it then leads.
-- Returns the jobs to publish. p_by: the negative number the enqueue drew, its receipt (a
-- first try inserts it plainly: a number taken raises), kept on each job its dispatch
-- takes (dispatched_by); NULL, none (bulk_enqueue). Sent again after a lost reply
-- (p_again), it answers with the jobs its first try dispatched that have not started,
-- found by the receipt whatever became of its job since, and waits on its key (up to the
-- lock_timeout) while that try has not committed.
CREATE OR REPLACE FUNCTION fair_jobs_enqueue(
    p_queue text, p_tenant text, p_task_name text, p_task_id text, p_message text,
    p_delay double precision, p_not_before timestamptz, p_weight double precision,
    p_cap integer, p_on_loss smallint, p_dispatch boolean, p_by bigint DEFAULT NULL,
    p_again boolean DEFAULT false
)
RETURNS TABLE (job_id bigint, job_message text)
LANGUAGE plpgsql SET lock_timeout = '2s' AS $$
DECLARE
    v_id bigint;
    v_not_before timestamptz := COALESCE(
        p_not_before,
        CASE WHEN p_delay > 0 THEN now() + make_interval(secs => p_delay) END);
    v_due boolean := v_not_before IS NULL OR v_not_before <= now();
BEGIN
    IF p_by IS NOT NULL AND NOT p_again THEN
        INSERT INTO fair_jobs_dispatchreceipt (drawn, stored_at) VALUES (p_by, now());
    ELSIF p_by IS NOT NULL THEN
        INSERT INTO fair_jobs_dispatchreceipt (drawn, stored_at) VALUES (p_by, now())
        ON CONFLICT (drawn) DO NOTHING;
        IF NOT FOUND THEN
            RETURN QUERY SELECT j.id, j.message FROM fair_jobs_dispatchjob AS j
                          WHERE j.queue = p_queue AND j.state = 2 AND j.dispatched_by = p_by
                          ORDER BY j.id;
            RETURN;
        END IF;
    END IF;
    INSERT INTO fair_jobs_dispatchjob
           (queue, tenant, task_name, task_id, message, state, not_before, enqueued_at,
            publish_failures, republished, cap, weight, on_loss)
    VALUES (p_queue, p_tenant, p_task_name, p_task_id, p_message,
            CASE WHEN v_due THEN 1 ELSE 0 END, v_not_before, now(), 0, 0, p_cap,
            p_weight, p_on_loss)
    RETURNING id INTO v_id;
    -- The line: updated if it exists (most enqueues), else created; an insert another
    -- enqueue's made first (ON CONFLICT) is updated on the next turn. Only a line that
    -- was empty reads the queue's virtual time (the CASE calls it for that branch only):
    -- an enqueue behind a head leaves its pass as it was.
    LOOP
        UPDATE fair_jobs_dispatchtenant AS t
           SET waiting = t.waiting + CASE WHEN v_due THEN 1 ELSE 0 END,
               head_id = CASE WHEN v_due AND (t.head_id IS NULL OR v_id < t.head_id)
                              THEN v_id ELSE t.head_id END,
               cap = CASE WHEN v_due AND (t.head_id IS NULL OR v_id < t.head_id)
                          THEN p_cap ELSE t.cap END,
               blocked = CASE WHEN v_due AND (t.head_id IS NULL OR v_id < t.head_id)
                              THEN NOT fair_jobs_dispatch_free(p_queue, p_tenant,
                                                               t.in_flight, p_cap)
                              ELSE t.blocked END,
               pass_value = CASE WHEN v_due AND t.head_id IS NULL
                                 THEN GREATEST(t.pass_value, fair_jobs_dispatch_vt(p_queue))
                                 ELSE t.pass_value END,
               weight = COALESCE(p_weight, t.weight)
         WHERE t.queue = p_queue AND t.tenant = p_tenant;
        EXIT WHEN FOUND;
        INSERT INTO fair_jobs_dispatchtenant
               (queue, tenant, weight, cap, waiting, in_flight, pass_value, served_pass,
                head_id, dispatched_total, blocked)
        VALUES (p_queue, p_tenant, COALESCE(p_weight, 1.0), CASE WHEN v_due THEN p_cap END,
                CASE WHEN v_due THEN 1 ELSE 0 END, 0,
                CASE WHEN v_due THEN fair_jobs_dispatch_vt(p_queue) ELSE 0 END, 0,
                CASE WHEN v_due THEN v_id END, 0,
                -- A new line under a tenant slot is blocked by the rule (the probe alone,
                -- not the call, for the tenants without one).
                v_due AND EXISTS (SELECT 1 FROM fair_jobs_tenantqueueslot AS s
                                   WHERE s.tenant = p_tenant AND s.queue = p_queue)
                      AND NOT fair_jobs_dispatch_free(p_queue, p_tenant, 0, p_cap))
        ON CONFLICT (queue, tenant) DO NOTHING;
        EXIT WHEN FOUND;
    END LOOP;
    IF p_dispatch AND v_due THEN
        RETURN QUERY SELECT d.job_id, d.job_message
                       FROM fair_jobs_dispatch(p_queue, 1000, p_by) AS d;
    END IF;
END;
$$;

-- Store many jobs in their lines in one call (bulk_enqueue), then dispatch each queue
-- they went to once, while it has room. The caller sorts the jobs by queue and tenant, so
-- that two calls take their lines in the same order. Returns the jobs to publish.
CREATE OR REPLACE FUNCTION fair_jobs_enqueue_many(
    p_queues text[], p_tenants text[], p_task_names text[], p_task_ids text[],
    p_messages text[], p_delays double precision[], p_not_befores timestamptz[],
    p_weights double precision[], p_caps integer[], p_on_losses smallint[]
)
RETURNS TABLE (job_id bigint, job_message text)
LANGUAGE plpgsql SET lock_timeout = '2s' AS $$
DECLARE
    v_queue text;
BEGIN
    FOR i IN 1 .. COALESCE(array_length(p_queues, 1), 0) LOOP
        PERFORM 1 FROM fair_jobs_enqueue(
            p_queues[i], p_tenants[i], p_task_names[i], p_task_ids[i], p_messages[i],
            p_delays[i], p_not_befores[i], p_weights[i], p_caps[i], p_on_losses[i], false);
    END LOOP;
    FOR v_queue IN SELECT DISTINCT q.queue FROM unnest(p_queues) AS q(queue) ORDER BY 1 LOOP
        RETURN QUERY SELECT d.job_id, d.job_message FROM fair_jobs_dispatch(v_queue, 1000) AS d;
    END LOOP;
END;
$$;

-- Before a statement that starts p_starts and ends p_ends (a start carrying ends, the
-- heartbeat's confirmation): if one job to start is back in its line, whose start takes
-- that line, take every line the statement writes first, in (queue, tenant) order by
-- byte value, after the rows of the jobs to end still in flight (order 1: one the reap
-- put back in its line is a waiting job's row, taken after its line, and end_many
-- leaves it) and before the rows of the jobs to start from their lines (order 2), and
-- return true. Else take nothing and return false: a dispatched job's start takes no
-- line, and end_many takes its lines in order. The steps after it take the result as an
-- argument, so that they run after it.
CREATE OR REPLACE FUNCTION fair_jobs_dispatch_lock_lines(p_starts bigint[], p_ends bigint[])
RETURNS boolean
LANGUAGE plpgsql SET lock_timeout = '2s' AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM fair_jobs_dispatchjob AS j
                    WHERE j.id = ANY(p_starts) AND j.state = 1) THEN
        RETURN false;
    END IF;
    PERFORM 1 FROM fair_jobs_dispatchjob AS j
     WHERE j.id = ANY(p_ends) AND j.state IN (2, 3) ORDER BY j.id
       FOR UPDATE;
    PERFORM 1 FROM fair_jobs_dispatchtenant AS t
     WHERE (t.queue, t.tenant) IN (SELECT j.queue, j.tenant FROM fair_jobs_dispatchjob AS j
                                    WHERE j.id = ANY(p_starts || p_ends))
     ORDER BY t.queue COLLATE "C", t.tenant COLLATE "C"
       FOR UPDATE OF t;
    RETURN true;
END;
$$;

-- A dispatched job starts: it is running now, under p_process ("started"). A copy of a
-- job that went back to its line (its worker was presumed dead) starts it from there, its
-- line locked first. A job already running under p_process answers "again": this
-- process's own start whose reply was lost, or a second copy delivered to it (the caller
-- knows which). Any other copy is a "duplicate" and must not run. p_from_line false (a
-- start carrying ends whose fair_jobs_dispatch_lock_lines took no line: its job was
-- dispatched then): a job that went back to its line since is left there, to be
-- dispatched again, and this copy is a "duplicate"; taking the line now, then the ended
-- jobs' lines, would wait out of order. Returns the status and the cap the fence keeps:
-- the tenant slot's max_jobs override, else the job's own task's.
CREATE OR REPLACE FUNCTION fair_jobs_dispatch_start(
    p_job bigint, p_process uuid, p_from_line boolean DEFAULT true)
RETURNS TABLE (status text, cap integer)
LANGUAGE plpgsql SET lock_timeout = '2s' AS $$
DECLARE
    v_job record;
    v_status text := 'started';
BEGIN
    UPDATE fair_jobs_dispatchjob AS j
       SET state = 3, process_id = p_process, started_at = now()
     WHERE j.id = p_job AND j.state = 2
    RETURNING j.queue, j.tenant, j.cap INTO v_job;
    IF NOT FOUND THEN
        SELECT j.queue, j.tenant, j.cap, j.state, j.process_id INTO v_job
          FROM fair_jobs_dispatchjob AS j WHERE j.id = p_job;
        IF NOT FOUND OR v_job.state NOT IN (1, 3)
           OR (v_job.state = 3 AND v_job.process_id IS DISTINCT FROM p_process)
           OR (v_job.state = 1 AND NOT p_from_line) THEN
            RETURN QUERY SELECT 'duplicate'::text, NULL::integer;
            RETURN;
        END IF;
        IF v_job.state = 3 THEN
            v_status := 'again';
        ELSE
            PERFORM 1 FROM fair_jobs_dispatchtenant AS t
             WHERE t.queue = v_job.queue AND t.tenant = v_job.tenant FOR UPDATE;
            UPDATE fair_jobs_dispatchjob AS j
               SET state = 3, process_id = p_process, started_at = now()
             WHERE j.id = p_job AND j.state = 1;
            IF NOT FOUND THEN
                RETURN QUERY SELECT 'duplicate'::text, NULL::integer;
                RETURN;
            END IF;
            UPDATE fair_jobs_dispatchtenant AS t
               SET waiting = t.waiting - 1, in_flight = t.in_flight + 1,
                   head_id = h.id, cap = h.cap,
                   blocked = h.id IS NOT NULL AND NOT fair_jobs_dispatch_free(
                       t.queue, t.tenant, t.in_flight + 1, h.cap)
              FROM (SELECT 1) AS one
              LEFT JOIN LATERAL (SELECT j.id, j.cap FROM fair_jobs_dispatchjob AS j
                                  WHERE j.queue = v_job.queue AND j.tenant = v_job.tenant
                                    AND j.state = 1 ORDER BY j.id LIMIT 1) AS h ON true
             WHERE t.queue = v_job.queue AND t.tenant = v_job.tenant;
        END IF;
    END IF;
    RETURN QUERY
        SELECT v_status, COALESCE(
            (SELECT s.max_jobs FROM fair_jobs_tenantqueueslot AS s
              WHERE s.tenant = v_job.tenant AND s.queue = v_job.queue),
            v_job.cap)::integer;
END;
$$;

-- Take a job out of flight. p_outcome: 'end' deletes it (it ended), 'back' puts it at the
-- head of its line, 'later' aside for p_delay seconds, 'failed' in the failed state (its
-- publish failed for good), 'unregistered' too (the worker that received it had no task
-- of its name: no failed publish, not counted in publish_failures); failure says which.
-- Fenced by p_process for a running job (a worker presumed dead cannot end the job a
-- second time); p_process NULL acts on a dispatched job (its publish failed, or its
-- message was revoked). p_block keeps its line out of the selection until its room comes
-- back (the fence refused the job). Then dispatch up to p_max jobs into the room it left.
-- p_again: sent again after an error; if the job is out of flight already (the first try
-- committed and its reply was lost), return the jobs that try dispatched and that have
-- not started, whose messages were never published.
CREATE OR REPLACE FUNCTION fair_jobs_dispatch_end(
    p_job bigint, p_process uuid, p_outcome text, p_delay double precision,
    p_block boolean, p_max integer, p_again boolean DEFAULT false
)
RETURNS TABLE (job_id bigint, job_message text)
LANGUAGE plpgsql SET lock_timeout = '2s' AS $$
DECLARE
    v_job record;
    v_back boolean := p_outcome = 'back';
BEGIN
    IF p_outcome = 'end' THEN
        DELETE FROM fair_jobs_dispatchjob AS j
         WHERE j.id = p_job
           AND ((p_process IS NULL AND j.state = 2)
                OR (j.state = 3 AND j.process_id = p_process))
        RETURNING j.queue, j.tenant, j.cap INTO v_job;
    ELSE
        UPDATE fair_jobs_dispatchjob AS j
           SET state = CASE WHEN p_outcome = 'back' THEN 1
                            WHEN p_outcome IN ('failed', 'unregistered') THEN 4 ELSE 0 END,
               failure = CASE p_outcome WHEN 'failed' THEN 'publish'
                                        WHEN 'unregistered' THEN 'unregistered' ELSE '' END,
               not_before = CASE WHEN p_outcome = 'later'
                                 THEN now() + make_interval(secs => p_delay)
                                 ELSE j.not_before END,
               process_id = NULL, dispatched_at = NULL, started_at = NULL,
               publish_failures = j.publish_failures
                                  + CASE WHEN p_process IS NULL AND p_outcome <> 'unregistered'
                                         THEN 1 ELSE 0 END
         WHERE j.id = p_job
           AND ((p_process IS NULL AND j.state = 2)
                OR (j.state = 3 AND j.process_id = p_process))
        RETURNING j.queue, j.tenant, j.cap INTO v_job;
    END IF;
    IF NOT FOUND THEN
        IF p_again THEN
            RETURN QUERY SELECT j.id, j.message FROM fair_jobs_dispatchjob AS j
                          WHERE j.state = 2 AND j.dispatched_by = p_job ORDER BY j.id;
        END IF;
        RETURN;
    END IF;
    UPDATE fair_jobs_dispatchtenant AS t
       SET in_flight = GREATEST(t.in_flight - 1, 0),
           waiting = t.waiting + CASE WHEN v_back THEN 1 ELSE 0 END,
           head_id = CASE WHEN v_back AND (t.head_id IS NULL OR p_job < t.head_id)
                          THEN p_job ELSE t.head_id END,
           cap = CASE WHEN v_back AND (t.head_id IS NULL OR p_job < t.head_id)
                      THEN v_job.cap ELSE t.cap END,
           blocked = p_block
     WHERE t.queue = v_job.queue AND t.tenant = v_job.tenant;
    IF p_max > 0 THEN
        RETURN QUERY SELECT d.job_id, d.job_message
                       FROM fair_jobs_dispatch(v_job.queue, p_max, p_job) AS d;
    END IF;
END;
$$;

-- End many jobs that ran under p_process (a process's ends, flushed together by its
-- flusher thread): their rows go, their lines' counts drop, then each queue they left
-- dispatches up to p_max jobs into its room (the jobs of one line that comes first: its
-- count drops in the dispatch's own update of it). The job rows first, then their lines in
-- (queue, tenant) order by byte value, as enqueue_many takes them, so two flushes or a
-- flush and a bulk enqueue never wait for each other out of order. A job not running
-- under p_process (ended already, or reaped) is skipped. Returns the jobs to publish.
-- p_again: as in fair_jobs_dispatch_end, for the jobs already ended.
CREATE OR REPLACE FUNCTION fair_jobs_dispatch_end_many(
    p_jobs bigint[], p_process uuid, p_max integer, p_again boolean DEFAULT false
)
RETURNS TABLE (job_id bigint, job_message text)
LANGUAGE plpgsql SET lock_timeout = '2s' AS $$
DECLARE
    v_queues text[];
    v_tenants text[];
    v_counts integer[];
    v_queue text;
    v_gone integer;
    v_line bigint;
BEGIN
    WITH gone AS (
        DELETE FROM fair_jobs_dispatchjob AS j
         WHERE j.id = ANY(p_jobs) AND j.state = 3 AND j.process_id = p_process
        RETURNING j.queue, j.tenant
    ), lines AS (
        SELECT g.queue, g.tenant, count(*)::integer AS n FROM gone AS g GROUP BY 1, 2
    )
    SELECT array_agg(l.queue ORDER BY l.queue COLLATE "C", l.tenant COLLATE "C"),
           array_agg(l.tenant ORDER BY l.queue COLLATE "C", l.tenant COLLATE "C"),
           array_agg(l.n ORDER BY l.queue COLLATE "C", l.tenant COLLATE "C"),
           COALESCE(sum(l.n), 0)
      INTO v_queues, v_tenants, v_counts, v_gone FROM lines AS l;
    IF p_again AND v_gone < cardinality(p_jobs) THEN
        -- Sent again after a lost reply: the jobs an earlier try dispatched into the room
        -- of the ends it made, not started yet (their messages were never published).
        RETURN QUERY SELECT j.id, j.message FROM fair_jobs_dispatchjob AS j
                      WHERE j.state = 2 AND j.dispatched_by = ANY(p_jobs) ORDER BY j.id;
    END IF;
    IF v_queues IS NULL THEN
        RETURN;
    END IF;
    IF p_max > 0 AND array_length(v_queues, 1) = 1 THEN
        -- One line (a start carrying the end before it) that comes first (it has jobs
        -- waiting and, by its count after the end, its key is not above the first of
        -- the selection's index, read without a lock): held now, in the order above, and
        -- dispatched into first, its count taken off in the dispatch's update of it.
        -- Else its update as below: a line held and then updated anyway would log its
        -- lock as well.
        SELECT t.id INTO v_line FROM fair_jobs_dispatchtenant AS t
          LEFT JOIN LATERAL (
              SELECT floor(o.in_flight / o.weight) AS load, o.pass_value, o.head_id
                FROM fair_jobs_dispatchtenant AS o
               WHERE o.queue = t.queue AND o.head_id IS NOT NULL AND NOT o.blocked
               ORDER BY floor(o.in_flight / o.weight), o.pass_value, o.head_id
               LIMIT 1) AS f ON true
         WHERE t.queue = v_queues[1] AND t.tenant = v_tenants[1] AND t.head_id IS NOT NULL
           AND (f.head_id IS NULL
                OR (floor(GREATEST(t.in_flight - v_counts[1], 0) / t.weight), t.pass_value,
                    t.head_id) <= (f.load, f.pass_value, f.head_id));
        IF FOUND THEN
            PERFORM 1 FROM fair_jobs_dispatchtenant AS t WHERE t.id = v_line FOR UPDATE;
            RETURN QUERY SELECT d.job_id, d.job_message
                           FROM fair_jobs_dispatch(v_queues[1], p_max, p_jobs[1], v_line,
                                                   v_counts[1]) AS d;
            RETURN;
        END IF;
    END IF;
    FOR i IN 1 .. array_length(v_queues, 1) LOOP
        UPDATE fair_jobs_dispatchtenant AS t
           SET in_flight = GREATEST(t.in_flight - v_counts[i], 0), blocked = false
         WHERE t.queue = v_queues[i] AND t.tenant = v_tenants[i];
    END LOOP;
    IF p_max > 0 THEN
        FOR v_queue IN SELECT DISTINCT q.queue FROM unnest(v_queues) AS q(queue) ORDER BY 1
        LOOP
            RETURN QUERY SELECT d.job_id, d.job_message
                           FROM fair_jobs_dispatch(v_queue, p_max, p_jobs[1]) AS d;
        END LOOP;
    END IF;
END;
$$;

-- Recount every line's waiting and in-flight jobs from the job rows (maintenance), each
-- line locked first (SKIP LOCKED: one a step holds is recounted at the next pass), so that
-- a count that drifted is set right and returned to be logged, never hidden. A head that
-- is not the line's oldest waiting job is set right too (the selection takes a line by
-- its head: one that lost it while its jobs wait would never be chosen).
CREATE OR REPLACE FUNCTION fair_jobs_dispatch_recount()
RETURNS TABLE (queue text, tenant text, waiting_was integer, waiting integer,
               in_flight_was integer, in_flight integer)
LANGUAGE plpgsql SET lock_timeout = '2s' AS $$
DECLARE
    v_line record;
BEGIN
    FOR v_line IN
        SELECT t.id FROM fair_jobs_dispatchtenant AS t
         WHERE t.waiting IS DISTINCT FROM (
                   SELECT count(*) FROM fair_jobs_dispatchjob AS j
                    WHERE j.queue = t.queue AND j.tenant = t.tenant AND j.state = 1)
            OR t.in_flight IS DISTINCT FROM (
                   SELECT count(*) FROM fair_jobs_dispatchjob AS j
                    WHERE j.queue = t.queue AND j.tenant = t.tenant AND j.state IN (2, 3))
            OR t.head_id IS DISTINCT FROM (
                   SELECT min(j.id) FROM fair_jobs_dispatchjob AS j
                    WHERE j.queue = t.queue AND j.tenant = t.tenant AND j.state = 1)
         ORDER BY t.id
    LOOP
        PERFORM 1 FROM fair_jobs_dispatchtenant AS t WHERE t.id = v_line.id
           FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        -- A statement of its own, so that its snapshot sees every step that held the line.
        RETURN QUERY
            WITH counted AS (
                SELECT t.id, t.waiting AS waiting_was, t.in_flight AS in_flight_was,
                       t.head_id AS head_was, h.id AS head, h.cap AS head_cap,
                       (SELECT count(*) FROM fair_jobs_dispatchjob AS j
                         WHERE j.queue = t.queue AND j.tenant = t.tenant
                           AND j.state = 1)::integer AS waiting,
                       (SELECT count(*) FROM fair_jobs_dispatchjob AS j
                         WHERE j.queue = t.queue AND j.tenant = t.tenant
                           AND j.state IN (2, 3))::integer AS in_flight
                  FROM fair_jobs_dispatchtenant AS t
                  LEFT JOIN LATERAL (SELECT j.id, j.cap FROM fair_jobs_dispatchjob AS j
                                      WHERE j.queue = t.queue AND j.tenant = t.tenant
                                        AND j.state = 1 ORDER BY j.id LIMIT 1) AS h ON true
                 WHERE t.id = v_line.id
            )
            UPDATE fair_jobs_dispatchtenant AS t
               SET waiting = c.waiting, in_flight = c.in_flight, blocked = false,
                   head_id = c.head, cap = c.head_cap
              FROM counted AS c
             WHERE t.id = c.id
               AND (c.waiting, c.in_flight, c.head)
                   IS DISTINCT FROM (c.waiting_was, c.in_flight_was, c.head_was)
            RETURNING t.queue::text, t.tenant::text, c.waiting_was::integer, c.waiting,
                      c.in_flight_was::integer, c.in_flight;
    END LOOP;
END;
$$;
