//! What only `PgStore` does, each test on a PostgreSQL server of its own: claims racing across
//! pools, the database going away and coming back, connections cut mid-handler, expiry and the
//! sweep, completions sent twice, the store's own bound on each call, and a sweep or a forget
//! meeting a row another transaction holds.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use http::header::RETRY_AFTER;
use sqlx::{self, Connection, PgConnection, Row};
use test_servers::postgres_server::PostgresServer;
use tokio::sync::Notify;
use tokio::time::Instant;
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::record::{
    ClaimToken, Completed, Fence, Fingerprint, Payload, Record, RecordId, StoredResponse,
};
use tower_idempotency::store::{Claim, ForgetOutcome, OperatorStore, Store, StoreError};
use tower_idempotency::{IdempotencyLayer, Outcome};
use tower_idempotency_postgres::PgStore;
use tower_idempotency_postgres::PgStoreError;
use tower_idempotency_test::{Handler, Reply, created, post, send, service, spawn_send};

/// A server with the store's table, and a store on it.
async fn started() -> (PostgresServer, PgStore) {
    let server = PostgresServer::start();
    let store = PgStore::connect(&server.url()).expect("a store");
    store.migrate().await.expect("the table is created");
    (server, store)
}

/// A connection of the test's own, outside every store's pool.
async fn admin(server: &PostgresServer) -> PgConnection {
    PgConnection::connect(&server.url())
        .await
        .expect("an admin connection")
}

async fn count_rows(server: &PostgresServer) -> i64 {
    let mut conn = admin(server).await;
    sqlx::query("SELECT count(*) FROM idempotency_records")
        .fetch_one(&mut conn)
        .await
        .expect("a count")
        .get(0)
}

/// Ends every client connection but the caller's; returns how many it ended.
async fn terminate_connections(conn: &mut PgConnection) -> i64 {
    sqlx::query(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'",
    )
    .fetch_one(conn)
    .await
    .expect("connections terminated")
    .get(0)
}

fn fingerprint(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

fn done(n: u8, body: &'static str) -> Completed {
    Completed {
        fingerprint: fingerprint(n),
        response: Some(Payload::Plain(Arc::new(StoredResponse {
            status: StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: bytes::Bytes::from_static(body.as_bytes()),
            trailers: None,
        }))),
        origin: None,
    }
}

async fn claimed(store: &PgStore, id: &RecordId, n: u8, lease: Duration) -> ClaimToken {
    match store.claim(id, &fingerprint(n), lease).await {
        Ok(Claim::Claimed(token)) => token,
        other => panic!("expected a new claim, got {other:?}"),
    }
}

/// Sends `key` until the answer is decided (executed or replayed), riding out 409s and 503s.
async fn until_decided<S, B>(svc: &S, key: &str) -> Reply
where
    S: tower::Service<http::Request<axum::body::Body>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let reply = send(svc, post(key, "x")).await;
        match reply.outcome {
            Some(Outcome::Executed | Outcome::Replayed) => return reply,
            Some(Outcome::InFlight | Outcome::StoreUnavailable) => {}
            other => panic!("unexpected outcome {other:?}: {reply:?}"),
        }
        assert!(Instant::now() < deadline, "never decided: {reply:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// 200 concurrent requests with one key, half through each of two layers on two pools of one
/// database: the handler runs once; every other request gets the 409 or the replay.
#[tokio::test(flavor = "multi_thread")]
async fn two_layers_on_two_pools_run_one_of_200_concurrent_requests() {
    let (server, first) = started().await;
    let second = PgStore::connect(&server.url()).expect("a second store");
    let handler = Handler::new(|call| async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        Ok(created(format!("call {}", call.n)))
    });
    let a = service(IdempotencyLayer::new(first), handler.clone());
    let b = service(IdempotencyLayer::new(second), handler.clone());
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            if i % 2 == 0 {
                spawn_send(&a, post("one", "x"))
            } else {
                spawn_send(&b, post("one", "x"))
            }
        })
        .collect();
    let (mut executed, mut in_flight, mut replayed) = (0, 0, 0);
    for task in tasks {
        let reply = task.await.expect("task");
        match reply.outcome {
            Some(Outcome::Executed) => executed += 1,
            Some(Outcome::InFlight) => {
                reply.assert_in_flight();
                in_flight += 1;
            }
            Some(Outcome::Replayed) => {
                assert_eq!(reply.text(), "call 1");
                replayed += 1;
            }
            other => panic!("unexpected outcome {other:?}: {reply:?}"),
        }
    }
    assert_eq!(executed, 1, "{in_flight} in flight, {replayed} replayed");
    assert_eq!(in_flight + replayed, 199);
    assert_eq!(handler.calls(), 1);
}

