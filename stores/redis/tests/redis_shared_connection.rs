//! `SharedConnection`: the store's connection handling for an application's own commands, on
//! one `redis-server`.

use std::time::{Duration, Instant};

use deadpool_redis::redis::{self, Script};
use test_servers::redis_server::RedisServer;
use tower_idempotency_redis::{RedisStore, RedisStoreError};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_scripts_and_pipelines_run_on_the_stores_connection() {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url()).expect("a store");
    let redis = store.shared_connection();
    let mut set = redis::cmd("HSET");
    set.arg("{acct}:balance").arg("eur").arg(100);
    let added: i64 = redis.query(&set).await.expect("HSET");
    assert_eq!(added, 1);
    let script = Script::new("return redis.call('HINCRBY', KEYS[1], 'eur', ARGV[1])");
    let balance: i64 = redis
        .run(|mut c| async move {
            script
                .key("{acct}:balance")
                .arg(-30)
                .invoke_async(&mut c)
                .await
        })
        .await
        .expect("the script");
    assert_eq!(balance, 70);
    let mut pipe = redis::pipe();
    pipe.cmd("HGET").arg("{acct}:balance").arg("eur");
    pipe.cmd("EXISTS").arg("{acct}:balance");
    let (eur, exists): (i64, bool) = redis
        .run(|mut c| async move { pipe.query_async(&mut c).await })
        .await
        .expect("the pipeline");
    assert_eq!((eur, exists), (70, true));
}

/// A frozen server: a call fails at the store's timeout, and the connection heals once it thaws.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_bounded_by_the_stores_timeout_and_heals() {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url())
        .expect("a store")
        .with_timeout(Duration::from_millis(300));
    let redis = store.shared_connection();
    let ping = redis::cmd("PING");
    let _: String = redis.query(&ping).await.expect("PING");
    let frozen = server.freeze();
    let started = Instant::now();
    let late = redis.query::<String>(&ping).await;
    assert!(matches!(late, Err(RedisStoreError::Timeout(_))), "{late:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    frozen.thaw();
    let pong: String = redis.query(&ping).await.expect("PING after the thaw");
    assert_eq!(pong, "PONG");
}

/// A dedicated connection waits for a blocking read past the store's timeout, up to its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedicated_connection_blocks_up_to_its_own_bound() {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url())
        .expect("a store")
        .with_timeout(Duration::from_millis(200));
    let redis = store.shared_connection();
    let mut reads = redis
        .dedicated(Duration::from_secs(2))
        .await
        .expect("a dedicated connection");
    let mut pop = redis::cmd("BLPOP");
    pop.arg("{q}:jobs").arg(0.5);
    let started = Instant::now();
    let nothing: Option<(String, String)> = pop.query_async(&mut reads).await.expect("BLPOP");
    assert_eq!(nothing, None);
    assert!(started.elapsed() >= Duration::from_millis(500));
    // Past its own bound, it fails.
    let mut forever = redis::cmd("BLPOP");
    forever.arg("{q}:jobs").arg(0);
    let late = forever
        .query_async::<Option<(String, String)>>(&mut reads)
        .await
        .expect_err("bounded");
    assert!(late.is_timeout(), "{late:?}");
}
