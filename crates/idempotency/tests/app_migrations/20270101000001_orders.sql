-- An application's table, referencing the crate's, as a user's own migrations would.
CREATE TABLE orders (
    owner  TEXT NOT NULL,
    id     BIGSERIAL,
    key_id BIGINT,
    PRIMARY KEY (owner, id),
    FOREIGN KEY (owner, key_id) REFERENCES idempotency_keys (owner, id)
        ON DELETE SET NULL (key_id)
);
