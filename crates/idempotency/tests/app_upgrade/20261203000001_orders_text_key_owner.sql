-- After the crate's 20261202000001: the reference comes back, on the owner's text form. A column
-- the application fills (a generated one cannot be set NULL by the foreign key's action); the
-- check keeps it the user's.
ALTER TABLE orders
    ADD COLUMN key_owner TEXT CHECK (key_owner = user_id::text);
UPDATE orders SET key_owner = user_id::text WHERE key_id IS NOT NULL;
ALTER TABLE orders ADD CONSTRAINT orders_key_fkey
    FOREIGN KEY (key_owner, key_id) REFERENCES idempotency_keys (owner, id)
    ON DELETE SET NULL (key_id);
