-- no-transaction
-- The reaper's delete of a finished key makes PostgreSQL clear the reference of its ride
-- (`ON DELETE SET NULL (idempotency_key_id)` of rides_idempotency_key_fkey), looking the ride up
-- by `key_owner = $1 AND idempotency_key_id = $2`. No index of rides starts with either column:
-- rides_idempotency_key_unique is on (user_id, idempotency_key_id), which the planner cannot use
-- from key_owner (the check that ties it to user_id is nothing the planner reads), so each
-- deleted key walked that whole index. The same uniqueness with the key's id first serves that
-- look-up with one probe, and keeps the ride's user in the index (a table distributed by user
-- needs it in every unique index: docs/scaling.md). The next migration makes it the constraint,
-- in place of the old index: one index per ride, as before.
CREATE UNIQUE INDEX CONCURRENTLY rides_idempotency_key_unique_by_key
    ON rides (idempotency_key_id, user_id);
