-- The idempotency crate's primary key became (user_id, id) and took the single-column foreign
-- key of `charges` with it. A charge references its key by (account, key) now: the key's
-- user_id is the account.
ALTER TABLE charges DROP CONSTRAINT IF EXISTS charges_idempotency_key_id_fkey;
ALTER TABLE charges ADD CONSTRAINT charges_idempotency_key_fkey
    FOREIGN KEY (account_id, idempotency_key_id) REFERENCES idempotency_keys (user_id, id)
    ON DELETE SET NULL (idempotency_key_id);
