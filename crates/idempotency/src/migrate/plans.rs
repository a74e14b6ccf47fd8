//! The online plans of the crate's own migrations from before the live-database rule: each
//! reaches the schema its file reaches, in steps that hold an exclusive lock only for catalog
//! changes (docs/operations.md, "Migrations on a live database").
//!
//! Each file's index builds, behind a `DROP INDEX` that takes the exclusive lock to the end of
//! the transaction, are the long part of the earliest two; the later ones rewrite or rebuild.

use super::online::OnlinePlan;

/// The crate's migration that refuses while foreign keys reference the key table.
const OWNER_TEXT_REFUSAL: &str = r#"
DO $$
DECLARE
    referencing TEXT;
BEGIN
    SELECT string_agg(format('%I on %s', c.conname, c.conrelid::regclass), ', ')
    INTO referencing
    FROM pg_constraint c
    WHERE c.contype = 'f' AND c.confrelid = 'idempotency_keys'::regclass;
    IF referencing IS NOT NULL THEN
        RAISE EXCEPTION 'idempotency_keys.user_id becomes owner TEXT, and foreign keys reference the table: %. Drop them in a migration of a version below 20261202000001, re-create them on a text column (user_id::text) in one above it, and run both with idempotency::migrate_with (the crate''s README, "Upgrading")', referencing;
    END IF;
END
$$;
"#;

/// The plans, one per migration whose file holds an exclusive lock for long on a large table.
pub(super) fn plans() -> Vec<OnlinePlan> {
    vec![
        completer_scan(),
        request_uuid(),
        user_in_every_key(),
        hot_updates(),
        owner_text(),
    ]
}

/// 20261129000002: a column with a constant default (no rewrite) whose check comes `NOT VALID`
/// and is validated; the partial index of the unfinished keys rebuilt concurrently (under its
/// name, so the old one goes first: for a moment the completer scans without it).
fn completer_scan() -> OnlinePlan {
    OnlinePlan::new(20261129000002)
        .transaction(
            "ALTER TABLE idempotency_keys
                 ADD COLUMN IF NOT EXISTS completer_attempts INTEGER NOT NULL DEFAULT 0;
             ALTER TABLE idempotency_keys
                 DROP CONSTRAINT IF EXISTS idempotency_keys_completer_attempts_check;
             ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_completer_attempts_check
                 CHECK (completer_attempts >= 0) NOT VALID;",
        )
        .validate(
            "idempotency_keys",
            "idempotency_keys_completer_attempts_check",
        )
        .index_concurrently(
            "idempotency_keys_unfinished_idx",
            false,
            "idempotency_keys (request_method, request_path, last_run_at) \
             WHERE finished_at IS NULL",
        )
}

/// 20261130000003: the table of unfinished keys, created and filled from the key table (a read:
/// no lock that stops writes); the two partial indexes dropped and the index on `created_at`
/// built concurrently; the fill factor, which takes `SHARE UPDATE EXCLUSIVE`, last.
fn hot_updates() -> OnlinePlan {
    OnlinePlan::new(20261130000003)
        .transaction(
            "CREATE TABLE IF NOT EXISTS idempotency_keys_unfinished (
                 user_id        BIGINT      NOT NULL,
                 key_id         BIGINT      NOT NULL,
                 request_method TEXT        NOT NULL,
                 request_path   TEXT        NOT NULL,
                 created_at     TIMESTAMPTZ NOT NULL,
                 PRIMARY KEY (user_id, key_id)
             );
             CREATE INDEX IF NOT EXISTS idempotency_keys_unfinished_scan_idx
                 ON idempotency_keys_unfinished (request_method, request_path, created_at);
             INSERT INTO idempotency_keys_unfinished
                 (user_id, key_id, request_method, request_path, created_at)
             SELECT user_id, id, request_method, request_path, created_at
             FROM idempotency_keys WHERE finished_at IS NULL
             ON CONFLICT DO NOTHING;",
        )
        .alone("DROP INDEX CONCURRENTLY IF EXISTS idempotency_keys_unfinished_idx")
        .alone("DROP INDEX CONCURRENTLY IF EXISTS idempotency_keys_finished_idx")
        .index_concurrently(
            "idempotency_keys_created_idx",
            false,
            "idempotency_keys (created_at)",
        )
        .transaction("ALTER TABLE idempotency_keys SET (fillfactor = 80)")
}

/// 20261130000001: `request_uuid UUID NOT NULL DEFAULT gen_random_uuid()`, a volatile default
/// that rewrites the table. The column comes without it; new rows get the default at once, old
/// ones a value each in batches.
fn request_uuid() -> OnlinePlan {
    OnlinePlan::new(20261130000001)
        .transaction(
            "ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS request_uuid UUID;
             ALTER TABLE idempotency_keys ALTER COLUMN request_uuid SET DEFAULT gen_random_uuid();",
        )
        .backfill(
            "idempotency_keys",
            "UPDATE idempotency_keys SET request_uuid = gen_random_uuid()
             WHERE id >= $1 AND id < $2 AND request_uuid IS NULL",
        )
        .set_not_null("idempotency_keys", "request_uuid")
}

