CREATE TABLE IF NOT EXISTS idempotency_records (
    -- The record id (RecordId, 16 bytes): the primary key is the unique constraint that
    -- lets only one of two concurrent claims of a key win.
    id          bytea       PRIMARY KEY CHECK (octet_length(id) = 16),
    -- The fingerprint of the request that claimed the key (32 bytes).
    fingerprint bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    -- The token of the claim that wrote the row (16 bytes), kept once it is completed.
    token       bytea       NOT NULL CHECK (octet_length(token) = 16),
    -- The completed record (Completed::encode), NULL while the claim is in flight.
    completed   bytea,
    -- In flight: when the claim's lease ends. Completed: when the dedup window ends.
    -- Past it, the row counts as gone, and the sweep deletes it.
    expires_at  timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at
    ON idempotency_records (expires_at);