/// Claims of one key racing from four pools: exactly one wins, whether the key is new or holds
/// a row whose time is up, and no claim fails (a row committed after a claim's snapshot makes it
/// run its statement again, not answer nothing).
#[tokio::test(flavor = "multi_thread")]
async fn claims_racing_across_pools_have_one_winner_over_a_new_or_expired_row() {
    let (server, store) = started().await;
    let stores: Vec<PgStore> = (0..4)
        .map(|_| PgStore::connect(&server.url()).expect("a store"))
        .collect();
    for round in 0..20 {
        let id = RecordId::new(b"race", &format!("key-{round}"));
        if round % 2 == 1 {
            // A record whose window is over, not yet swept.
            let token = claimed(&store, &id, 0, Duration::from_secs(30)).await;
            assert!(
                store
                    .complete(&id, &token, &done(0, "old"), Duration::from_millis(1))
                    .await
                    .unwrap()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let tasks: Vec<_> = (0..100u8)
            .map(|n| {
                let store = stores[usize::from(n) % stores.len()].clone();
                tokio::spawn(async move {
                    store
                        .claim(&id, &fingerprint(n), Duration::from_secs(30))
                        .await
                })
            })
            .collect();
        let mut winners = 0;
        for task in tasks {
            match task.await.expect("task") {
                Ok(Claim::Claimed(_)) => winners += 1,
                Ok(Claim::Existing(Record::InFlight(_))) => {}
                other => panic!("round {round}: unexpected {other:?}"),
            }
        }
        assert_eq!(winners, 1, "round {round}");
    }
}

/// With the database down, a request gets 503 with `Retry-After` and the handler never runs; the
/// store's error, given at once, keeps sqlx's. Once the database is back, the next request runs:
/// the pool's connections to the old server are not reused, and nothing is restarted.
#[tokio::test(flavor = "multi_thread")]
async fn database_down_gets_503_and_the_next_request_after_it_is_back_runs() {
    let (mut server, store) = started().await;
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = service(IdempotencyLayer::new(store.clone()), handler.clone());
    // Connections in the pool, to the server about to go.
    let before = send(&svc, post("before", "x")).await;
    assert_eq!(before.outcome, Some(Outcome::Executed));

    tokio::task::block_in_place(|| server.stop());
    for attempt in 0..3 {
        let sent = Instant::now();
        let reply = send(&svc, post("k", "x")).await;
        // The first call may be the one that finds the server gone: when the pool had already
        // dropped its dead connections, sqlx retries the refused connect until the store's
        // timeout (1 s). From then on the store knows, and a refusal is reported at once.
        let bound = if attempt == 0 {
            Duration::from_millis(1500)
        } else {
            Duration::from_millis(500)
        };
        assert!(sent.elapsed() < bound, "{:?}", sent.elapsed());
        reply.assert_problem(
            ProblemKind::StoreUnavailable,
            StatusCode::SERVICE_UNAVAILABLE,
        );
        assert!(reply.header(RETRY_AFTER).is_some(), "{reply:?}");
    }
    assert_eq!(
        handler.calls(),
        1,
        "the handler never ran while it was down"
    );
    let id = RecordId::new(b"", "direct");
    match store
        .claim(&id, &fingerprint(1), Duration::from_secs(1))
        .await
    {
        Err(StoreError::Unavailable(source)) => assert!(
            matches!(
                source.downcast_ref::<PgStoreError>(),
                Some(PgStoreError::Database(sqlx::Error::Io(_)))
            ),
            "{source:?}"
        ),
        other => panic!("expected the store unavailable, got {other:?}"),
    }

    match store.check().await {
        Err(PgStoreError::Database(sqlx::Error::Io(_))) => {}
        other => panic!("expected a connection error, got {other:?}"),
    }

    tokio::task::block_in_place(|| server.restart());
    let reply = send(&svc, post("k", "x")).await;
    assert_eq!(reply.outcome, Some(Outcome::Executed), "{reply:?}");
    assert_eq!(reply.text(), "call 2");
    // The record written before the outage is still there.
    let replay = send(&svc, post("before", "x")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, before.body);
    assert_eq!(handler.calls(), 2);
}

/// A handler that says when it started, then waits for the gate before it answers.
fn gated_handler() -> (Handler, Arc<Notify>, Arc<Notify>) {
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = {
        let (started, gate) = (started.clone(), gate.clone());
        Handler::new(move |call| {
            let (started, gate) = (started.clone(), gate.clone());
            async move {
                started.notify_one();
                gate.notified().await;
                Ok(created(format!("charge {}", call.n)))
            }
        })
    };
    (handler, started, gate)
}

/// Every connection terminated while the handler runs (its lease renewals and its completion
/// meet dead connections): the client, retrying until the answer is decided, gets the one
/// execution's response, and the handler runs once.
#[tokio::test(flavor = "multi_thread")]
async fn connections_terminated_mid_handler_leave_one_execution() {
    let (server, store) = started().await;
    let (handler, started, gate) = gated_handler();
    let layer = IdempotencyLayer::new(store).lease(Duration::from_millis(600));
    let svc = service(layer, handler.clone());
    let mut conn = admin(&server).await;

    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    assert!(terminate_connections(&mut conn).await >= 1);
    // Renewals (every 200 ms) meet the dead connections.
    tokio::time::sleep(Duration::from_millis(500)).await;
    terminate_connections(&mut conn).await;
    gate.notify_one();
    let first = first.await.expect("the first request");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");

    let decided = until_decided(&svc, "k").await;
    assert_eq!(decided.outcome, Some(Outcome::Replayed), "{decided:?}");
    assert_eq!(decided.body, first.body);
    assert_eq!(handler.calls(), 1, "no second execution");
}

/// The database killed (every process at once, as in a crash) while the handler runs, and
/// started again: the handler's completion lands once it is back, and the client, retrying until
/// the answer is decided, gets the one execution's response.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_killed_mid_handler_and_restarted_leaves_one_execution() {
    let (mut server, store) = started().await;
    let (handler, started, gate) = gated_handler();
    let layer = IdempotencyLayer::new(store).lease(Duration::from_secs(5));
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    tokio::task::block_in_place(|| server.kill());
    gate.notify_one();
    // The client gets its response; storing it waits for the database.
    let first = first.await.expect("the first request");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        shutdown.running(),
        1,
        "the completion is still being retried"
    );

    tokio::task::block_in_place(|| server.restart());
    let decided = until_decided(&svc, "k").await;
    assert_eq!(decided.outcome, Some(Outcome::Replayed), "{decided:?}");
    assert_eq!(decided.body, first.body);
    assert_eq!(handler.calls(), 1, "no second execution");
}

