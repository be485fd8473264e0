-- Fair dispatch on PostgreSQL: one function per step of a job, so that each step is one
-- round trip (one statement in autocommit, one transaction). Installed by migration
-- 0006 as one block; a change here ships as a new migration that replaces the functions.
-- The statements that call them are named blocks of dispatch/store.sql.
--
-- Locks are always taken tenant row first, queue row second; a tenant row is only ever
-- taken queue-first with SKIP LOCKED (never waited for), so no two steps deadlock.
-- States: 0 scheduled (not due), 1 waiting, 2 dispatched, 3 running.

-- name: functions

-- Dispatch up to p_max jobs of p_queue while it has room (in flight below capacity plus
-- slack): each to the tenant with jobs waiting and below its cap that has the fewest jobs
-- in flight per weight, then the lowest virtual time, then the oldest job. Returns the
-- jobs to publish. Countdowns that came due join their lines first.
CREATE OR REPLACE FUNCTION fair_jobs_dispatch(p_queue text, p_max integer)
RETURNS TABLE (job_id bigint, job_signature text)
LANGUAGE plpgsql AS $$
DECLARE
    v_room integer;
    v_vt double precision;
    v_tenant record;
    v_due record;
BEGIN
    SELECT q.virtual_time INTO v_vt FROM fair_jobs_dispatchqueue AS q WHERE q.queue = p_queue;
    FOR v_due IN
        WITH due AS (
            UPDATE fair_jobs_dispatchjob AS j SET state = 1
             WHERE j.queue = p_queue AND j.state = 0 AND j.not_before <= now()
            RETURNING j.tenant, j.id
        )
        SELECT due.tenant, count(*) AS n, min(due.id) AS first_id
          FROM due GROUP BY due.tenant ORDER BY due.tenant
    LOOP
        UPDATE fair_jobs_dispatchtenant AS t
           SET waiting = t.waiting + v_due.n,
               head_id = CASE WHEN t.waiting = 0 THEN v_due.first_id
                              ELSE LEAST(t.head_id, v_due.first_id) END,
               pass_value = CASE WHEN t.waiting = 0
                                 THEN GREATEST(t.pass_value, COALESCE(v_vt, 0))
                                 ELSE t.pass_value END
         WHERE t.queue = p_queue AND t.tenant = v_due.tenant;
    END LOOP;

    UPDATE fair_jobs_dispatchqueue AS q SET updated_at = now()
     WHERE q.queue = p_queue AND q.in_flight < q.capacity + q.slack
    RETURNING q.capacity + q.slack - q.in_flight INTO v_room;
    IF v_room IS NULL THEN
        RETURN;
    END IF;
    v_room := LEAST(v_room, p_max);
    WHILE v_room > 0 LOOP
        SELECT t.id, t.tenant, t.pass_value, t.head_id INTO v_tenant
          FROM fair_jobs_dispatchtenant AS t
          LEFT JOIN fair_jobs_tenantqueueslot AS s ON s.tenant = t.tenant AND s.queue = t.queue
         WHERE t.queue = p_queue AND t.waiting > 0
           AND (COALESCE(s.max_jobs, t.cap) IS NULL OR t.in_flight < COALESCE(s.max_jobs, t.cap))
         ORDER BY floor(t.in_flight / t.weight), t.pass_value, t.head_id
         LIMIT 1
           FOR UPDATE OF t SKIP LOCKED;
        EXIT WHEN NOT FOUND;
        UPDATE fair_jobs_dispatchjob AS j SET state = 2, dispatched_at = now()
         WHERE j.id = v_tenant.head_id AND j.state = 1
        RETURNING j.id, j.signature INTO job_id, job_signature;
        IF NOT FOUND THEN
            -- A head that left the line another way (cancelled): recount, go on.
            UPDATE fair_jobs_dispatchtenant AS t
               SET head_id = (SELECT min(j.id) FROM fair_jobs_dispatchjob AS j
                               WHERE j.queue = t.queue AND j.tenant = t.tenant AND j.state = 1),
                   waiting = (SELECT count(*) FROM fair_jobs_dispatchjob AS j
                               WHERE j.queue = t.queue AND j.tenant = t.tenant AND j.state = 1)
             WHERE t.id = v_tenant.id;
            CONTINUE;
        END IF;
        UPDATE fair_jobs_dispatchtenant AS t
           SET in_flight = t.in_flight + 1,
               waiting = t.waiting - 1,
               pass_value = t.pass_value + 1.0 / t.weight,
               dispatched_total = t.dispatched_total + 1,
               head_id = (SELECT j.id FROM fair_jobs_dispatchjob AS j
                           WHERE j.queue = t.queue AND j.tenant = t.tenant AND j.state = 1
                           ORDER BY j.id LIMIT 1)
         WHERE t.id = v_tenant.id;
        UPDATE fair_jobs_dispatchqueue AS q
           SET in_flight = q.in_flight + 1,
               virtual_time = GREATEST(q.virtual_time, v_tenant.pass_value),
               dispatched_total = q.dispatched_total + 1
         WHERE q.queue = p_queue;
        RETURN NEXT;
        v_room := v_room - 1;
    END LOOP;
