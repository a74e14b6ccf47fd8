-- The index built by the previous migration becomes rides_idempotency_key_unique (it takes the
-- constraint's name), in place of the index on (user_id, idempotency_key_id): the same columns,
-- so the same rides are unique, and nothing is checked or built under the exclusive lock.
SET LOCAL lock_timeout = '5s';
ALTER TABLE rides DROP CONSTRAINT rides_idempotency_key_unique;
ALTER TABLE rides ADD CONSTRAINT rides_idempotency_key_unique
    UNIQUE USING INDEX rides_idempotency_key_unique_by_key;
