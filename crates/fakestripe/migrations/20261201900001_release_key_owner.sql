-- The idempotency crate's 20261202000001 turns a key's owner into text, and refuses while a
-- foreign key references it as bigint: the charge's reference to its key goes first, and comes
-- back on the owner's text form in 20261202200001 (both run around the crate's by
-- idempotency::migrate_with).
SET LOCAL lock_timeout = '5s';
ALTER TABLE charges DROP CONSTRAINT charges_idempotency_key_fkey;