END;
$$;

-- Store a job in its tenant's line (or, with a countdown not yet due, aside until it is);
-- if p_dispatch and the queue has room, dispatch at once. Returns the jobs to publish
-- (usually this one, or nothing while the queue is full).
CREATE OR REPLACE FUNCTION fair_jobs_enqueue(
    p_queue text, p_tenant text, p_task_name text, p_task_id text, p_signature text,
    p_not_before timestamptz, p_weight double precision, p_cap integer, p_dispatch boolean
)
RETURNS TABLE (job_id bigint, job_signature text)
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
    v_due boolean := p_not_before IS NULL OR p_not_before <= now();
    v_vt double precision;
BEGIN
    SELECT q.virtual_time INTO v_vt FROM fair_jobs_dispatchqueue AS q WHERE q.queue = p_queue;
    IF NOT FOUND THEN
        INSERT INTO fair_jobs_dispatchqueue
               (queue, capacity, slack, in_flight, virtual_time, dispatched_total, updated_at)
        VALUES (p_queue, 0, 0, 0, 0, 0, now()) ON CONFLICT (queue) DO NOTHING;
        v_vt := 0;
    END IF;
    INSERT INTO fair_jobs_dispatchjob
           (queue, tenant, task_name, task_id, signature, state, not_before, enqueued_at,
            publish_failures)
    VALUES (p_queue, p_tenant, p_task_name, p_task_id, p_signature,
            CASE WHEN v_due THEN 1 ELSE 0 END, p_not_before, now(), 0)
    RETURNING id INTO v_id;
    INSERT INTO fair_jobs_dispatchtenant AS t
           (queue, tenant, weight, cap, waiting, in_flight, pass_value, head_id,
            dispatched_total)
    VALUES (p_queue, p_tenant, COALESCE(p_weight, 1.0), p_cap,
            CASE WHEN v_due THEN 1 ELSE 0 END, 0, v_vt,
            CASE WHEN v_due THEN v_id END, 0)
    ON CONFLICT (queue, tenant) DO UPDATE
       SET waiting = t.waiting + CASE WHEN v_due THEN 1 ELSE 0 END,
           head_id = CASE WHEN NOT v_due THEN t.head_id
                          WHEN t.waiting = 0 THEN v_id ELSE t.head_id END,
           pass_value = CASE WHEN v_due AND t.waiting = 0
                             THEN GREATEST(t.pass_value, v_vt) ELSE t.pass_value END,
           weight = COALESCE(p_weight, t.weight),
           cap = p_cap;
    IF p_dispatch AND v_due AND EXISTS (
        SELECT 1 FROM fair_jobs_dispatchqueue AS q
         WHERE q.queue = p_queue AND q.in_flight < q.capacity + q.slack
    ) THEN
        RETURN QUERY SELECT d.job_id, d.job_signature FROM fair_jobs_dispatch(p_queue, 1000) AS d;
    END IF;
END;
$$;

-- Store many jobs in their lines in one call (bulk_enqueue), then dispatch each queue
-- they went to once, while it has room. The caller sorts the jobs by queue and tenant, so
-- that two calls take their tenant rows in the same order. Returns the jobs to publish.
CREATE OR REPLACE FUNCTION fair_jobs_enqueue_many(
    p_queues text[], p_tenants text[], p_task_names text[], p_task_ids text[],
    p_signatures text[], p_not_befores timestamptz[], p_weights double precision[],
    p_caps integer[]
)
RETURNS TABLE (job_id bigint, job_signature text)
LANGUAGE plpgsql AS $$
DECLARE
    v_queue text;
BEGIN
    FOR i IN 1 .. COALESCE(array_length(p_queues, 1), 0) LOOP
        PERFORM 1 FROM fair_jobs_enqueue(
            p_queues[i], p_tenants[i], p_task_names[i], p_task_ids[i], p_signatures[i],
            p_not_befores[i], p_weights[i], p_caps[i], false);
    END LOOP;
    FOR v_queue IN SELECT DISTINCT q.queue FROM unnest(p_queues) AS q(queue) ORDER BY 1 LOOP
        RETURN QUERY SELECT d.job_id, d.job_signature FROM fair_jobs_dispatch(v_queue, 1000) AS d;
    END LOOP;
