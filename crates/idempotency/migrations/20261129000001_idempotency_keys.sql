-- The idempotency key table of the `idempotency` crate.
--
-- One row per (user, method, route, key): the "triple scope" of the Stripe pattern. The row is at
-- once the request's memory (fingerprint, parameters, recovery point), its lock (a lease that
-- expires, fenced by a token) and its answer (the stored response once finished).
CREATE TABLE idempotency_keys (
    id              BIGSERIAL PRIMARY KEY,

    -- Scope. Every statement on this table carries user_id, so the table can be distributed by it.
    user_id         BIGINT      NOT NULL,
    request_method  TEXT        NOT NULL CHECK (char_length(request_method) BETWEEN 1 AND 16),
    -- The route template ("/rides"), not the concrete path: one key guards one operation.
    request_path    TEXT        NOT NULL CHECK (char_length(request_path) BETWEEN 1 AND 255),
    idempotency_key TEXT        NOT NULL CHECK (char_length(idempotency_key) BETWEEN 1 AND 255),

    -- SHA-256 of method, route and the canonical JSON body: a reused key with another payload is
    -- refused by comparing this, never by comparing the parameters.
    fingerprint     BYTEA       NOT NULL CHECK (octet_length(fingerprint) = 32),
    -- What the completer needs to finish the request without its client.
    request_params  JSONB       NOT NULL,

    -- The last committed phase, named by the application (Rocket Rides: started, ride_created,
    -- charge_created, finished).
    recovery_point  TEXT        NOT NULL CHECK (char_length(recovery_point) BETWEEN 1 AND 64),

    -- The lease: whoever holds lease_token may write until locked_until. NULL means free.
    locked_until    TIMESTAMPTZ,
    -- The fencing token, incremented by every acquisition. A phase commits only if the token it
    -- acquired is still the row's token, so a holder whose lease was taken over writes nothing.
    lease_token     BIGINT      NOT NULL DEFAULT 1 CHECK (lease_token > 0),
    -- How many times the lease was acquired (first request, retries, completer runs).
    attempts        INTEGER     NOT NULL DEFAULT 1 CHECK (attempts > 0),
    -- The completer's backoff: it leaves the key alone until then. A client's own retry ignores it.
    next_attempt_at TIMESTAMPTZ,

    -- The stored final response, replayed byte for byte.
    response_status  SMALLINT   CHECK (response_status BETWEEN 100 AND 599),
    -- [[name, value], ...]: only the headers the application chose to keep (Location, Content-Type).
    response_headers JSONB,
    response_body    BYTEA      CHECK (octet_length(response_body) <= 1048576),

    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_run_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at     TIMESTAMPTZ,

    CONSTRAINT idempotency_keys_scope_unique
        UNIQUE (user_id, request_method, request_path, idempotency_key),
    -- A finished key has its response and no lease; an unfinished one has no response.
    CONSTRAINT idempotency_keys_finished_shape CHECK (
        (finished_at IS NULL AND response_status IS NULL)
        OR (finished_at IS NOT NULL AND response_status IS NOT NULL
            AND response_headers IS NOT NULL AND response_body IS NOT NULL AND locked_until IS NULL)
    )
);

-- The completer's scan: unfinished keys, oldest first. Partial, so finished keys cost nothing.
CREATE INDEX idempotency_keys_unfinished_idx
    ON idempotency_keys (created_at) WHERE finished_at IS NULL;

-- The reaper's scan: finished keys by age.
CREATE INDEX idempotency_keys_finished_idx
    ON idempotency_keys (finished_at) WHERE finished_at IS NOT NULL;
