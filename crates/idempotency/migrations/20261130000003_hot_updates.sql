-- Updates of a key row are HOT (heap-only: no new index entries, no vacuum needed to reclaim
-- them), so that the table's speed does not depend on vacuum.
--
-- PostgreSQL makes an update HOT only when it changes no indexed column (predicates of partial
-- indexes included) and the new version fits on the row's page. Every phase changes
-- recovery_point, locked_until and last_run_at, and finishing changes finished_at; so:
--
-- * no index covers a column that an update sets. The completer's and the reaper's partial
--   indexes, whose predicates named finished_at, are replaced by:
--   - idempotency_keys_unfinished, one row per unfinished key, inserted with the key and deleted
--     in the statement that finishes it: the completer's scan, and the operators' gauge;
--   - an index on created_at, which never changes: the reaper's scan (a key finishes after it
--     was created, so the keys finished before a cutoff are among those created before it);
-- * rows are inserted into pages 80% full, leaving room on the same page for the finished
--   version, which carries the stored response; the version it replaces is pruned from the
--   page by the next statements that read it, without vacuum. (Measured with the benchmark:
--   every key-row update HOT at 1 to 64 concurrent bookings, against 83% at 100% full.)
CREATE TABLE idempotency_keys_unfinished (
    user_id        BIGINT      NOT NULL,
    key_id         BIGINT      NOT NULL,
    request_method TEXT        NOT NULL,
    request_path   TEXT        NOT NULL,
    created_at     TIMESTAMPTZ NOT NULL,
    -- No foreign key to idempotency_keys: checking it would lock the key row on every insert.
    -- The store writes both tables in the same statements, so they cannot disagree.
    PRIMARY KEY (user_id, key_id)
);

CREATE INDEX idempotency_keys_unfinished_scan_idx
    ON idempotency_keys_unfinished (request_method, request_path, created_at);

INSERT INTO idempotency_keys_unfinished (user_id, key_id, request_method, request_path, created_at)
SELECT user_id, id, request_method, request_path, created_at
FROM idempotency_keys WHERE finished_at IS NULL;

DROP INDEX idempotency_keys_unfinished_idx;
DROP INDEX idempotency_keys_finished_idx;

CREATE INDEX idempotency_keys_created_idx ON idempotency_keys (created_at);

ALTER TABLE idempotency_keys SET (fillfactor = 80);
