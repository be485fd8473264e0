-- Maintenance: one pass per interval across the cluster.
-- PostgreSQL only, one named block each, loaded by django_fair_jobs.sql.queries().

-- name: claim_maintenance
-- Every process beats, but a maintenance pass runs at most once per interval across the
-- cluster: the caller whose upsert returns a row runs it.
INSERT INTO fair_jobs_maintenance AS m (name, last_run_at)
VALUES (%(name)s, now())
ON CONFLICT (name) DO UPDATE
   SET last_run_at = now()
 WHERE m.last_run_at < now() - make_interval(secs => %(interval)s)
RETURNING 1;
