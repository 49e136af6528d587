//! The store's SQL: the schema, and one statement per store call, for a given table.
//!
//! Every time is the database's: `statement_timestamp()`, the start of the statement (not of its
//! transaction, so a completion written late in a caller's transaction measures from its own
//! start), and the same for every instance, whatever their clocks say.

/// The table the store uses unless told otherwise.
pub const DEFAULT_TABLE: &str = "idempotency_records";

/// The schema for [`DEFAULT_TABLE`].
pub(super) const SCHEMA: &str = include_str!("schema.sql");

/// The name of the expiry index in [`SCHEMA`].
const DEFAULT_INDEX: &str = "idempotency_records_expires_at";

/// Serialises concurrent migrations (two instances starting at once): `CREATE TABLE IF NOT
/// EXISTS` alone can fail on a unique violation in the catalogue when two run together.
const MIGRATION_LOCK: i64 = 0x746f_7765_725f_6964; // "tower_id"

/// The database's clock in microseconds since the Unix epoch: a new claim's fence (§5.3).
const NOW_MICROS: &str = "(extract(epoch FROM statement_timestamp()) * 1000000)::int8";

/// How far ahead of the database's clock (µs) a row's fence may be and still be counted on by
/// a takeover: a day. Further ahead, the row was written before claims had fences (its first 8
/// bytes were random), and the clock numbers the claim (§5.3).
const AHEAD: &str = "86400000000";

/// The fence in a token column or value: its first 8 bytes, big-endian.
fn fence_of(token: &str) -> String {
    format!("('x' || encode(substring({token} FROM 1 FOR 8), 'hex'))::bit(64)::int8")
}

/// The store's statements on one table.
#[derive(Debug)]
pub(super) struct Statements {
    /// The table's name as given (`records` or `schema.records`).
    pub(super) table: String,
    /// The schema: `CREATE TABLE IF NOT EXISTS` and `CREATE INDEX IF NOT EXISTS`.
    pub(super) schema: String,
    /// The schema under a transaction-scoped advisory lock: one simple query, one round trip.
    pub(super) migrate: String,
    /// Reads nothing, but fails when the table is missing.
    pub(super) check: String,
    /// $1 id, $2 fingerprint, $3 token, $4 lease (ms). One row: `token`, and for a live record
    /// that is not this claim's, its `fingerprint`, `completed` bytes and `remaining_ms`. No row
    /// when a concurrent transaction wrote the key after this statement's snapshot: run it again.
    pub(super) claim: String,
    /// $1 id, $2 fingerprint, $3 token, $4 completed bytes, $5 ttl (ms). One row affected when
    /// written, or when this token already completed the key with these bytes.
    pub(super) complete: String,
    /// `complete`'s parameters. The common case of `complete` alone: the claim's own in-flight
    /// row, updated in place. One row affected when written; otherwise run `complete`.
    pub(super) complete_claimed: String,
    /// $1 id, $2 token, $3 lease (ms). One row affected when renewed.
    pub(super) renew: String,
    /// $1 id, $2 token. One row affected when released.
    pub(super) release: String,
    /// `complete`, then `NOTIFY` on [`Statements::channel`] with the id in hex when written: one
    /// row returned.
    pub(super) complete_notifying: String,
    /// `complete_claimed`, then `NOTIFY` likewise.
    pub(super) complete_claimed_notifying: String,
    /// `release`, then `NOTIFY` likewise: one row returned when released.
    pub(super) release_notifying: String,
    /// The channel of the table's change notifications: the table's name (without its schema)
    /// and `_changes`.
    pub(super) channel: String,
    /// $1 batch size. Deletes up to that many expired rows, skipping rows other transactions
    /// hold.
    pub(super) sweep: String,
    /// $1 id. The live row, if any: `token`, `fingerprint`, `completed`, `expires_us` (its
    /// expiry in microseconds since the Unix epoch).
    pub(super) inspect: String,
    /// $1 id, $2 force. `inspect`'s row as it was, and `forgotten`: whether it was expired in
    /// place with its record cleared (a completed row always, an in-flight one when forced).
    pub(super) forget: String,
}

