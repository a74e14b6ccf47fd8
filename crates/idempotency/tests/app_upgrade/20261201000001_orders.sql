-- An application's table, referencing the crate's by an integer owner, as migrations written before
-- the owner became text did.
CREATE TABLE orders (
    user_id BIGINT NOT NULL,
    id      BIGSERIAL,
    key_id  BIGINT,
    PRIMARY KEY (user_id, id),
    FOREIGN KEY (user_id, key_id) REFERENCES idempotency_keys (user_id, id)
        ON DELETE SET NULL (key_id)
);
