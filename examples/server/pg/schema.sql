-- The payments example's own tables, beside the idempotency layer's (PgStore::migrate creates
-- `idempotency_records`, which also holds the ledger consumer's processed event ids). Created
-- at start-up when missing.

-- One row per charge. `status` follows the state machine (state_machine.rs); `authorizing` is
-- committed before the provider is called, and the final state with the request's record.
CREATE TABLE IF NOT EXISTS charges (
    id              text        PRIMARY KEY,
    account         text        NOT NULL,
    -- The provider's idempotency key of the create call: a retry finds its charge by it.
    provider_key    text        NOT NULL,
    amount          bigint      NOT NULL,
    currency        text        NOT NULL,
    description     text,
    -- The client's key-value pairs, as a JSON object.
    metadata        text        NOT NULL DEFAULT '{}',
    source          text        NOT NULL,
    capture         boolean     NOT NULL,
    status          text        NOT NULL,
    amount_refunded bigint      NOT NULL DEFAULT 0,
    -- The provider's payment id, once it answered.
    payment         text        NOT NULL DEFAULT '',
    -- Seconds since the Unix epoch, as the API shows it.
    created         bigint      NOT NULL,
    seq             bigserial,
    opened_at       timestamptz NOT NULL DEFAULT statement_timestamp(),
    -- The last change of status: the reconciler settles charges `authorizing` since long ago.
    updated_at      timestamptz NOT NULL DEFAULT statement_timestamp()
);
CREATE INDEX IF NOT EXISTS charges_account ON charges (account, seq);
CREATE INDEX IF NOT EXISTS charges_provider_key ON charges (account, provider_key);
CREATE INDEX IF NOT EXISTS charges_authorizing ON charges (updated_at)
    WHERE status = 'authorizing';

-- Every account's available balance per currency, in minor units.
CREATE TABLE IF NOT EXISTS balances (
    account  text   NOT NULL,
    currency text   NOT NULL,
    amount   bigint NOT NULL,
    PRIMARY KEY (account, currency)
);

-- The outbox: events written in the transaction of the change they report, taken off by the
-- ledger consumer with FOR UPDATE SKIP LOCKED in the transaction that applies them.
CREATE TABLE IF NOT EXISTS payment_events (
    seq          bigserial   PRIMARY KEY,
    event_id     text        NOT NULL,
    payload      text        NOT NULL,
    published_at timestamptz NOT NULL DEFAULT statement_timestamp()
);

-- The simulated provider's idempotency keys (provider/keys.rs): they stand for an outside
-- service's own records, shared by every instance of the example.
CREATE TABLE IF NOT EXISTS provider_keys (
    key        text        PRIMARY KEY,
    request    text        NOT NULL,
    id         text        NOT NULL,
    expires_at timestamptz NOT NULL
);