impl Statements {
    /// The statements on `table`: a name of lowercase letters, digits and underscores (not
    /// starting with a digit, at most 63 bytes), optionally qualified by a schema of the same form.
    pub(super) fn new(table: &str) -> Result<Self, String> {
        let (schema_name, name) = match table.split_once('.') {
            Some((schema, name)) => (Some(identifier(schema)?), identifier(name)?),
            None => (None, identifier(table)?),
        };
        let quoted = match schema_name {
            Some(schema) => format!("\"{schema}\".\"{name}\""),
            None => format!("\"{name}\""),
        };
        let index_name = format!("{name}_expires_at");
        if index_name.len() > 63 {
            return Err(format!(
                "table name {name:?} is too long for its index name {index_name:?} (63 bytes at most)"
            ));
        }
        let schema = if table == DEFAULT_TABLE {
            SCHEMA.to_owned()
        } else {
            // Through a marker, so the table's own name cannot match inside the index's.
            SCHEMA
                .replace(DEFAULT_INDEX, "\u{0}")
                .replace(DEFAULT_TABLE, &quoted)
                .replace('\u{0}', &format!("\"{index_name}\""))
        };
        let t = &quoted;
        // Within 63 bytes (the index name's rule keeps `name` to 52); tables of one name in two
        // schemas share it, and only wake each other's waits for nothing.
        let channel = format!("{name}_changes");
        // Written over this claim's in-flight row (even past its lease: nobody took the key
        // since), over a row whose time is up, or where there is none. A completion sent
        // again (its first answer was lost) finds the row it wrote: same token, same bytes.
        // It counts as written, and keeps the first one's expiry.
        let complete = format!(
            "INSERT INTO {t} AS r (id, fingerprint, token, completed, expires_at)
VALUES ($1, $2, $3, $4, statement_timestamp() + $5::int8 * interval '1 millisecond')
ON CONFLICT (id) DO UPDATE
SET fingerprint = excluded.fingerprint, token = excluded.token, completed = excluded.completed,
    expires_at = CASE WHEN r.completed IS NULL OR r.expires_at <= statement_timestamp()
                      THEN excluded.expires_at ELSE r.expires_at END
WHERE r.expires_at <= statement_timestamp()
   OR (r.token = excluded.token AND (r.completed IS NULL OR r.completed = excluded.completed))"
        );
        // A plain update: the upsert finds the row through the unique index a second time and
        // locks it before updating it (measured: 37 against 31 µs of the server's time).
        let complete_claimed = format!(
            "UPDATE {t}
SET fingerprint = $2, completed = $4,
    expires_at = statement_timestamp() + $5::int8 * interval '1 millisecond'
WHERE id = $1 AND token = $3 AND completed IS NULL"
        );
        // By the token's unique half (bytes 9..16): a claim whose answer was lost is released
        // without knowing the fence the database gave it. The row is expired, not deleted, so
        // that the next claim takes it over and numbers itself past its fence: a fresh row would
        // take the fence from its statement's start, which a claim sent before this release but
        // run after it would have from before (the sweep deletes the row later).
        let release = format!(
            "UPDATE {t} SET expires_at = statement_timestamp()
WHERE id = $1 AND substring(token FROM 9) = substring($2::bytea FROM 9) AND completed IS NULL
  AND expires_at > statement_timestamp()"
        );
        let mut migrate = format!("SELECT pg_advisory_xact_lock({MIGRATION_LOCK});\n");
        migrate.push_str(&schema);
        Ok(Self {
            table: table.to_owned(),
            schema,
            migrate,
            check: format!("SELECT 1 FROM {t} LIMIT 0"),
            // A live row is read from the statement's snapshot; only when there is none does
            // the insert run (so a replay, a 409 or a 422 takes no lock and writes nothing). Its
            // `ON CONFLICT` takes over a row whose time is up, and leaves a live one alone: a row
            // another transaction committed after the snapshot makes the insert wait, then do
            // nothing, while the snapshot still shows no live row. Then no row comes back, and
            // the caller runs the statement again with a fresh snapshot. The claim's fence (the
            // token's first 8 bytes, §5.3) is the database's clock in microseconds, or one more
            // than the fence of the row it takes over where that is larger; the caller sends the
            // token's unique half and reads the fence back. The lease left is rounded up to the
            // millisecond: a live row has more than zero left (§10.1).
            claim: format!(
                "WITH live AS (
    SELECT token, fingerprint, completed,
           ceil(extract(epoch FROM expires_at - statement_timestamp()) * 1000)::int8 AS remaining_ms
    FROM {t}
    WHERE id = $1 AND expires_at > statement_timestamp()
), claimed AS (
    INSERT INTO {t} AS r (id, fingerprint, token, completed, expires_at)
    SELECT $1, $2, int8send({NOW_MICROS}) || substring($3::bytea FROM 9), NULL,
           statement_timestamp() + $4::int8 * interval '1 millisecond'
    WHERE NOT EXISTS (SELECT FROM live)
    ON CONFLICT (id) DO UPDATE
    SET fingerprint = excluded.fingerprint,
        token = CASE WHEN {r_fence} >= {excluded_fence} AND {r_fence} < {excluded_fence} + {AHEAD}
                     THEN int8send({r_fence} + 1) || substring(excluded.token FROM 9)
                     ELSE excluded.token END,
        completed = NULL, expires_at = excluded.expires_at
    WHERE r.expires_at <= statement_timestamp()
    RETURNING token
)
SELECT token, NULL::bytea AS fingerprint, NULL::bytea AS completed, NULL::int8 AS remaining_ms
FROM claimed
UNION ALL
SELECT token, fingerprint, completed, remaining_ms FROM live",
                r_fence = fence_of("r.token"),
                excluded_fence = fence_of("excluded.token"),
            ),
            complete_notifying: notifying(&complete, &channel),
            complete_claimed_notifying: notifying(&complete_claimed, &channel),
            complete_claimed,
            release_notifying: notifying(&release, &channel),
            complete,
            release,
            channel,
            renew: format!(
                "UPDATE {t} SET expires_at = statement_timestamp() + $3::int8 * interval '1 millisecond'
WHERE id = $1 AND token = $2 AND completed IS NULL AND expires_at > statement_timestamp()"
            ),
            inspect: format!(
                "SELECT token, fingerprint, completed,
       (extract(epoch FROM expires_at) * 1000000)::int8 AS expires_us
FROM {t} WHERE id = $1 AND expires_at > statement_timestamp()"
            ),
            // Expired in place, as a release is, not deleted: the next claim takes the row over
            // and numbers itself past its fence (§5.3); the completed record goes at once, the
            // row with the sweep. `FOR UPDATE` reads the row as a concurrent writer left it.
            forget: format!(
                "WITH old AS (
    SELECT id, token, fingerprint, completed,
           (extract(epoch FROM expires_at) * 1000000)::int8 AS expires_us
    FROM {t} WHERE id = $1 AND expires_at > statement_timestamp()
    FOR UPDATE
), gone AS (
    UPDATE {t} AS r SET expires_at = statement_timestamp(), completed = NULL
    FROM old WHERE r.id = old.id AND (old.completed IS NOT NULL OR $2)
    RETURNING r.id
)
SELECT token, fingerprint, completed, expires_us, EXISTS (SELECT FROM gone) AS forgotten
FROM old"
            ),
            // The oldest first, through the index; `FOR UPDATE` re-checks a row another
            // transaction changed meanwhile (a claim that took it over is live again, and kept).
            sweep: format!(
                "DELETE FROM {t} WHERE id IN (
    SELECT id FROM {t} WHERE expires_at <= statement_timestamp()
    ORDER BY expires_at LIMIT $1
    FOR UPDATE SKIP LOCKED
)"
            ),
        })
    }
}