END;
$$;

-- A dispatched job starts: it is running now, under p_process. A copy of a job that went
-- back to its line (its worker was presumed dead) starts it from there. Any other copy is
-- a duplicate and must not run. Returns the status and the tenant's cap in force.
CREATE OR REPLACE FUNCTION fair_jobs_dispatch_start(p_job bigint, p_process uuid)
RETURNS TABLE (status text, cap integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_queue text;
    v_tenant text;
    v_state smallint;
BEGIN
    SELECT j.state INTO v_state FROM fair_jobs_dispatchjob AS j
     WHERE j.id = p_job AND j.state IN (1, 2) FOR UPDATE;
    IF FOUND THEN
        UPDATE fair_jobs_dispatchjob AS j
           SET state = 3, process_id = p_process, started_at = now()
         WHERE j.id = p_job
        RETURNING j.queue, j.tenant INTO v_queue, v_tenant;
    END IF;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'duplicate'::text, NULL::integer;
        RETURN;
    END IF;
    IF v_state = 1 THEN
        UPDATE fair_jobs_dispatchtenant AS t
           SET waiting = t.waiting - 1, in_flight = t.in_flight + 1,
               head_id = (SELECT j.id FROM fair_jobs_dispatchjob AS j
                           WHERE j.queue = t.queue AND j.tenant = t.tenant AND j.state = 1
                           ORDER BY j.id LIMIT 1)
         WHERE t.queue = v_queue AND t.tenant = v_tenant;
        UPDATE fair_jobs_dispatchqueue AS q SET in_flight = q.in_flight + 1
         WHERE q.queue = v_queue;
    END IF;
    RETURN QUERY
        SELECT 'started'::text, COALESCE(s.max_jobs, t.cap)::integer
          FROM fair_jobs_dispatchtenant AS t
          LEFT JOIN fair_jobs_tenantqueueslot AS s ON s.tenant = t.tenant AND s.queue = t.queue
         WHERE t.queue = v_queue AND t.tenant = v_tenant;
END;
$$;

-- Take a job out of flight: p_end deletes it (it ended), otherwise it goes back to its
-- line, after p_delay seconds if > 0. Fenced by p_process for a running job (a worker
-- presumed dead cannot end the job a second time); p_process NULL acts on a dispatched
-- job (its publish failed, or its message was revoked). Then dispatch up to p_max jobs into the room it left.
CREATE OR REPLACE FUNCTION fair_jobs_dispatch_end(
    p_job bigint, p_process uuid, p_end boolean, p_delay double precision, p_max integer
)
RETURNS TABLE (job_id bigint, job_signature text)
LANGUAGE plpgsql AS $$
DECLARE
    v_queue text;
    v_tenant text;
    v_back boolean := NOT p_end AND COALESCE(p_delay, 0) <= 0;
BEGIN
    IF p_end THEN
        DELETE FROM fair_jobs_dispatchjob AS j
         WHERE j.id = p_job
           AND ((p_process IS NULL AND j.state = 2)
                OR (j.state = 3 AND j.process_id = p_process))
        RETURNING j.queue, j.tenant INTO v_queue, v_tenant;
    ELSE
        UPDATE fair_jobs_dispatchjob AS j
           SET state = CASE WHEN v_back THEN 1 ELSE 0 END,
               not_before = CASE WHEN v_back THEN j.not_before
                                 ELSE now() + make_interval(secs => p_delay) END,
               process_id = NULL, dispatched_at = NULL, started_at = NULL,
               publish_failures = j.publish_failures
                                  + CASE WHEN p_process IS NULL THEN 1 ELSE 0 END
         WHERE j.id = p_job
           AND ((p_process IS NULL AND j.state = 2)
                OR (j.state = 3 AND j.process_id = p_process))
        RETURNING j.queue, j.tenant INTO v_queue, v_tenant;
    END IF;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE fair_jobs_dispatchtenant AS t
       SET in_flight = GREATEST(t.in_flight - 1, 0),
           waiting = t.waiting + CASE WHEN v_back THEN 1 ELSE 0 END,
           head_id = CASE WHEN NOT v_back THEN t.head_id
                          WHEN t.waiting = 0 THEN p_job ELSE LEAST(t.head_id, p_job) END
     WHERE t.queue = v_queue AND t.tenant = v_tenant;
    UPDATE fair_jobs_dispatchqueue AS q SET in_flight = GREATEST(q.in_flight - 1, 0)
     WHERE q.queue = v_queue;
    IF p_max > 0 THEN
        RETURN QUERY SELECT d.job_id, d.job_signature FROM fair_jobs_dispatch(v_queue, p_max) AS d;
    END IF;
END;
$$;
