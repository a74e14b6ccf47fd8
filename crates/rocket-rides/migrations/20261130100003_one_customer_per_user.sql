-- One gateway customer belongs to one user. With the booking's check that a charge's customer
-- is its ride's user's, this keeps a charge from being recorded for two users even where
-- `rides.charge_id` can only be unique per user (a table distributed by user: docs/scaling.md).
-- Incomplete users (an interrupted `users create`) have no customer yet; NULLs do not collide.
ALTER TABLE users ADD CONSTRAINT users_stripe_customer_id_key UNIQUE (stripe_customer_id);
