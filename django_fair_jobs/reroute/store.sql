-- Sliding-window rerouting (mechanism B): count an enqueue and pick the rule that
-- reroutes it; prune idle windows.
-- PostgreSQL only, one named block each, loaded by django_fair_jobs.sql.queries().

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
--   Only buckets at least one second old are read: the counter's row once, then one
--   index probe per rule, however many enqueues the window holds.
-- * rerouted: one more job sent to the picked rule's queue.
-- * decided: the reroute's decision row for explain (only when a task id is given), in
--   the same statement: a rerouted publish costs one statement, not two.
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
    SELECT r.ord, r.per, r.threshold, r.queue,
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
), decided AS (
    INSERT INTO fair_jobs_jobdecision
           (at, task_id, task_name, tenant, queue, mechanism, action, enforced, detail)
    SELECT now(), %(task_id)s::text, %(task_name)s::text, %(tenant)s::text,
           %(declared)s::text, 'reroute',
           CASE WHEN %(enforced)s::boolean THEN 'rerouted' ELSE 'reroute' END,
           %(enforced)s::boolean,
           jsonb_build_object('rule', c.ord, 'to_queue', c.queue, 'per', c.per,
                              'threshold', c.threshold, 'count', c.n)
      FROM picked AS p JOIN counts AS c ON c.ord = p.ord
     WHERE %(task_id)s::text IS NOT NULL
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
