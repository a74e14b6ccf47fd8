-- Every reference to idempotency_keys is now (user_id, id) (20261130100002), so the crate's
-- single-column UNIQUE (id), kept for references like this application's first migration's,
-- serves nothing here and costs every new key an index entry. It goes unless something still
-- references it.
DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conname = 'idempotency_keys_id_key' AND conrelid = 'idempotency_keys'::regclass
    ) AND NOT EXISTS (
        SELECT 1 FROM pg_constraint f
        JOIN pg_constraint u ON u.conindid = f.conindid
        WHERE f.contype = 'f' AND f.confrelid = 'idempotency_keys'::regclass
          AND u.conname = 'idempotency_keys_id_key'
          AND u.conrelid = 'idempotency_keys'::regclass
    ) THEN
        ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_id_key;
    END IF;
END
$$;
