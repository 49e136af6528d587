-- The payments example's own tables, beside the idempotency layer's (PgStore::migrate creates
-- `idempotency_records`, which also holds the ledger consumer's processed event ids). Created
-- at start-up when missing. The provider keeps its own state, in its own program.

-- One row per charge: what queries look for in columns of their own, the rest of the charge (the
-- `Charge` of ledger/mod.rs) as JSON. `status` follows the state machine (state_machine.rs);
-- `authorizing` is committed before the provider is called, and the final state with the
-- request's record.
CREATE TABLE IF NOT EXISTS charges (
    id          text        PRIMARY KEY,
    account     text        NOT NULL,
    -- The operation the charge holds: the provider key of its create call, while within the
    -- provider's window (a retry finds its charge by it); NULL once given up to a new charge of
    -- the same key after the window. UNIQUE with the account (below): one charge per operation.
    operation   text,
    status      text        NOT NULL,
    -- The charge's call in flight and the reconciler's mark, as in `charge`: what the
    -- reconciler's compare-and-set and an abandoned create look at.
    call_key    text        NOT NULL DEFAULT '',
    reconciling boolean     NOT NULL DEFAULT false,
    charge      text        NOT NULL,
    seq         bigserial,
    opened_at   timestamptz NOT NULL DEFAULT statement_timestamp(),
    -- The last change: the reconciler settles charges in an intermediate state since long ago.
    updated_at  timestamptz NOT NULL DEFAULT statement_timestamp()
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
