-- Every table a booking writes names the owner of its user's idempotency keys, `user_id::text`
-- (as rides.key_owner does since 20261202100001), so that on Citus all of them are distributed
-- by that one text value, colocated with idempotency_keys: a booking's rows, keys included, on
-- one node (docs/scaling.md). The service writes the column on every insert and compares it in
-- every statement.
--
-- While a service of the earlier version still runs, its inserts do not name the column: the
-- trigger fills it. The rows from before are filled in batches by `rocket-rides migrate` right
-- after this migration (`db::fill_key_owners`), before the new version starts. The checks hold
-- the column to the user, for new rows now and for every row once validated.
SET LOCAL lock_timeout = '5s';
ALTER TABLE audit_records ADD COLUMN key_owner TEXT;
ALTER TABLE staged_jobs ADD COLUMN key_owner TEXT;
ALTER TABLE ride_receipts ADD COLUMN key_owner TEXT;
CREATE FUNCTION key_owner_of_the_user() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.key_owner := NEW.user_id::text;
    RETURN NEW;
END
$$;
CREATE TRIGGER audit_records_key_owner BEFORE INSERT ON audit_records
    FOR EACH ROW WHEN (NEW.key_owner IS NULL) EXECUTE FUNCTION key_owner_of_the_user();
CREATE TRIGGER staged_jobs_key_owner BEFORE INSERT ON staged_jobs
    FOR EACH ROW WHEN (NEW.key_owner IS NULL) EXECUTE FUNCTION key_owner_of_the_user();
CREATE TRIGGER ride_receipts_key_owner BEFORE INSERT ON ride_receipts
    FOR EACH ROW WHEN (NEW.key_owner IS NULL) EXECUTE FUNCTION key_owner_of_the_user();
ALTER TABLE audit_records ADD CONSTRAINT audit_records_key_owner_is_the_user
    CHECK (key_owner = user_id::text) NOT VALID;
ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_key_owner_is_the_user
    CHECK (key_owner = user_id::text) NOT VALID;
ALTER TABLE ride_receipts ADD CONSTRAINT ride_receipts_key_owner_is_the_user
    CHECK (key_owner = user_id::text) NOT VALID;