/// `sql` (an `INSERT` or `DELETE`), then a `NOTIFY` on `channel` for the row it wrote: one row
/// returned for each row written, as many as it affected.
fn notifying(sql: &str, channel: &str) -> String {
    format!(
        "WITH written AS (\n{sql}\nRETURNING id\n)\nSELECT pg_notify('{channel}', encode(id, 'hex')) FROM written"
    )
}

/// `part` if it is a lowercase SQL identifier that needs no quoting.
fn identifier(part: &str) -> Result<&str, String> {
    let mut chars = part.chars();
    let valid = part.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if valid {
        Ok(part)
    } else {
        Err(format!(
            "{part:?} is not a table or schema name of lowercase letters, digits and underscores \
             (at most 63 bytes, not starting with a digit)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_table_uses_the_documented_schema() {
        let statements = Statements::new(DEFAULT_TABLE).unwrap();
        assert_eq!(statements.schema, SCHEMA);
        assert!(
            statements
                .claim
                .contains("INSERT INTO \"idempotency_records\"")
        );
    }

    #[test]
    fn another_table_gets_its_own_names_throughout() {
        let statements = Statements::new("billing.idempotency_records").unwrap();
        let schema = &statements.schema;
        assert!(
            schema.contains("CREATE TABLE IF NOT EXISTS \"billing\".\"idempotency_records\" ("),
            "{schema}"
        );
        assert!(
            schema.contains(
                "CREATE INDEX IF NOT EXISTS \"idempotency_records_expires_at\"\n    ON \"billing\".\"idempotency_records\" (expires_at);"
            ),
            "{schema}"
        );
        let other = Statements::new("records").unwrap();
        assert!(other.schema.contains("\"records_expires_at\""));
        assert!(!other.schema.contains("idempotency_records"));
        for sql in [
            &other.claim,
            &other.complete,
            &other.complete_claimed,
            &other.sweep,
            &other.check,
            &other.inspect,
            &other.forget,
        ] {
            assert!(!sql.contains("idempotency_records"), "{sql}");
        }
    }

    #[test]
    fn names_that_would_need_quoting_are_refused() {
        for bad in [
            "",
            "Records",
            "1records",
            "records; DROP TABLE users",
            "a.b.c",
            "\"records\"",
            ".records",
            &"r".repeat(64),
            // Its index name would pass 63 bytes.
            &"r".repeat(60),
        ] {
            assert!(Statements::new(bad).is_err(), "{bad:?}");
        }
    }
}
