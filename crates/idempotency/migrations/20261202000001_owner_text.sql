-- The owner of a key becomes a string of 1 to 128 bytes (a user id of the seed, a Stripe account
-- id, a tenant's name), and its column is named for what it is: `owner`. Integer owners keep
-- their value in decimal form ('42'), which an application's own rows reach as `user_id::text`.
--
-- A foreign key that references the owner as bigint cannot survive the change of type, and
-- dropping it silently would leave the application's rows unchecked: this migration refuses while
-- any foreign key references the table, naming them. An application drops it in a migration of a lower version and re-creates
-- it on a text column in one of a higher version; `migrate_with` runs the crate's migrations and
-- the application's in the order of their versions, so that both land around this one.
--
-- The type change rewrites the key table under an exclusive lock: the lock is not waited for
-- long behind other transactions (their queries would queue behind the wait).
SET LOCAL lock_timeout = '5s';

DO $$
DECLARE
    referencing TEXT;
BEGIN
    -- Every foreign key to the table, not only those through user_id: one on id alone is an
    -- application's too, whose later migrations may still be written for the bigint owner (a
    -- plain `migrate` cannot see them); it is re-created after this migration, as the others.
    SELECT string_agg(format('%I on %s', c.conname, c.conrelid::regclass), ', ')
    INTO referencing
    FROM pg_constraint c
    WHERE c.contype = 'f' AND c.confrelid = 'idempotency_keys'::regclass;
    IF referencing IS NOT NULL THEN
        RAISE EXCEPTION 'idempotency_keys.user_id becomes owner TEXT, and foreign keys reference the table: %. Drop them in a migration of a version below 20261202000001, re-create them on a text column (user_id::text) in one above it, and run both with idempotency::migrate_with (the crate''s README, "Upgrading")', referencing;
    END IF;
END
$$;

ALTER TABLE idempotency_keys RENAME COLUMN user_id TO owner;
ALTER TABLE idempotency_keys
    ALTER COLUMN owner TYPE TEXT USING owner::text,
    -- UTF-8 bytes, as idempotency::Owner counts them, whatever the database's encoding.
    ADD CONSTRAINT idempotency_keys_owner_length
        CHECK (octet_length(convert_to(owner, 'UTF8')) BETWEEN 1 AND 128);

ALTER TABLE idempotency_keys_unfinished RENAME COLUMN user_id TO owner;
ALTER TABLE idempotency_keys_unfinished ALTER COLUMN owner TYPE TEXT USING owner::text;
