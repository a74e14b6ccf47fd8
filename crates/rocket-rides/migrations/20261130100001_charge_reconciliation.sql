-- What a ride's charge needs against a gateway that forgets its idempotency keys (Stripe: after
-- 24 hours), stores its 500s under them, answers `pending`, or refuses for good.

ALTER TABLE rides
    -- The gateway key is derived from the request's UUID and this generation. A new generation
    -- is started only when the charge of the current one is known not to exist (a list of the
    -- customer's charges finds none naming this request) and the current key can no longer be
    -- trusted to find it: the gateway forgot it, or keeps a 500 under it.
    ADD COLUMN charge_generation INTEGER NOT NULL DEFAULT 1 CHECK (charge_generation >= 1),
    -- When the gateway was first asked for this ride's charge, under any generation: a
    -- reconciling list starts here.
    ADD COLUMN charge_first_attempt_at TIMESTAMPTZ,
    -- When the current generation's key was first used: the gateway remembers it for a window
    -- from then (--gateway-key-window is kept below it).
    ADD COLUMN charge_generation_at TIMESTAMPTZ;

-- Rides booked before this migration: their first attempt happened at creation at the latest.
UPDATE rides SET charge_first_attempt_at = created_at, charge_generation_at = created_at;

ALTER TABLE rides
    ALTER COLUMN charge_first_attempt_at SET NOT NULL,
    ALTER COLUMN charge_generation_at SET NOT NULL,
    ALTER COLUMN charge_first_attempt_at SET DEFAULT now(),
    ALTER COLUMN charge_generation_at SET DEFAULT now();

-- Two more ride states:
--   payment_pending: the gateway created the charge `pending`; it is recorded, not paid, and
--                    resolved by retrieving it later;
--   failed:          the gateway refused the charge for good (an unknown or deleted customer,
--                    an idempotency error); the request finished with a 502 and no charge.
ALTER TABLE rides DROP CONSTRAINT rides_status_check;
ALTER TABLE rides ADD CONSTRAINT rides_status_check
    CHECK (status IN ('pending', 'payment_pending', 'paid', 'declined', 'failed'));
ALTER TABLE rides DROP CONSTRAINT rides_paid_has_charge;
ALTER TABLE rides ADD CONSTRAINT rides_charge_shape
    CHECK ((status IN ('payment_pending', 'paid')) = (charge_id IS NOT NULL));

-- Users: the gateway customer is created under a key derived from a random identifier of the
-- user row (not from the email, which another database may hold too). The row is written
-- first, without customer or API key; `users create` run again after a failure finds it and
-- asks the gateway again under the same key, getting the same customer.
ALTER TABLE users
    ADD COLUMN customer_key UUID NOT NULL DEFAULT gen_random_uuid(),
    ALTER COLUMN stripe_customer_id DROP NOT NULL,
    ALTER COLUMN api_key_hash DROP NOT NULL,
    ADD CONSTRAINT users_complete_shape
        CHECK ((stripe_customer_id IS NULL) = (api_key_hash IS NULL));
