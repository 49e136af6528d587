-- The payments example's own tables, beside the idempotency layer's (PgStore::migrate creates
-- `idempotency_records`, which also holds the ledger consumer's processed event ids). Created
-- at start-up when missing. The provider keeps its own state, in its own program.

-- One row per charge. `status` follows the state machine (state_machine.rs); `authorizing` is
-- committed before the provider is called, and the final state with the request's record.
CREATE TABLE IF NOT EXISTS charges (
    id              text        PRIMARY KEY,
    account         text        NOT NULL,
    -- The provider's idempotency key of the create call.
    provider_key    text        NOT NULL,
    -- The operation the charge holds: its provider_key, while within the provider's window (a
    -- retry finds its charge by it); NULL once given up to a new charge of the same key after
    -- the window. UNIQUE with the account (below): one charge per operation.
    operation       text,
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
    -- The provider's key of the last capture, refund or cancellation call, and its amount: held
    -- while the charge is capturing, refunding or canceling, for the retry and the reconciler.
    call_key        text        NOT NULL DEFAULT '',
    call_amount     bigint      NOT NULL DEFAULT 0,
    -- When that call began, in ms since the epoch: the reconciler sends it again only within the
    -- provider's window from then.
    call_started    bigint      NOT NULL DEFAULT (extract(epoch FROM now()) * 1000)::bigint,
    -- The refunds made, each under its provider key, as JSON ([{"call_key", "id", "amount"}]): a
    -- retry of one is answered from here, never counted again.
    refunds         text        NOT NULL DEFAULT '[]',
    -- The provider's key of the capture made: a retry of it gets the charge.
    capture_key     text        NOT NULL DEFAULT '',
    -- The reconciler took the call in flight over: a run whose own call is refused leaves it.
    reconciling     boolean     NOT NULL DEFAULT false,
    -- Seconds since the Unix epoch, as the API shows it.
    created         bigint      NOT NULL,
    seq             bigserial,
    opened_at       timestamptz NOT NULL DEFAULT statement_timestamp(),
    -- The last change of status: the reconciler settles charges in an intermediate state since
    -- long ago.
    updated_at      timestamptz NOT NULL DEFAULT statement_timestamp()
);

CREATE INDEX IF NOT EXISTS charges_account ON charges (account, seq);
-- The last line of defence: one charge per operation, whatever ran twice in front of it.
CREATE UNIQUE INDEX IF NOT EXISTS charges_operation ON charges (account, operation);
CREATE INDEX IF NOT EXISTS charges_unsettled ON charges (updated_at)
    WHERE status IN ('authorizing', 'capturing', 'refunding', 'canceling');

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
