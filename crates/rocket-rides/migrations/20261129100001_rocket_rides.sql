-- Rocket Rides' own tables. They run after the idempotency crate's migration, whose
-- idempotency_keys table the rides reference.

CREATE TABLE users (
    id                 BIGSERIAL   PRIMARY KEY,
    email              TEXT        NOT NULL UNIQUE CHECK (char_length(email) BETWEEN 3 AND 254),
    -- SHA-256 of the API key. The key itself is shown once, at creation, and never stored.
    api_key_hash       BYTEA       NOT NULL UNIQUE CHECK (octet_length(api_key_hash) = 32),
    -- The customer at the payment gateway, whose card every ride of this user is charged to.
    stripe_customer_id TEXT        NOT NULL CHECK (char_length(stripe_customer_id) BETWEEN 1 AND 255),
    created_at         TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE rides (
    id                 BIGSERIAL   PRIMARY KEY,
    user_id            BIGINT      NOT NULL REFERENCES users (id),
    -- One key, one ride. SET NULL so that reaping an old finished key keeps the ride.
    idempotency_key_id BIGINT      UNIQUE REFERENCES idempotency_keys (id) ON DELETE SET NULL,
    origin_lat         DOUBLE PRECISION NOT NULL CHECK (origin_lat BETWEEN -90 AND 90),
    origin_lon         DOUBLE PRECISION NOT NULL CHECK (origin_lon BETWEEN -180 AND 180),
    target_lat         DOUBLE PRECISION NOT NULL CHECK (target_lat BETWEEN -90 AND 90),
    target_lon         DOUBLE PRECISION NOT NULL CHECK (target_lon BETWEEN -180 AND 180),
    amount_cents       INTEGER     NOT NULL CHECK (amount_cents BETWEEN 50 AND 1000000),
    -- One charge, one ride: a charge id can never be recorded on two rides.
    charge_id          TEXT        UNIQUE CHECK (char_length(charge_id) BETWEEN 1 AND 255),
    -- pending: created, not charged yet; paid: charge_id recorded; declined: the card was refused.
    status             TEXT        NOT NULL DEFAULT 'pending'
                                   CHECK (status IN ('pending', 'paid', 'declined')),
    created_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT rides_paid_has_charge CHECK ((status = 'paid') = (charge_id IS NOT NULL))
);

CREATE INDEX rides_user_id_idx ON rides (user_id, id);

-- What happened, written in the same transaction as the change it describes.
CREATE TABLE audit_records (
    id            BIGSERIAL   PRIMARY KEY,
    user_id       BIGINT      NOT NULL REFERENCES users (id),
    action        TEXT        NOT NULL CHECK (char_length(action) BETWEEN 1 AND 64),
    resource_type TEXT        NOT NULL CHECK (char_length(resource_type) BETWEEN 1 AND 64),
    resource_id   BIGINT      NOT NULL,
    data          JSONB       NOT NULL DEFAULT '{}',
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE INDEX audit_records_resource_idx ON audit_records (resource_type, resource_id);

-- The transactional outbox: jobs staged by a phase commit with it, and are delivered by the
-- worker afterwards. A job that is never committed is never run.
CREATE TABLE staged_jobs (
    id         BIGSERIAL   PRIMARY KEY,
    job_name   TEXT        NOT NULL CHECK (char_length(job_name) BETWEEN 1 AND 64),
    job_args   JSONB       NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
