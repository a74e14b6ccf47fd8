-- Ready to be distributed by user (Citus: docs/scaling.md): the primary key becomes
-- (user_id, id), as a distributed table's must include its distribution column; the scope's
-- unique index already does.
--
-- `UNIQUE (id)` stays beside it, for applications whose earlier migrations reference
-- `idempotency_keys (id)`: the crate's migrations all run before an application's, so an
-- application's first migration still finds a unique `id` to reference. Applications should
-- reference `(user_id, id)` (Rocket Rides' and fakestripe's later migrations do); the
-- single-column index is dropped when the table is distributed.
--
-- Foreign keys that referenced the old primary key go with it (CASCADE); an application's
-- next migration re-creates them.
ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey CASCADE;
ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (user_id, id);
ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_id_key UNIQUE (id);
