//! The online plans of the service's migrations from before the live-database rule: each reaches
//! the schema its file reaches, holding an exclusive lock only for catalog changes
//! (`idempotency::OnlinePlan`; docs/operations.md, "Migrations on a live database"). The crate
//! plans its own migrations.
//!
//! The others run from their files: `20261129100002` creates a table, `20261130100003` indexes
//! `users` (one row per rider, not per booking), `20261130100004` and `20261201900001` drop a
//! constraint, and the later ones keep the rule (`20261202300001` has a plan all the same: its
//! concurrent build, when it fails, leaves an index its file cannot build again).

use idempotency::OnlinePlan;

/// A reaper of the running version deletes finished keys while a plan runs. Between the step
/// that drops the rides' reference to their key and the one that adds it again `NOT VALID`, no
/// `ON DELETE SET NULL` clears the reference of a reaped key's ride (under the file, that window
/// is inside one transaction holding the exclusive lock), and validating the new reference would
/// fail on such a ride for good. Once the reference is back, every delete sets it null again;
/// this clears what the window left, as the reference would have: the ride keeps everything but
/// the id of a key that no longer exists. For the reference by user (20261130100002).
const FORGET_REAPED_KEYS_BY_USER: &str = "UPDATE rides r SET idempotency_key_id = NULL
     WHERE r.id >= $1 AND r.id < $2 AND r.idempotency_key_id IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM idempotency_keys k
                       WHERE k.user_id = r.user_id AND k.id = r.idempotency_key_id)";

/// 20261202100001's backfill: a ride booked before names its key's owner, its user, and forgets a
/// key that no longer exists, in the same update.
///
/// The reference by owner is down from 20261201900001 (which released the reference by user)
/// until this plan's first step adds it again; and on a ride whose `key_owner` is still null it
/// matches no key, so no `ON DELETE SET NULL` reaches that ride until this update fills it. A key
/// a reaper deleted meanwhile leaves its ride naming it; filling `key_owner` alone would then
/// fail on the `NOT VALID` reference (checked on every update of the row), at the same step on
/// every rerun. The key's id is read again by the update itself: a key deleted after it is
/// cleared by the reference, now that it matches the ride.
const FILL_KEY_OWNER_FORGETTING_REAPED_KEYS: &str = "UPDATE rides r
     SET key_owner = r.user_id::text,
         idempotency_key_id = (SELECT k.id FROM idempotency_keys k
                               WHERE k.owner = r.user_id::text AND k.id = r.idempotency_key_id)
     WHERE r.id >= $1 AND r.id < $2 AND r.key_owner IS NULL";

/// The plans, in the order of their versions.
pub(super) fn plans() -> Vec<OnlinePlan> {
    vec![
        charge_reconciliation(),
        user_in_every_key(),
        key_owner_text(),
        ride_key_index(),
    ]
}

/// 20261202300001: the file builds its index `CONCURRENTLY`, as the rule asks, but a build that
/// fails (a lock wait past the bound, the process killed) leaves an invalid index of that name,
/// on which the file then fails every time; the plan drops it first.
fn ride_key_index() -> OnlinePlan {
    OnlinePlan::new(20261202300001).index_concurrently(
        "rides_idempotency_key_unique_by_key",
        true,
        "rides (idempotency_key_id, user_id)",
    )
}

