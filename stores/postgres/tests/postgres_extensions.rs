//! A record that a later release extended (PROTOCOL.md §5.4): its extensions of types this
//! release does not know, around the trace origin, are skipped, and the record replays from a
//! real PostgreSQL as it was first answered, its origin read from among them.

use sqlx::{Connection, PgConnection, Row};
use test_servers::postgres_server::PostgresServer;
use tower_idempotency::record::RecordId;
use tower_idempotency_postgres::PgStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_with_extensions_this_release_does_not_know_replays() {
    let server = PostgresServer::start();
    let store = PgStore::connect(&server.url()).expect("a store");
    store.migrate().await.expect("the table is created");
    let connect = async || {
        PgConnection::connect(&server.url())
            .await
            .expect("a connection of the test's own")
    };
    tower_idempotency_test::assert_extensions_a_release_does_not_know_are_skipped(
        store,
        async |id: &RecordId| {
            sqlx::query("SELECT completed FROM idempotency_records WHERE id = $1")
                .bind(id.as_bytes().as_slice())
                .fetch_one(&mut connect().await)
                .await
                .expect("the row")
                .get(0)
        },
        async |id: &RecordId, bytes: Vec<u8>| {
            let updated =
                sqlx::query("UPDATE idempotency_records SET completed = $1 WHERE id = $2")
                    .bind(bytes)
                    .bind(id.as_bytes().as_slice())
                    .execute(&mut connect().await)
                    .await
                    .expect("written");
            assert_eq!(updated.rows_affected(), 1);
        },
    )
    .await;
}
