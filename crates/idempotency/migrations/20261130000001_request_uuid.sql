-- A random identifier of each request, made when its key row is inserted.
--
-- Foreign idempotency keys (a payment gateway's) are derived from it, never from `id`: a
-- sequence restarts in every database, so two databases on one gateway account (staging and
-- production, a restored backup, a reset development database) would send the same derived key
-- for different requests, and the gateway would answer one with the other's result. The UUID
-- also names the request in the foreign system (a charge's metadata), so that a request can find
-- its own effect there after the foreign key was forgotten.
ALTER TABLE idempotency_keys
    ADD COLUMN request_uuid UUID NOT NULL DEFAULT gen_random_uuid();
