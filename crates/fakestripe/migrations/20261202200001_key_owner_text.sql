-- A charge references its key by the key's owner, now text: the charge's account in decimal form
-- (fakestripe owns each key by its account's id). A column fakestripe fills, held to
-- account_id::text by its check (a generated column cannot take part in ON DELETE SET NULL).
SET LOCAL lock_timeout = '5s';
ALTER TABLE charges ADD COLUMN key_owner TEXT;
UPDATE charges SET key_owner = account_id::text WHERE key_owner IS NULL;
ALTER TABLE charges ALTER COLUMN key_owner SET NOT NULL;
ALTER TABLE charges ADD CONSTRAINT charges_key_owner_is_the_account
    CHECK (key_owner = account_id::text);
ALTER TABLE charges ADD CONSTRAINT charges_idempotency_key_fkey
    FOREIGN KEY (key_owner, idempotency_key_id) REFERENCES idempotency_keys (owner, id)
    ON DELETE SET NULL (idempotency_key_id);
