-- The tables of fakestripe, the fake payment gateway.
--
-- They live in the `fakestripe` schema (the pool's search_path), next to the `idempotency_keys`
-- table that `idempotency::migrate` creates there first, so that a gateway sharing a database
-- with the service under test never touches the service's own tables.

-- One row per secret key ever seen: Stripe's "account". Any well-formed test key is accepted and
-- gets its account on first use; an account scopes customers, charges and idempotency keys.
-- Keys are stored in clear: they are test keys of a fake gateway, never real credentials.
CREATE TABLE accounts (
    id          BIGSERIAL   PRIMARY KEY,
    secret_key  TEXT        NOT NULL UNIQUE
                            CHECK (secret_key ~ '^sk_test_[A-Za-z0-9_]+$'
                                   AND char_length(secret_key) <= 255),
    created     TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Customers with at most one payment source. The source is the test token that was attached:
-- it decides whether the customer's charges succeed (tok_visa) or are declined
-- (tok_chargeCustomerFail). No source: charges fail with "no active card".
CREATE TABLE customers (
    id          TEXT        PRIMARY KEY CHECK (id ~ '^cus_[A-Za-z0-9]{14}$'),
    account_id  BIGINT      NOT NULL REFERENCES accounts (id),
    email       TEXT        CHECK (char_length(email) BETWEEN 3 AND 512),
    description TEXT        CHECK (char_length(description) <= 1000),
    source      TEXT        CHECK (source IN ('tok_visa', 'tok_chargeCustomerFail')),
    metadata    JSONB       NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metadata) = 'object'),
    created     TIMESTAMPTZ NOT NULL DEFAULT now(),

    -- The target of charges' composite foreign key: a charge's customer is of the same account.
    CONSTRAINT customers_account_id_unique UNIQUE (account_id, id)
);

-- Successful charges only: a declined charge leaves no row (its 402 is kept as the idempotent
-- response of its key instead). Rows are never updated or deleted, so a list cursor stays valid.
CREATE TABLE charges (
    id                 TEXT        PRIMARY KEY CHECK (id ~ '^ch_[A-Za-z0-9]{24}$'),
    account_id         BIGINT      NOT NULL,
    customer_id        TEXT        NOT NULL,
    -- In the currency's smallest unit; Stripe's ceiling is eight digits.
    amount             BIGINT      NOT NULL CHECK (amount > 0 AND amount <= 99999999),
    currency           TEXT        NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    description        TEXT        CHECK (char_length(description) <= 1000),
    metadata           JSONB       NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metadata) = 'object'),
    status             TEXT        NOT NULL DEFAULT 'succeeded' CHECK (status IN ('succeeded')),
    -- The key whose request made this charge. UNIQUE: one key, one charge, enforced here and not
    -- only by the claim. SET NULL: pruning old keys keeps the charges.
    idempotency_key_id BIGINT      UNIQUE REFERENCES idempotency_keys (id) ON DELETE SET NULL,
    created            TIMESTAMPTZ NOT NULL DEFAULT now(),

    CONSTRAINT charges_customer_fk FOREIGN KEY (account_id, customer_id)
        REFERENCES customers (account_id, id)
);

-- `GET /v1/charges`: newest first by (created, id) within an account; read backwards for
-- `ending_before`. id breaks ties between charges created in the same microsecond.
CREATE INDEX charges_account_created_idx ON charges (account_id, created, id);

-- The same list filtered by customer, and the audit's "charges of this customer".
CREATE INDEX charges_customer_created_idx ON charges (customer_id, created, id);
