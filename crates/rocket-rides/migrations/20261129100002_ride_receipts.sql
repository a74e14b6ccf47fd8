-- The effect of the `send_ride_receipt` job: one receipt per paid ride. The primary key makes
-- delivering the same job twice (a drain that died after the effect, before deleting the job)
-- harmless: the second insert does nothing.
CREATE TABLE ride_receipts (
    ride_id      BIGINT      PRIMARY KEY REFERENCES rides (id),
    user_id      BIGINT      NOT NULL REFERENCES users (id),
    amount_cents INTEGER     NOT NULL,
    charge_id    TEXT        NOT NULL CHECK (char_length(charge_id) BETWEEN 1 AND 255),
    sent_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);
