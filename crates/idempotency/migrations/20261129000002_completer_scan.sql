-- The completer's scan, revised:
-- * it takes only the keys of the route it knows how to finish (method and path lead the index);
-- * a key's grace runs from its last attempt (last_run_at), not from its creation, so a client
--   that is still retrying its own key keeps it;
-- * its backoff doubles with the completer's own attempts, counted apart from the client's.
ALTER TABLE idempotency_keys
    ADD COLUMN completer_attempts INTEGER NOT NULL DEFAULT 0 CHECK (completer_attempts >= 0);

DROP INDEX idempotency_keys_unfinished_idx;

CREATE INDEX idempotency_keys_unfinished_idx
    ON idempotency_keys (request_method, request_path, last_run_at) WHERE finished_at IS NULL;
