-- A ride references its key by the key's owner, now text: the ride's user in decimal form
-- (Rocket Rides owns each key by its user's id, `Owner::from(user.id)`).
--
-- `key_owner` is a column the service fills, kept equal to user_id::text by its check: a
-- generated column would do that by itself, but PostgreSQL refuses ON DELETE SET NULL on a
-- foreign key that contains one. Reaping a key clears only idempotency_key_id; key_owner stays.
SET LOCAL lock_timeout = '5s';
ALTER TABLE rides ADD COLUMN key_owner TEXT;
UPDATE rides SET key_owner = user_id::text WHERE key_owner IS NULL;
ALTER TABLE rides ALTER COLUMN key_owner SET NOT NULL;
ALTER TABLE rides ADD CONSTRAINT rides_key_owner_is_the_user CHECK (key_owner = user_id::text);
ALTER TABLE rides ADD CONSTRAINT rides_idempotency_key_fkey
    FOREIGN KEY (key_owner, idempotency_key_id) REFERENCES idempotency_keys (owner, id)
    ON DELETE SET NULL (idempotency_key_id);
