-- What a ride's charge needs so that a reconciling list is never made while a call under the
-- current gateway key may still be running at the gateway, and so that a doubt found in one
-- attempt (an idempotency_error, a refusal after an attempt of unknown outcome) is not lost by
-- the next. Every column is nullable without a default, so adding them rewrites nothing, and the
-- constraints are added NOT VALID (checked for new rows only); the next migration validates
-- them in a transaction of its own, without the exclusive lock this one takes.

-- The exclusive lock on rides is taken behind any transaction that reads the table: wait for it
-- only so long, so that a long transaction somewhere fails the migration (try again) instead of
-- stalling every booking queued behind it.
SET LOCAL lock_timeout = '5s';

ALTER TABLE rides
    -- When the gateway was last asked for the charge under the current generation's key,
    -- recorded before the call leaves (for a generation's first call, by the phase that begins
    -- it). A list waits until this is older than --gateway-processing-bound. NULL: a ride of an
    -- earlier version, which recorded no call: the last one is unknown, so the wait starts from
    -- the first time a list is wanted.
    ADD COLUMN charge_attempted_at TIMESTAMPTZ,
    -- Why the current key's outcome must be found by listing before anything else, once the
    -- wait above is over; NULL when the key can simply be asked again.
    --   idempotency_error:  the gateway answered idempotency_error; it holds a result under the
    --                       key, possibly a charge;
    --   refused:            the gateway refused for good after an earlier attempt of unknown
    --                       outcome, which may have charged.
    ADD COLUMN charge_doubt TEXT,
    -- The gateway's refusal (status, type, code, param, message) to store as the final 502 if
    -- the list shows no charge for the request.
    ADD COLUMN charge_refusal JSONB;

ALTER TABLE rides
    ADD CONSTRAINT rides_charge_doubt_check
        CHECK (charge_doubt IN ('idempotency_error', 'refused')) NOT VALID,
    ADD CONSTRAINT rides_charge_doubt_shape
        CHECK ((charge_doubt IS NULL) = (charge_refusal IS NULL)) NOT VALID;
