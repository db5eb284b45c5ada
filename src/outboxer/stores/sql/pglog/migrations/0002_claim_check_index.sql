-- Log mode, migration 0002: the claim-check sweep finds the log's rows of its objects
-- through an index. The sweep (payload_admin: the log's "referenced", a page of up to
-- 1,000 object names at a time) asked headers->>'outboxer-claim-check' = ANY(...) of a log
-- without any index on it: a sequential scan of every partition, the whole retained log,
-- per page of objects, at every cleanup. As the default table's (postgres migration 0011):
-- a partial expression index of the claim-checked rows only, so writers of rows without a
-- claim-check pay nothing; the query repeats its condition (headers ? ...), without which
-- the planner, having no statistics of a partial index's expression, scans instead. Made
-- on the partitioned log: on each partition, present and to come. Built inside the schema
-- transaction: writers wait for one pass over the log.
CREATE INDEX {log_raw}_claim_check_idx ON {log} ((headers->>'outboxer-claim-check'))
    WHERE headers ? 'outboxer-claim-check';