/// 20261130100001: three columns on rides, two filled from `created_at` for the rides booked
/// before; the ride states widened; a customer key on users from a volatile default. The new
/// columns come without their defaults, which are set afterwards for new rows only (a default
/// given with `ADD COLUMN`, even `now()`, is the value of every existing row); old rows are
/// filled in batches; the checks come `NOT VALID` and are validated.
fn charge_reconciliation() -> OnlinePlan {
    OnlinePlan::new(20261130100001)
        .transaction(
            "ALTER TABLE rides ADD COLUMN IF NOT EXISTS charge_generation INTEGER NOT NULL DEFAULT 1;
             ALTER TABLE rides DROP CONSTRAINT IF EXISTS rides_charge_generation_check;
             ALTER TABLE rides ADD CONSTRAINT rides_charge_generation_check
                 CHECK (charge_generation >= 1) NOT VALID;
             ALTER TABLE rides ADD COLUMN IF NOT EXISTS charge_first_attempt_at TIMESTAMPTZ,
                               ADD COLUMN IF NOT EXISTS charge_generation_at TIMESTAMPTZ;
             ALTER TABLE rides ALTER COLUMN charge_first_attempt_at SET DEFAULT now(),
                               ALTER COLUMN charge_generation_at SET DEFAULT now();
             ALTER TABLE rides DROP CONSTRAINT IF EXISTS rides_status_check;
             ALTER TABLE rides ADD CONSTRAINT rides_status_check
                 CHECK (status IN ('pending', 'payment_pending', 'paid', 'declined', 'failed'))
                 NOT VALID;
             ALTER TABLE rides DROP CONSTRAINT IF EXISTS rides_paid_has_charge;
             ALTER TABLE rides DROP CONSTRAINT IF EXISTS rides_charge_shape;
             ALTER TABLE rides ADD CONSTRAINT rides_charge_shape
                 CHECK ((status IN ('payment_pending', 'paid')) = (charge_id IS NOT NULL))
                 NOT VALID;
             ALTER TABLE users ADD COLUMN IF NOT EXISTS customer_key UUID;
             ALTER TABLE users ALTER COLUMN customer_key SET DEFAULT gen_random_uuid(),
                               ALTER COLUMN stripe_customer_id DROP NOT NULL,
                               ALTER COLUMN api_key_hash DROP NOT NULL;
             ALTER TABLE users DROP CONSTRAINT IF EXISTS users_complete_shape;
             ALTER TABLE users ADD CONSTRAINT users_complete_shape
                 CHECK ((stripe_customer_id IS NULL) = (api_key_hash IS NULL)) NOT VALID;",
        )
        // Rides booked before: their first attempt happened at creation at the latest.
        .backfill(
            "rides",
            "UPDATE rides SET charge_first_attempt_at = created_at, charge_generation_at = created_at
             WHERE id >= $1 AND id < $2 AND charge_first_attempt_at IS NULL",
        )
        .backfill(
            "users",
            "UPDATE users SET customer_key = gen_random_uuid()
             WHERE id >= $1 AND id < $2 AND customer_key IS NULL",
        )
        .validate("rides", "rides_charge_generation_check")
        .validate("rides", "rides_status_check")
        .validate("rides", "rides_charge_shape")
        .validate("users", "users_complete_shape")
        .set_not_null("users", "customer_key")
        .set_not_null("rides", "charge_first_attempt_at")
        .set_not_null("rides", "charge_generation_at")
}

/// 20261130100002: the primary keys of rides, receipts and audit records lead with `user_id`,
/// and the references follow. Each key's index is built concurrently and swapped in by a short
/// transaction; each reference comes `NOT VALID` and is validated. The staged jobs and the dead
/// letters are the file's own statements, in the last transaction: the outbox holds only the
/// jobs not delivered yet, a handful, so filling their owners is short.
fn user_in_every_key() -> OnlinePlan {
    OnlinePlan::new(20261130100002)
        .transaction(
            "ALTER TABLE ride_receipts DROP CONSTRAINT IF EXISTS ride_receipts_ride_id_fkey;
             ALTER TABLE ride_receipts DROP CONSTRAINT IF EXISTS ride_receipts_ride_fkey;",
        )
        .index_concurrently("rides_pkey_online", true, "rides (user_id, id)")
        .index_concurrently(
            "rides_idempotency_key_online",
            true,
            "rides (user_id, idempotency_key_id)",
        )
        .transaction(
            "ALTER TABLE rides DROP CONSTRAINT rides_pkey;
             ALTER TABLE rides ADD CONSTRAINT rides_pkey PRIMARY KEY USING INDEX rides_pkey_online;
             -- The primary key now serves a user's look-up by id.
             DROP INDEX IF EXISTS rides_user_id_idx;
             ALTER TABLE rides DROP CONSTRAINT IF EXISTS rides_idempotency_key_id_key;
             ALTER TABLE rides DROP CONSTRAINT IF EXISTS rides_idempotency_key_unique;
             ALTER TABLE rides ADD CONSTRAINT rides_idempotency_key_unique
                 UNIQUE USING INDEX rides_idempotency_key_online;
             ALTER TABLE rides DROP CONSTRAINT IF EXISTS rides_idempotency_key_id_fkey;
             ALTER TABLE rides DROP CONSTRAINT IF EXISTS rides_idempotency_key_fkey;
             ALTER TABLE rides ADD CONSTRAINT rides_idempotency_key_fkey
                 FOREIGN KEY (user_id, idempotency_key_id) REFERENCES idempotency_keys (user_id, id)
                 ON DELETE SET NULL (idempotency_key_id) NOT VALID;",
        )
        .backfill("rides", FORGET_REAPED_KEYS_BY_USER)
        .validate("rides", "rides_idempotency_key_fkey")
        .index_concurrently(
            "ride_receipts_pkey_online",
            true,
            "ride_receipts (user_id, ride_id)",
        )
        .transaction(
            "ALTER TABLE ride_receipts DROP CONSTRAINT ride_receipts_pkey;
             ALTER TABLE ride_receipts ADD CONSTRAINT ride_receipts_pkey
                 PRIMARY KEY USING INDEX ride_receipts_pkey_online;
             ALTER TABLE ride_receipts ADD CONSTRAINT ride_receipts_ride_fkey
                 FOREIGN KEY (user_id, ride_id) REFERENCES rides (user_id, id) NOT VALID;",
        )
        .validate("ride_receipts", "ride_receipts_ride_fkey")
        .index_concurrently(
            "audit_records_pkey_online",
            true,
            "audit_records (user_id, id)",
        )
        .index_concurrently(
            "audit_records_resource_online",
            false,
            "audit_records (user_id, resource_type, resource_id)",
        )
        .transaction(
            "ALTER TABLE audit_records DROP CONSTRAINT audit_records_pkey;
             ALTER TABLE audit_records ADD CONSTRAINT audit_records_pkey
                 PRIMARY KEY USING INDEX audit_records_pkey_online;
             DROP INDEX IF EXISTS audit_records_resource_idx;
             ALTER INDEX audit_records_resource_online RENAME TO audit_records_resource_idx;",
        )
        .transaction(
            "CREATE TABLE failed_jobs (
                 id         BIGINT      PRIMARY KEY,
                 user_id    BIGINT      REFERENCES users (id),
                 job_name   TEXT        NOT NULL CHECK (char_length(job_name) BETWEEN 1 AND 64),
                 job_args   JSONB       NOT NULL,
                 error      TEXT        NOT NULL CHECK (char_length(error) BETWEEN 1 AND 1000),
                 created_at TIMESTAMPTZ NOT NULL,
                 failed_at  TIMESTAMPTZ NOT NULL DEFAULT now()
             );
             ALTER TABLE staged_jobs ADD COLUMN user_id BIGINT REFERENCES users (id);
             UPDATE staged_jobs j SET user_id = r.user_id
             FROM rides r
             WHERE j.job_args->>'ride_id' ~ '^[0-9]{1,18}$'
               AND r.id = (j.job_args->>'ride_id')::bigint;
             INSERT INTO failed_jobs (id, user_id, job_name, job_args, error, created_at)
             SELECT id, NULL, job_name, job_args,
                    'its arguments name no ride (found when owners were added)', created_at
             FROM staged_jobs WHERE user_id IS NULL;
             DELETE FROM staged_jobs WHERE user_id IS NULL;
             ALTER TABLE staged_jobs ALTER COLUMN user_id SET NOT NULL;
             ALTER TABLE staged_jobs DROP CONSTRAINT staged_jobs_pkey;
             ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_pkey PRIMARY KEY (user_id, id);",
        )
}

