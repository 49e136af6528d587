-- The payments example's own tables, beside the idempotency layer's (PgStore::migrate creates
-- `idempotency_records`, which also holds the ledger consumer's processed event ids). Created
-- at start-up when missing.

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

-- A database made before these columns: each charge holds its operation, as its provider_key.
-- Should two charges share one (as a run taken over after its lease ran out could leave), the
-- unique index below cannot be made and start-up stops, naming the pair: settle them by hand
-- (keep the charge the balance counts, set the other's operation to NULL), then start again.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM information_schema.columns
                   WHERE table_schema = current_schema() AND table_name = 'charges'
                     AND column_name = 'operation') THEN
        ALTER TABLE charges ADD COLUMN operation text;
        UPDATE charges SET operation = provider_key;
    END IF;
END $$;
ALTER TABLE charges ADD COLUMN IF NOT EXISTS call_key text NOT NULL DEFAULT '';
ALTER TABLE charges ADD COLUMN IF NOT EXISTS call_amount bigint NOT NULL DEFAULT 0;
ALTER TABLE charges ADD COLUMN IF NOT EXISTS refunds text NOT NULL DEFAULT '[]';
ALTER TABLE charges ADD COLUMN IF NOT EXISTS reconciling boolean NOT NULL DEFAULT false;
ALTER TABLE charges ADD COLUMN IF NOT EXISTS capture_key text NOT NULL DEFAULT '';
ALTER TABLE charges ADD COLUMN IF NOT EXISTS call_started bigint NOT NULL
    DEFAULT (extract(epoch FROM now()) * 1000)::bigint;

CREATE INDEX IF NOT EXISTS charges_account ON charges (account, seq);
-- The last line of defence: one charge per operation, whatever ran twice in front of it.
CREATE UNIQUE INDEX IF NOT EXISTS charges_operation ON charges (account, operation);
DROP INDEX IF EXISTS charges_provider_key;
DROP INDEX IF EXISTS charges_authorizing;
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

-- The simulated provider's idempotency keys (provider/keys/postgres.rs): they stand for an outside
-- service's own records, shared by every instance of the example.
CREATE TABLE IF NOT EXISTS provider_keys (
    key        text        PRIMARY KEY,
    request    text        NOT NULL,
    id         text        NOT NULL,
    -- The largest fence a call with the key carried: a smaller one is refused. A u64, which
    -- only numeric holds whole.
    fence      numeric(20) NOT NULL DEFAULT 0,
    expires_at timestamptz NOT NULL
);
ALTER TABLE provider_keys ADD COLUMN IF NOT EXISTS fence numeric(20) NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS provider_keys_expiry ON provider_keys (expires_at);

-- The simulated provider's payments, kept for good as a provider keeps them: what its payments
-- report lists (the reconciler reads it), and what bounds each payment's refunds. Written in the
-- transaction of the key's claim.
CREATE TABLE IF NOT EXISTS provider_payments (
    id         text        PRIMARY KEY,
    key        text        NOT NULL,
    amount     bigint      NOT NULL,
    refunded   bigint      NOT NULL DEFAULT 0,
    source     text        NOT NULL,
    capture    boolean     NOT NULL,
    outcome    text        NOT NULL,
    reference  text        NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS provider_payments_created ON provider_payments (created_at, id);