/// A record past its window is claimable again at once, before any sweep; the sweep deletes
/// expired rows (completed or in flight) and keeps live ones.
#[tokio::test(flavor = "multi_thread")]
async fn a_record_past_its_window_is_claimable_again_and_the_sweep_deletes_it() {
    let (server, store) = started().await;
    let store = store.with_sweep_interval(None);
    let window = Duration::from_secs(1);
    let lease = Duration::from_secs(30);
    let id = RecordId::new(b"", "windowed");
    let token = claimed(&store, &id, 1, lease).await;
    assert!(
        store
            .complete(&id, &token, &done(1, "first"), window)
            .await
            .unwrap()
    );
    assert!(matches!(
        store.claim(&id, &fingerprint(2), lease).await,
        Ok(Claim::Existing(Record::Completed(_)))
    ));
    tokio::time::sleep(window + Duration::from_millis(200)).await;
    let again = claimed(&store, &id, 2, lease).await;
    assert_ne!(again, token);
    assert_eq!(count_rows(&server).await, 1, "the claim took the row over");

    // Two rows whose time is up: a completed one and an in-flight one.
    let completed = RecordId::new(b"", "completed");
    let token = claimed(&store, &completed, 3, lease).await;
    assert!(
        store
            .complete(&completed, &token, &done(3, "x"), window)
            .await
            .unwrap()
    );
    claimed(&store, &RecordId::new(b"", "in-flight"), 4, window).await;
    tokio::time::sleep(window + Duration::from_millis(200)).await;
    assert_eq!(count_rows(&server).await, 3);
    assert_eq!(store.sweep().await.expect("a sweep"), 2);
    assert_eq!(count_rows(&server).await, 1, "the live claim is kept");
    assert!(store.renew(&id, &again, lease).await.unwrap());
    assert_eq!(store.sweep().await.expect("a sweep"), 0);
}

