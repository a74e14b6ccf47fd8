-- Ready to be distributed by user (Citus: docs/scaling.md). Every statement on these tables
-- names its user, and every unique index includes user_id, but one: `rides.charge_id` stays
-- unique across users, because "a charge is recorded on at most one ride" is an invariant the
-- database itself keeps (see docs/scaling.md for what replaces it on a distributed table).

-- Rides: keyed by (user_id, id); one ride per key of a user.
ALTER TABLE ride_receipts DROP CONSTRAINT ride_receipts_ride_id_fkey;
ALTER TABLE rides DROP CONSTRAINT rides_pkey;
ALTER TABLE rides ADD CONSTRAINT rides_pkey PRIMARY KEY (user_id, id);
-- The primary key now serves a user's look-up by id.
DROP INDEX rides_user_id_idx;
ALTER TABLE rides DROP CONSTRAINT rides_idempotency_key_id_key;
ALTER TABLE rides ADD CONSTRAINT rides_idempotency_key_unique UNIQUE (user_id, idempotency_key_id);
-- The library's migration dropped the single-column foreign key with its primary key. Reaping a
-- finished key keeps the ride: only the reference is cleared, never the owner.
ALTER TABLE rides DROP CONSTRAINT IF EXISTS rides_idempotency_key_id_fkey;
ALTER TABLE rides ADD CONSTRAINT rides_idempotency_key_fkey
    FOREIGN KEY (user_id, idempotency_key_id) REFERENCES idempotency_keys (user_id, id)
    ON DELETE SET NULL (idempotency_key_id);

-- Receipts: one per ride of a user.
ALTER TABLE ride_receipts DROP CONSTRAINT ride_receipts_pkey;
ALTER TABLE ride_receipts ADD CONSTRAINT ride_receipts_pkey PRIMARY KEY (user_id, ride_id);
ALTER TABLE ride_receipts ADD CONSTRAINT ride_receipts_ride_fkey
    FOREIGN KEY (user_id, ride_id) REFERENCES rides (user_id, id);

-- Audit records, by user.
ALTER TABLE audit_records DROP CONSTRAINT audit_records_pkey;
ALTER TABLE audit_records ADD CONSTRAINT audit_records_pkey PRIMARY KEY (user_id, id);
DROP INDEX audit_records_resource_idx;
CREATE INDEX audit_records_resource_idx ON audit_records (user_id, resource_type, resource_id);

-- Dead letters: a staged job that cannot be run is moved here with its error, out of the way
-- of the others, for an operator (`rocket-rides jobs list`). Its owner may be unknown (a job
-- whose arguments name no ride), so user_id may be NULL here and the table is not distributed.
CREATE TABLE failed_jobs (
    id         BIGINT      PRIMARY KEY,
    user_id    BIGINT      REFERENCES users (id),
    job_name   TEXT        NOT NULL CHECK (char_length(job_name) BETWEEN 1 AND 64),
    job_args   JSONB       NOT NULL,
    error      TEXT        NOT NULL CHECK (char_length(error) BETWEEN 1 AND 1000),
    created_at TIMESTAMPTZ NOT NULL,
    failed_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Staged jobs get their owner: the user of the ride a receipt job names. A job that names no
-- ride could never be delivered: it goes to the dead letters now.
ALTER TABLE staged_jobs ADD COLUMN user_id BIGINT REFERENCES users (id);
UPDATE staged_jobs j SET user_id = r.user_id
FROM rides r
WHERE j.job_args->>'ride_id' ~ '^[0-9]{1,18}$' AND r.id = (j.job_args->>'ride_id')::bigint;
INSERT INTO failed_jobs (id, user_id, job_name, job_args, error, created_at)
SELECT id, NULL, job_name, job_args, 'its arguments name no ride (found when owners were added)',
       created_at
FROM staged_jobs WHERE user_id IS NULL;
DELETE FROM staged_jobs WHERE user_id IS NULL;
ALTER TABLE staged_jobs ALTER COLUMN user_id SET NOT NULL;
ALTER TABLE staged_jobs DROP CONSTRAINT staged_jobs_pkey;
ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_pkey PRIMARY KEY (user_id, id);
