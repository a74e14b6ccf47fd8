-- The idempotency crate's 20261202000001 turns a key's owner into text, and refuses while a
-- foreign key references it as bigint: the ride's reference to its key goes first, and comes back
-- on the owner's text form in 20261202100001. Migrated with idempotency::migrate_with, the three
-- run in this order on a database of any age.
SET LOCAL lock_timeout = '5s';
ALTER TABLE rides DROP CONSTRAINT rides_idempotency_key_fkey;