/// 20261130000002: the primary key becomes `(user_id, id)` and `UNIQUE (id)` stays. Both indexes
/// are built concurrently; the short transaction swaps the constraints onto them (dropping, as
/// the file does, the foreign keys on the old primary key).
fn user_in_every_key() -> OnlinePlan {
    OnlinePlan::new(20261130000002)
        .index_concurrently(
            "idempotency_keys_pkey_online",
            true,
            "idempotency_keys (user_id, id)",
        )
        .index_concurrently("idempotency_keys_id_online", true, "idempotency_keys (id)")
        .transaction(
            "ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey CASCADE;
             ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_pkey
                 PRIMARY KEY USING INDEX idempotency_keys_pkey_online;
             ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_id_key
                 UNIQUE USING INDEX idempotency_keys_id_online;",
        )
}

/// 20261202000001: `user_id BIGINT` becomes `owner TEXT`, a type change that rewrites the table
/// and its indexes. No type change rewrites nothing, so the least locking equivalent is a new
/// column: `owner_online`, kept equal to `user_id::text` by a trigger on every insert and update
/// while old rows are filled in batches; the indexes that lead with the owner are built on it
/// concurrently; one short transaction then drops `user_id` (and the constraints on it), renames
/// the new column, and makes the new indexes the constraints. The column ends last in the table
/// rather than second: columns are compared by name, and the crate names its columns in every
/// statement.
fn owner_text() -> OnlinePlan {
    OnlinePlan::new(20261202000001)
        .transaction(format!(
            "{OWNER_TEXT_REFUSAL}
             ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS owner_online TEXT;
             CREATE OR REPLACE FUNCTION idempotency_keys_owner_online() RETURNS trigger
             LANGUAGE plpgsql AS $$
             BEGIN
                 NEW.owner_online := NEW.user_id::text;
                 RETURN NEW;
             END
             $$;
             DROP TRIGGER IF EXISTS idempotency_keys_owner_online ON idempotency_keys;
             CREATE TRIGGER idempotency_keys_owner_online
                 BEFORE INSERT OR UPDATE ON idempotency_keys
                 FOR EACH ROW EXECUTE FUNCTION idempotency_keys_owner_online();
             ALTER TABLE idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_owner_length;
             ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_owner_length
                 CHECK (octet_length(convert_to(owner_online, 'UTF8')) BETWEEN 1 AND 128)
                 NOT VALID;"
        ))
        .backfill(
            "idempotency_keys",
            "UPDATE idempotency_keys SET owner_online = user_id::text
             WHERE id >= $1 AND id < $2 AND owner_online IS NULL",
        )
        .validate("idempotency_keys", "idempotency_keys_owner_length")
        .transaction(
            "ALTER TABLE idempotency_keys DROP CONSTRAINT IF EXISTS owner_online_not_null;
             ALTER TABLE idempotency_keys ADD CONSTRAINT owner_online_not_null
                 CHECK (owner_online IS NOT NULL) NOT VALID;",
        )
        .validate("idempotency_keys", "owner_online_not_null")
        .index_concurrently(
            "idempotency_keys_pkey_online",
            true,
            "idempotency_keys (owner_online, id)",
        )
        .index_concurrently(
            "idempotency_keys_scope_online",
            true,
            "idempotency_keys (owner_online, request_method, request_path, idempotency_key)",
        )
        .transaction(format!(
            "{OWNER_TEXT_REFUSAL}
             DROP TRIGGER idempotency_keys_owner_online ON idempotency_keys;
             DROP FUNCTION idempotency_keys_owner_online();
             ALTER TABLE idempotency_keys
                 DROP CONSTRAINT idempotency_keys_pkey,
                 DROP CONSTRAINT idempotency_keys_scope_unique,
                 DROP COLUMN user_id;
             ALTER TABLE idempotency_keys RENAME COLUMN owner_online TO owner;
             ALTER TABLE idempotency_keys ALTER COLUMN owner SET NOT NULL;
             ALTER TABLE idempotency_keys DROP CONSTRAINT owner_online_not_null;
             ALTER TABLE idempotency_keys
                 ADD CONSTRAINT idempotency_keys_pkey
                     PRIMARY KEY USING INDEX idempotency_keys_pkey_online,
                 ADD CONSTRAINT idempotency_keys_scope_unique
                     UNIQUE USING INDEX idempotency_keys_scope_online;
             -- The unfinished keys are few (a key finishes in milliseconds): rewritten in place.
             ALTER TABLE idempotency_keys_unfinished RENAME COLUMN user_id TO owner;
             ALTER TABLE idempotency_keys_unfinished ALTER COLUMN owner TYPE TEXT USING owner::text;"
        ))
}
