-- What real Stripe does that the first schema left out.

-- A charge may be created `pending` (not paid yet) and settle later as `succeeded` or `failed`;
-- a failed charge says why, as Stripe's charge object does. Settling is the only update a
-- charge row ever gets, and it changes neither `created` nor `id`, so list cursors stay valid.
ALTER TABLE charges DROP CONSTRAINT charges_status_check;
ALTER TABLE charges ADD CONSTRAINT charges_status_check
    CHECK (status IN ('succeeded', 'pending', 'failed'));
ALTER TABLE charges
    ADD COLUMN failure_code    TEXT CHECK (char_length(failure_code) <= 64),
    ADD COLUMN failure_message TEXT CHECK (char_length(failure_message) <= 500),
    ADD CONSTRAINT charges_failure_shape
        CHECK ((status = 'failed') = (failure_code IS NOT NULL AND failure_message IS NOT NULL));

-- `DELETE /v1/customers/{id}`: the customer is kept (its charges still name it) but marked, and
-- every later charge of it is refused for good with 400 `resource_missing`, as Stripe refuses a
-- deleted customer.
ALTER TABLE customers ADD COLUMN deleted BOOLEAN NOT NULL DEFAULT false;