/// 20261202100001: rides name their key's owner in `key_owner`, filled from `user_id`, checked
/// and referenced. A trigger fills it on every insert and update while the old rows are filled
/// in batches (a service of the earlier version, which does not know the column, keeps booking),
/// each ride forgetting a key reaped while the reference was down
/// ([`FILL_KEY_OWNER_FORGETTING_REAPED_KEYS`]); the check and the reference come `NOT VALID` and
/// are validated; the trigger goes once the column is `NOT NULL`.
fn key_owner_text() -> OnlinePlan {
    OnlinePlan::new(20261202100001)
        .transaction(
            "ALTER TABLE rides ADD COLUMN IF NOT EXISTS key_owner TEXT;
             CREATE OR REPLACE FUNCTION rides_key_owner_online() RETURNS trigger
             LANGUAGE plpgsql AS $$
             BEGIN
                 NEW.key_owner := coalesce(NEW.key_owner, NEW.user_id::text);
                 RETURN NEW;
             END
             $$;
             DROP TRIGGER IF EXISTS rides_key_owner_online ON rides;
             CREATE TRIGGER rides_key_owner_online BEFORE INSERT OR UPDATE ON rides
                 FOR EACH ROW EXECUTE FUNCTION rides_key_owner_online();
             ALTER TABLE rides DROP CONSTRAINT IF EXISTS rides_key_owner_is_the_user;
             ALTER TABLE rides ADD CONSTRAINT rides_key_owner_is_the_user
                 CHECK (key_owner = user_id::text) NOT VALID;
             ALTER TABLE rides DROP CONSTRAINT IF EXISTS rides_idempotency_key_fkey;
             ALTER TABLE rides ADD CONSTRAINT rides_idempotency_key_fkey
                 FOREIGN KEY (key_owner, idempotency_key_id) REFERENCES idempotency_keys (owner, id)
                 ON DELETE SET NULL (idempotency_key_id) NOT VALID;",
        )
        .backfill("rides", FILL_KEY_OWNER_FORGETTING_REAPED_KEYS)
        .validate("rides", "rides_key_owner_is_the_user")
        .validate("rides", "rides_idempotency_key_fkey")
        .set_not_null("rides", "key_owner")
        .transaction(
            "DROP TRIGGER rides_key_owner_online ON rides;
             DROP FUNCTION rides_key_owner_online();",
        )
}