/// The store sweeps by itself at its interval, and stops when its last clone is dropped.
#[tokio::test(flavor = "multi_thread")]
async fn the_background_sweep_runs_until_the_store_is_dropped() {
    let (server, store) = started().await;
    let every = Duration::from_millis(200);
    let store = store.with_sweep_interval(Some(every));
    let expire_soon = async |store: &PgStore, key: &str| {
        let id = RecordId::new(b"", key);
        let token = claimed(store, &id, 1, Duration::from_secs(30)).await;
        assert!(
            store
                .complete(&id, &token, &done(1, "x"), Duration::from_millis(1))
                .await
                .unwrap()
        );
    };
    for n in 0..3 {
        expire_soon(&store, &format!("key-{n}")).await;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while count_rows(&server).await > 0 {
        assert!(Instant::now() < deadline, "the sweep never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    drop(store);
    let unswept = PgStore::connect(&server.url())
        .expect("a store")
        .with_sweep_interval(None);
    expire_soon(&unswept, "after-the-drop").await;
    tokio::time::sleep(every * 4).await;
    assert_eq!(
        count_rows(&server).await,
        1,
        "the dropped store's sweep stopped"
    );
}

/// A backlog larger than one run of the background sweep (50 000 rows) is worked off at once, run
/// after run, not one run per interval: a store that takes more new keys than a run removes per
/// interval keeps up.
#[tokio::test(flavor = "multi_thread")]
async fn the_background_sweep_works_off_a_backlog_without_waiting_an_interval() {
    let (server, store) = started().await;
    let every = Duration::from_secs(10);
    let store = store.with_sweep_interval(Some(every));
    let rows: i32 = 60_000;
    sqlx::query(
        "INSERT INTO idempotency_records (id, fingerprint, token, completed, expires_at) \
         SELECT decode(lpad(to_hex(g), 32, '0'), 'hex'), decode(repeat('00', 32), 'hex'), \
                decode(repeat('00', 16), 'hex'), NULL, now() - interval '1 hour' \
         FROM generate_series(1, $1) AS g",
    )
    .bind(rows)
    .execute(store.pool())
    .await
    .expect("expired rows");
    // The first call starts the sweep, somewhere in its first interval.
    claimed(
        &store,
        &RecordId::new(b"", "live"),
        1,
        Duration::from_secs(60),
    )
    .await;
    let deadline = Instant::now() + every + Duration::from_secs(5);
    while count_rows(&server).await > i64::from(rows) {
        assert!(Instant::now() < deadline, "the sweep never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let first_run = Instant::now();
    while count_rows(&server).await > 1 {
        assert!(
            first_run.elapsed() < every / 2,
            "the rows past the first run's cap wait for the next interval"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A completion sent again with the same token (its first answer was lost) answers `true`, and
/// changes nothing; different bytes under the same token, or another token, answer `false`.
#[tokio::test(flavor = "multi_thread")]
async fn a_completion_sent_again_with_its_token_answers_true() {
    let (server, store) = started().await;
    let id = RecordId::new(b"", "resent");
    let token = claimed(&store, &id, 1, Duration::from_secs(30)).await;
    let window = Duration::from_secs(60);
    let expires_at = async || -> String {
        sqlx::query("SELECT expires_at::text FROM idempotency_records")
            .fetch_one(&mut admin(&server).await)
            .await
            .expect("the row")
            .get(0)
    };
    assert!(
        store
            .complete(&id, &token, &done(1, "a"), window)
            .await
            .unwrap()
    );
    let first_expiry = expires_at().await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        store
            .complete(&id, &token, &done(1, "a"), window)
            .await
            .unwrap(),
        "the same completion again"
    );
    assert_eq!(
        expires_at().await,
        first_expiry,
        "the window is not extended"
    );
    assert!(
        !store
            .complete(&id, &token, &done(1, "b"), window)
            .await
            .unwrap()
    );
    let other = ClaimToken::new(Fence::new(1));
    assert!(
        !store
            .complete(&id, &other, &done(1, "a"), window)
            .await
            .unwrap()
    );
    match store.claim(&id, &fingerprint(1), window).await {
        Ok(Claim::Existing(Record::Completed(completed))) => assert_eq!(completed, done(1, "a")),
        other => panic!("expected the first completion, got {other:?}"),
    }
}

/// An owner whose lease ran out and whose key was claimed again: its renew, release and complete
/// answer `false`, and the row still carries the new claim.
#[tokio::test(flavor = "multi_thread")]
async fn renew_and_release_of_a_lost_claim_answer_false() {
    let (server, store) = started().await;
    let id = RecordId::new(b"", "lost");
    let lease = Duration::from_millis(300);
    let old = claimed(&store, &id, 1, lease).await;
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let new = claimed(&store, &id, 2, Duration::from_secs(30)).await;
    assert!(!store.renew(&id, &old, lease).await.unwrap());
    assert!(!store.release(&id, &old).await.unwrap());
    assert!(
        !store
            .complete(&id, &old, &done(1, "stale"), Duration::from_secs(60))
            .await
            .unwrap()
    );
    let token: Vec<u8> = sqlx::query("SELECT token FROM idempotency_records")
        .fetch_one(&mut admin(&server).await)
        .await
        .expect("the row")
        .get(0);
    assert_eq!(token, new.as_bytes());
    assert!(store.release(&id, &new).await.unwrap());
}

/// Each call is bounded by the store's timeout, even when the statement waits on a lock; the claim
/// whose answer was lost is released behind it once the lock goes, so the key is free again.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_is_bounded_by_the_store_timeout_and_a_lost_claim_is_released() {
    let (server, store) = started().await;
    let timeout = Duration::from_millis(300);
    let store = store.with_timeout(timeout);
    let id = RecordId::new(b"", "locked");
    // The pool's connection has the claim statement prepared, so the claim below reaches the
    // point of writing, and waits there (preparing it would wait for the lock before that).
    claimed(
        &store,
        &RecordId::new(b"", "warm"),
        1,
        Duration::from_secs(30),
    )
    .await;
    while store.pool().num_idle() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut conn = admin(&server).await;
    let mut locked = conn.begin().await.expect("a transaction");
    sqlx::query("LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locked)
        .await
        .expect("the table locked");

    let started = Instant::now();
    let claim = store
        .claim(&id, &fingerprint(1), Duration::from_secs(30))
        .await;
    assert!(
        matches!(claim, Err(StoreError::Timeout(t)) if t == timeout),
        "{claim:?}"
    );
    assert!(started.elapsed() < timeout * 3, "{:?}", started.elapsed());

    locked.commit().await.expect("the lock released");
    // The lost claim lands once the lock is gone, and is released behind it.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match store
            .claim(&id, &fingerprint(2), Duration::from_secs(30))
            .await
        {
            Ok(Claim::Claimed(_)) => break,
            Ok(Claim::Existing(Record::InFlight(r))) => assert_eq!(r.fingerprint, fingerprint(1)),
            other => panic!("unexpected {other:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "the lost claim was never released"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `check` names a missing table; `migrate` creates it, also when run twice at once; a table of
/// another name, in another schema, works the same.
#[tokio::test(flavor = "multi_thread")]
async fn check_names_a_missing_table_and_migrate_creates_it() {
    let server = PostgresServer::start();
    let store = PgStore::connect(&server.url())
        .expect("a store")
        .with_table("billing.records");
    match store.check().await {
        Err(PgStoreError::MissingTable(table)) => assert_eq!(table, "billing.records"),
        other => panic!("expected a missing table, got {other:?}"),
    }
    sqlx::query("CREATE SCHEMA billing")
        .execute(&mut admin(&server).await)
        .await
        .expect("a schema");
    let other = PgStore::connect(&server.url())
        .expect("a store")
        .with_table("billing.records");
    let (a, b) = tokio::join!(store.migrate(), other.migrate());
    a.expect("a migration");
    b.expect("a concurrent migration");
    store.migrate().await.expect("a migration again");
    store.check().await.expect("the table is there");

    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = service(IdempotencyLayer::new(store), handler.clone());
    let first = send(&svc, post("k", "x")).await;
    let replay = send(&svc, post("k", "x")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);
    let rows: i64 = sqlx::query("SELECT count(*) FROM billing.records")
        .fetch_one(&mut admin(&server).await)
        .await
        .expect("a count")
        .get(0);
    assert_eq!(rows, 1);
}

/// Outside a Tokio runtime, `connect` is a clear error, not sqlx's panic.
#[test]
fn connect_outside_a_runtime_is_an_error() {
    let err = PgStore::connect("postgres://127.0.0.1:1/none").expect_err("no runtime");
    assert!(matches!(err, PgStoreError::NoRuntime), "{err}");
}

/// The start-up and administration calls can run on a spawned task: their futures are `Send`.
#[tokio::test]
async fn administration_futures_are_send() {
    let (server, store) = started().await;
    let task = tokio::spawn(async move {
        store.migrate().await?;
        store.check().await?;
        store.sweep().await.map(drop)
    });
    task.await
        .expect("the task")
        .expect("migrate, check and sweep");
    drop(server);
}

/// The database numbers each claim (§5.3): a takeover of an expired row gets one more than that
/// row's fence when the row's is ahead of the clock, and a claim of a swept row (the database
/// forgot the key) a fence from the clock, still larger than every fence before it.
#[tokio::test(flavor = "multi_thread")]
async fn fences_grow_across_a_takeover_and_a_swept_row() {
    let (server, store) = started().await;
    let id = RecordId::new(b"", "fenced");
    let lease = Duration::from_millis(200);
    let first = claimed(&store, &id, 1, lease).await;
    let ahead = first.fence().get() + 60_000_000;
    // A fence a minute ahead of the clock, as a row written by a clock that ran fast would hold.
    sqlx::query("UPDATE idempotency_records SET token = int8send($1) || substring(token FROM 9)")
        .bind(i64::try_from(ahead).expect("a fence fits an int8"))
        .execute(&mut admin(&server).await)
        .await
        .expect("the row's fence moved ahead");
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let taken_over = claimed(&store, &id, 1, lease).await;
    assert_eq!(
        taken_over.fence(),
        Fence::new(ahead + 1),
        "§5.3: a takeover gets one more than the fence it displaces, when that is ahead of the clock"
    );

    sqlx::query("DELETE FROM idempotency_records")
        .execute(&mut admin(&server).await)
        .await
        .expect("the row is swept");
    let after_sweep = claimed(&store, &id, 1, lease).await;
    assert!(
        after_sweep.fence() > first.fence(),
        "§5.3: a claim of a forgotten key is numbered from the clock: {:?} after {:?}",
        after_sweep.fence(),
        first.fence()
    );
    assert!(
        store.release(&id, &after_sweep).await.expect("release"),
        "§10.1 release: the claim's own release, matched by its token"
    );
}

/// Backends of the server waiting for a lock (a row another transaction holds).
async fn waiting_for_a_lock(conn: &mut PgConnection) -> i64 {
    sqlx::query("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
        .fetch_one(conn)
        .await
        .expect("the waiting backends")
        .get(0)
}

/// Until `task` has finished or a backend waits for a lock: the moment a statement that would
/// wait for a row another transaction holds is waiting for it.
async fn finished_or_waiting<T>(task: &tokio::task::JoinHandle<T>, conn: &mut PgConnection) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !task.is_finished() && waiting_for_a_lock(conn).await == 0 {
        assert!(Instant::now() < deadline, "neither finished nor waiting");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// §10.1 complete, no live record: a run whose lease ran out, whose key another claim took over
/// and then released (the row expired in place, carrying the other claim's token), still writes
/// its completion: the work ran, and the retry replays it rather than run it a second time.
#[tokio::test(flavor = "multi_thread")]
async fn a_completion_over_a_row_another_claim_took_over_and_released_is_written() {
    let (_server, store) = started().await;
    let id = RecordId::new(b"", "late");
    let slow = claimed(&store, &id, 1, Duration::from_millis(1)).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let other = claimed(&store, &id, 1, Duration::from_secs(30)).await;
    assert!(store.release(&id, &other).await.unwrap());
    assert!(
        store
            .complete(&id, &slow, &done(1, "late"), Duration::from_secs(60))
            .await
            .unwrap(),
        "§10.1: a completion over no live record is written"
    );
    match store
        .claim(&id, &fingerprint(1), Duration::from_secs(30))
        .await
    {
        Ok(Claim::Existing(Record::Completed(completed))) => {
            assert_eq!(completed, done(1, "late"), "the retry replays the late run");
        }
        other => panic!("expected the late run's record, got {other:?}"),
    }
}

/// §10.9: forgetting one key, completed or forced in flight, touches no other: a claim in flight
/// on another key still holds it (its renewal lands, a duplicate finds it), and another
/// completed record still replays.
#[tokio::test(flavor = "multi_thread")]
async fn forgetting_one_key_leaves_every_other_key_alone() {
    let (_server, store) = started().await;
    let lease = Duration::from_secs(30);
    let running = RecordId::new(b"", "running");
    let held = claimed(&store, &running, 1, lease).await;
    let kept = RecordId::new(b"", "kept");
    let token = claimed(&store, &kept, 2, lease).await;
    assert!(
        store
            .complete(&kept, &token, &done(2, "kept"), lease)
            .await
            .unwrap()
    );
    let forgotten = RecordId::new(b"", "forgotten");
    let token = claimed(&store, &forgotten, 3, lease).await;
    assert!(
        store
            .complete(&forgotten, &token, &done(3, "x"), lease)
            .await
            .unwrap()
    );
    let stuck = RecordId::new(b"", "stuck");
    claimed(&store, &stuck, 4, lease).await;

    let others_untouched = async |after: &str| {
        assert!(
            store.renew(&running, &held, lease).await.unwrap(),
            "§10.2: after {after}, the claim in flight on another key still holds it"
        );
        assert!(
            matches!(
                store.claim(&running, &fingerprint(1), lease).await,
                Ok(Claim::Existing(Record::InFlight(_)))
            ),
            "after {after}, a duplicate still finds the claim in flight"
        );
        match store.claim(&kept, &fingerprint(2), lease).await {
            Ok(Claim::Existing(Record::Completed(completed))) => {
                assert_eq!(completed, done(2, "kept"));
            }
            other => panic!("after {after}, expected the kept record, got {other:?}"),
        }
    };
    assert!(store.forget(&forgotten, false).await.unwrap().forgotten());
    others_untouched("forgetting a completed key").await;
    assert!(store.forget(&stuck, true).await.unwrap().forgotten());
    others_untouched("forcing a forget in flight").await;
}

/// §10.9: a forget decides on the row as it is when it gets it, never on an earlier read. A
/// transaction takes the completed row over as a claim does (a new token, in flight, a new lease)
/// and holds it while the forget, not forced, waits for the row; once the takeover commits, the
/// forget finds a claim in flight and refuses, and the claim keeps the key: a retry is not run
/// beside it.
#[tokio::test(flavor = "multi_thread")]
async fn a_forget_that_waited_for_a_row_taken_over_decides_on_the_claim() {
    let (server, store) = started().await;
    let lease = Duration::from_secs(30);
    let id = RecordId::new(b"", "taken-over");
    let first = claimed(&store, &id, 1, lease).await;
    assert!(
        store
            .complete(&id, &first, &done(1, "first"), lease)
            .await
            .unwrap()
    );

    let takeover = ClaimToken::new(Fence::new(first.fence().get() + 1));
    let mut conn = admin(&server).await;
    let mut tx = conn.begin().await.expect("a transaction");
    sqlx::query(
        "UPDATE idempotency_records
         SET fingerprint = $2, token = $3, completed = NULL,
             expires_at = statement_timestamp() + interval '30 seconds'
         WHERE id = $1",
    )
    .bind(id.as_bytes().as_slice())
    .bind(fingerprint(2).as_bytes().as_slice())
    .bind(takeover.as_bytes().as_slice())
    .execute(&mut *tx)
    .await
    .expect("the row taken over");
    let forget = tokio::spawn({
        let (store, id) = (store.clone(), id);
        async move { store.forget(&id, false).await }
    });
    let mut watcher = admin(&server).await;
    finished_or_waiting(&forget, &mut watcher).await;
    tx.commit().await.expect("the takeover committed");

    match forget.await.expect("the forget") {
        Ok(ForgetOutcome::Refused(view)) => assert_eq!(view.fence, takeover.fence()),
        other => panic!("§10.9: a claim in flight is not forgotten unforced, got {other:?}"),
    }
    assert!(
        store.renew(&id, &takeover, lease).await.unwrap(),
        "the claim still holds its key"
    );
    assert!(matches!(
        store.claim(&id, &fingerprint(2), lease).await,
        Ok(Claim::Existing(Record::InFlight(_)))
    ));
}

/// §10.8: the sweep skips a row another transaction holds. A consumer's transaction takes over
/// the expired row of a message redelivered after its window (a claim takes a row over the same
/// way) and holds it for its work; a sweep run meanwhile deletes nothing, and once the work
/// commits, its record stands: the next redelivery is skipped, not run a third time.
#[tokio::test(flavor = "multi_thread")]
async fn the_sweep_keeps_a_row_taken_over_while_it_runs() {
    let (server, store) = started().await;
    let store = store.with_sweep_interval(None);
    let mut consumer = admin(&server).await;
    let window = Duration::from_secs(3600);
    assert!(
        store
            .mark_processed(&mut consumer, "ledger", "evt", Duration::from_millis(1))
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(20)).await;

    let mut tx = consumer.begin().await.expect("a transaction");
    assert!(
        store
            .mark_processed(&mut tx, "ledger", "evt", window)
            .await
            .unwrap(),
        "redelivered after its window: processed again"
    );
    let sweep = tokio::spawn({
        let store = store.clone();
        async move { store.sweep().await }
    });
    let mut watcher = admin(&server).await;
    finished_or_waiting(&sweep, &mut watcher).await;
    tx.commit().await.expect("the work committed");

    assert_eq!(
        sweep.await.expect("the sweep").expect("a sweep"),
        0,
        "§10.8: the row taken over is skipped"
    );
    assert!(
        !store
            .mark_processed(&mut consumer, "ledger", "evt", window)
            .await
            .unwrap(),
        "the next redelivery is skipped"
    );
}

/// §5.3: a takeover counts on the fence of the row it displaces up to a day ahead of the
/// database's clock (a failover to a standby whose clock is an hour behind): one past it. A fence
/// more than a day ahead was written before claims had fences, and the clock numbers the claim.
#[tokio::test(flavor = "multi_thread")]
async fn a_takeover_counts_on_a_fence_up_to_a_day_ahead_of_the_clock() {
    let (server, store) = started().await;
    let id = RecordId::new(b"", "failed-over");
    let lease = Duration::from_secs(30);
    let first = claimed(&store, &id, 1, lease).await;
    let mut conn = admin(&server).await;
    let hour = 3_600_000_000;
    let mut expired_with_fence = async |fence: u64| {
        sqlx::query(
            "UPDATE idempotency_records
             SET token = int8send($1) || substring(token FROM 9),
                 expires_at = statement_timestamp() - interval '1 millisecond'",
        )
        .bind(i64::try_from(fence).expect("a fence fits an int8"))
        .execute(&mut conn)
        .await
        .expect("the row's fence moved ahead, and its lease ran out");
    };
    let an_hour_ahead = first.fence().get() + hour;
    expired_with_fence(an_hour_ahead).await;
    let taken_over = claimed(&store, &id, 1, lease).await;
    assert_eq!(
        taken_over.fence(),
        Fence::new(an_hour_ahead + 1),
        "§5.3: one past a fence an hour ahead of the clock"
    );

    let two_days_ahead = taken_over.fence().get() + 48 * hour;
    expired_with_fence(two_days_ahead).await;
    let numbered = claimed(&store, &id, 1, lease).await;
    assert!(
        numbered.fence() > first.fence() && numbered.fence().get() < first.fence().get() + hour,
        "§5.3: a fence two days ahead is not counted on; the clock numbers the claim: {:?}",
        numbered.fence()
    );
}
