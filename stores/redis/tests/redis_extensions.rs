//! A record that a later release extended (PROTOCOL.md §5.4): its extensions of types this
//! release does not know, around the trace origin, are skipped, and the record replays from a
//! real `redis-server` as it was first answered, its origin read from among them.

use deadpool_redis::redis;
use test_servers::redis_server::RedisServer;
use tower_idempotency::record::RecordId;
use tower_idempotency_redis::RedisStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_with_extensions_this_release_does_not_know_replays() {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url()).expect("a valid url");
    let client = redis::Client::open(server.url()).expect("a valid url");
    let key = |id: &RecordId| format!("idempotency:{{{id}}}");
    tower_idempotency_test::assert_extensions_a_release_does_not_know_are_skipped(
        store,
        async |id: &RecordId| {
            let mut conn = client.get_connection().expect("a connection");
            (redis::cmd("GET").arg(key(id)).query(&mut conn)).expect("the record")
        },
        async |id: &RecordId, bytes: Vec<u8>| {
            let mut conn = client.get_connection().expect("a connection");
            let set: String = (redis::cmd("SET")
                .arg(key(id))
                .arg(bytes)
                .arg("PX")
                .arg(60_000))
            .query(&mut conn)
            .expect("written");
            assert_eq!(set, "OK");
        },
    )
    .await;
}
