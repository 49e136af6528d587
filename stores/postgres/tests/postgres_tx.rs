//! Transactional completion on `PgStore` (PROTOCOL.md §9.9): a handler writes its rows through
//! `PgTx`, and those rows commit with the request's idempotency record, or neither does. Each
//! test on a PostgreSQL server of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::header::RETRY_AFTER;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use sqlx::{self, Connection, Executor as _, PgConnection, Row};
use test_servers::postgres_server::PostgresServer;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::record::{Completed, Fingerprint, RecordId};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, Outcome};
use tower_idempotency_client::{Attempts, IdempotentRetryLayer};
use tower_idempotency_postgres::{PgStore, PgTx};

/// What the test handler is told to do, by the request body.
async fn charge(mut tx: PgTx, body: String) -> Result<(StatusCode, String), StatusCode> {
    sqlx::query("INSERT INTO effects (body) VALUES ($1)")
        .bind(&body)
        .execute(&mut *tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    match body.as_str() {
        "fail" => Err(StatusCode::INTERNAL_SERVER_ERROR),
        "unavailable" => Err(StatusCode::SERVICE_UNAVAILABLE),
        "panic" => panic!("the handler panicked after its write"),
        "declined" => Ok((StatusCode::PAYMENT_REQUIRED, body)),
        // A charge for a customer that does not exist: the deferred foreign key fails at commit.
        "orphan" => {
            sqlx::query("INSERT INTO orders (customer) VALUES (42)")
                .execute(&mut *tx)
                .await
                .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
            Ok((StatusCode::CREATED, body))
        }
        // A reference already taken: the deferred unique constraint fails at commit.
        "taken" => {
            sqlx::query("INSERT INTO refs (ref) VALUES ('taken')")
                .execute(&mut *tx)
                .await
                .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
            Ok((StatusCode::CREATED, body))
        }
        // A deferred check that fails at commit with the SQLSTATE named after the colon.
        at_commit if at_commit.starts_with("at-commit:") => {
            sqlx::query("INSERT INTO checked_at_commit (code) VALUES ($1)")
                .bind(&at_commit["at-commit:".len()..])
                .execute(&mut *tx)
                .await
                .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
            Ok((StatusCode::CREATED, body))
        }
        // The same failed statement, inside a savepoint the handler rolls back to: its own 402 (a
        // decided answer, stored) commits with the record, and its earlier write with it.
        "savepoint" => {
            let mut savepoint = tx
                .begin()
                .await
                .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
            let duplicate = sqlx::query("INSERT INTO customers (id) VALUES (1)")
                .execute(&mut *savepoint)
                .await;
            assert!(duplicate.is_err(), "customer 1 exists");
            savepoint
                .rollback()
                .await
                .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
            Ok((StatusCode::PAYMENT_REQUIRED, body))
        }
        // The handler's own statement breaks an immediate constraint, and the handler answers
        // with a status the layer stores: the transaction can only roll back.
        "swallowed" => {
            let duplicate = sqlx::query("INSERT INTO customers (id) VALUES (1)")
                .execute(&mut *tx)
                .await;
            assert!(duplicate.is_err(), "customer 1 exists");
            Ok((StatusCode::PAYMENT_REQUIRED, body))
        }
        "cut" => {
            // The connection dies after the write, before the layer commits.
            let pid: i32 = sqlx::query("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await
                .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?
                .get(0);
            drop(tx);
            terminate(pid).await;
            Ok((StatusCode::CREATED, body))
        }
        "held" => {
            // A task outlives the handler with the transaction.
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                drop(tx);
            });
            Ok((StatusCode::CREATED, body))
        }
        _ => Ok((StatusCode::CREATED, body)),
    }
}

tokio::task_local! {
    static SERVER_URL: String;
}

async fn terminate(pid: i32) {
    let url = SERVER_URL.with(Clone::clone);
    let mut admin = PgConnection::connect(&url)
        .await
        .expect("an admin connection");
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(&mut admin)
        .await
        .expect("terminated");
}

struct Fixture {
    server: PostgresServer,
    store: PgStore,
    app: Router,
    calls: Arc<AtomicUsize>,
}

async fn fixture() -> Fixture {
    let server = PostgresServer::start();
    let store = PgStore::connect(&server.url()).expect("a store");
    store.migrate().await.expect("the table is created");
    let mut admin = admin(&server).await;
    admin
        .execute(
            "CREATE TABLE effects (body text NOT NULL);
             CREATE TABLE customers (id int PRIMARY KEY);
             INSERT INTO customers (id) VALUES (1);
             CREATE TABLE orders (
                 customer int NOT NULL REFERENCES customers DEFERRABLE INITIALLY DEFERRED
             );
             CREATE TABLE refs (ref text UNIQUE DEFERRABLE INITIALLY DEFERRED);
             INSERT INTO refs (ref) VALUES ('taken');
             CREATE TABLE checked_at_commit (code text NOT NULL);
             CREATE FUNCTION fail_with_code() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN RAISE EXCEPTION 'deferred check failed' USING ERRCODE = NEW.code; END
             $$;
             CREATE CONSTRAINT TRIGGER fail_at_commit AFTER INSERT ON checked_at_commit
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_with_code();",
        )
        .await
        .expect("the handler's tables");
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let app = Router::new()
        .route(
            "/charges",
            post(move |tx: PgTx, body: String| {
                counter.fetch_add(1, Ordering::SeqCst);
                charge(tx, body)
            }),
        )
        .route(
            "/plain",
            post(|body: String| async move { (StatusCode::CREATED, body) }),
        )
        .route("/serializable", post(write_skew))
        .route_layer(IdempotencyLayer::new(store.clone()).lease(Duration::from_secs(5)));
    Fixture {
        server,
        store,
        app,
        calls,
    }
}

async fn admin(server: &PostgresServer) -> PgConnection {
    PgConnection::connect(&server.url())
        .await
        .expect("an admin connection")
}

struct Answer {
    status: StatusCode,
    outcome: Option<Outcome>,
    kind: Option<ProblemKind>,
    retry_after: Option<String>,
    body: String,
}

impl Answer {
    /// Asserts that this is the answer to a commit a retry cannot fix (PROTOCOL.md §9.9, §7.2):
    /// 422 `commit-rejected`, with no `Retry-After`. `what` names the attempt.
    #[track_caller]
    fn assert_commit_rejected(&self, what: &str) {
        assert_eq!(
            self.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{what}: a failed integrity check is the request's answer, not a 503: {}",
            self.body
        );
        assert!(
            self.problem_type().ends_with("#commit-rejected"),
            "{what}: {}",
            self.body
        );
        assert_eq!(
            (self.kind, self.outcome),
            (
                Some(ProblemKind::CommitRejected),
                Some(Outcome::CommitRejected)
            ),
            "{what}"
        );
        assert_eq!(
            self.retry_after, None,
            "{what}: retrying as it is cannot help"
        );
    }

    /// The `type` member of a problem+json body.
    fn problem_type(&self) -> String {
        serde_json::from_str::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|json| json["type"].as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

impl Fixture {
    async fn send(&self, path: &str, key: &str, body: &str) -> Answer {
        let request = Request::post(path)
            .header("idempotency-key", key)
            .body(Body::from(body.to_owned()))
            .unwrap();
        let response = SERVER_URL
            .scope(self.server.url(), self.app.clone().oneshot(request))
            .await
            .unwrap();
        let status = response.status();
        let outcome = response.extensions().get::<Outcome>().copied();
        let kind = response.extensions().get::<ProblemKind>().copied();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Answer {
            status,
            outcome,
            kind,
            retry_after,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    async fn effects(&self, body: &str) -> i64 {
        let mut admin = admin(&self.server).await;
        sqlx::query("SELECT count(*) FROM effects WHERE body = $1")
            .bind(body)
            .fetch_one(&mut admin)
            .await
            .expect("a count")
            .get(0)
    }

    /// The key's live row: `(completed, live)`, or `None` when there is none (a released claim
    /// leaves its row expired until the sweep: gone for every call, §10.2).
    async fn record(&self, key: &str) -> Option<(bool, bool)> {
        let id = RecordId::new(b"", key);
        let mut admin = admin(&self.server).await;
        sqlx::query(
            "SELECT completed IS NOT NULL, expires_at > statement_timestamp()
             FROM idempotency_records WHERE id = $1 AND expires_at > statement_timestamp()",
        )
        .bind(id.as_bytes().as_slice())
        .fetch_optional(&mut admin)
        .await
        .expect("the record")
        .map(|row| (row.get(0), row.get(1)))
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

/// A stored response commits the handler's rows and the record together; the retry replays and
/// writes nothing. A stored 4xx (a declined card) commits too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_response_commits_the_rows_with_the_record() {
    let f = fixture().await;
    let first = f.send("/charges", "k", "ok").await;
    assert_eq!(
        (first.status, first.outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    assert_eq!(f.effects("ok").await, 1);
    assert_eq!(f.record("k").await, Some((true, true)));

    let replay = f.send("/charges", "k", "ok").await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, "ok");
    assert_eq!((f.effects("ok").await, f.calls()), (1, 1));

    let declined = f.send("/charges", "d", "declined").await;
    assert_eq!(declined.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(f.effects("declined").await, 1, "a stored 402 commits");
    assert_eq!(f.record("d").await, Some((true, true)));
}

/// A handler that fails, panics or answers with a status that is not stored leaves neither its
/// rows nor a record, and its retry runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_panics_and_unstored_statuses_roll_the_rows_back_with_the_claim() {
    let f = fixture().await;
    for (key, body, status) in [
        ("f", "fail", StatusCode::INTERNAL_SERVER_ERROR),
        ("u", "unavailable", StatusCode::SERVICE_UNAVAILABLE),
        ("p", "panic", StatusCode::INTERNAL_SERVER_ERROR),
    ] {
        for attempt in 1..=2 {
            let answer = f.send("/charges", key, body).await;
            assert_eq!(answer.status, status, "{body}, attempt {attempt}");
            assert_eq!(f.effects(body).await, 0, "{body}: nothing committed");
            assert_eq!(f.record(key).await, None, "{body}: the claim was released");
        }
    }
    assert_eq!(f.calls(), 6, "every retry ran again");
}

/// The connection dies after the handler's write and before the commit: the client is told that
/// nothing was done (503), nothing stays, and the retry runs once and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_before_the_commit_leaves_nothing_and_the_retry_runs_once() {
    let f = fixture().await;
    let cut = f.send("/charges", "k", "cut").await;
    assert_eq!(cut.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(cut.outcome, Some(Outcome::StoreUnavailable));
    assert_ne!(cut.body, "cut", "the rolled-back response is not delivered");
    assert_eq!(f.effects("cut").await, 0);
    assert_eq!(f.record("k").await, None, "the claim was released");

    // The retry runs, and this time the connection lives.
    let app = Router::new()
        .route(
            "/charges",
            post(|tx: PgTx| charge(tx, String::from("cut-retry"))),
        )
        .route_layer(IdempotencyLayer::new(f.store.clone()));
    let retry = SERVER_URL
        .scope(
            f.server.url(),
            app.oneshot(
                Request::post("/charges")
                    .header("idempotency-key", "k")
                    .body(Body::from("cut"))
                    .unwrap(),
            ),
        )
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(f.effects("cut-retry").await, 1);
    assert_eq!(f.record("k").await, Some((true, true)));
}

/// A claim lost while the handler ran (its lease ran out and another request claimed the key):
/// the completion is fenced out, and the handler's rows roll back with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_fenced_out_rolls_the_rows_back() {
    let server = PostgresServer::start();
    let store = PgStore::connect(&server.url()).expect("a store");
    store.migrate().await.expect("the table");
    let mut conn = admin(&server).await;
    sqlx::query("CREATE TABLE effects (body text NOT NULL)")
        .execute(&mut conn)
        .await
        .unwrap();
    let url = server.url();
    let app = Router::new()
        .route(
            "/charges",
            post(move |mut tx: PgTx| {
                let url = url.clone();
                async move {
                    sqlx::query("INSERT INTO effects (body) VALUES ('fenced')")
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    // Another claim takes the key meanwhile.
                    let mut other = PgConnection::connect(&url).await.unwrap();
                    sqlx::query("UPDATE idempotency_records SET token = $1 WHERE id = $2")
                        .bind(vec![7u8; 16])
                        .bind(RecordId::new(b"", "k").as_bytes().as_slice())
                        .execute(&mut other)
                        .await
                        .unwrap();
                    (StatusCode::CREATED, "fenced")
                }
            }),
        )
        .route_layer(IdempotencyLayer::new(store));
    let response = app
        .oneshot(
            Request::post("/charges")
                .header("idempotency-key", "k")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let count: i64 = sqlx::query("SELECT count(*) FROM effects")
        .fetch_one(&mut conn)
        .await
        .unwrap()
        .get(0);
    assert_eq!(count, 0, "the fenced-out completion rolled the rows back");
}

/// A transaction a task still holds when the handler returns cannot commit: 503, nothing stays,
/// and the claim is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_held_past_the_handler_is_not_committed() {
    let f = fixture().await;
    let held = f.send("/charges", "k", "held").await;
    assert_eq!(held.status, StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(f.effects("held").await, 0);
    assert_eq!(f.record("k").await, None);
}

/// A handler that takes no transaction works as with any store; `PgTx` on a request the layer did
/// not claim is refused with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_without_a_transaction_and_unclaimed_requests() {
    let f = fixture().await;
    let plain = f.send("/plain", "k", "body").await;
    assert_eq!(plain.outcome, Some(Outcome::Executed));
    assert_eq!(
        f.send("/plain", "k", "body").await.outcome,
        Some(Outcome::Replayed)
    );

    let unclaimed = Router::new().route("/charges", post(|tx: PgTx| charge(tx, String::new())));
    let response = unclaimed
        .oneshot(Request::post("/charges").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("not claimed through a PgStore"),
        "{body:?}"
    );
}

/// The consumer's own transaction records the message: a redelivery after a commit is skipped, a
/// rolled-back one runs again, and a concurrent delivery waits for the first one's outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_marks_a_message_processed_in_its_own_transaction() {
    let f = fixture().await;
    let window = Duration::from_secs(3600);
    let pool = f.store.pool();
    let apply = async |message: &str| -> bool {
        let mut tx = pool.begin().await.unwrap();
        let first = f
            .store
            .mark_processed(&mut tx, "ledger", message, window)
            .await
            .unwrap();
        if first {
            sqlx::query("INSERT INTO effects (body) VALUES ($1)")
                .bind(message)
                .execute(&mut *tx)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
        first
    };
    assert!(apply("evt_1").await);
    assert!(!apply("evt_1").await, "the redelivery is skipped");
    assert_eq!(f.effects("evt_1").await, 1);

    // Rolled back: the record goes with the work, and the redelivery runs.
    let mut tx = pool.begin().await.unwrap();
    assert!(
        f.store
            .mark_processed(&mut tx, "ledger", "evt_2", window)
            .await
            .unwrap()
    );
    tx.rollback().await.unwrap();
    assert!(apply("evt_2").await);
    assert_eq!(f.effects("evt_2").await, 1);

    // Concurrent: the second delivery waits for the first one's commit, then skips.
    let mut first = pool.begin().await.unwrap();
    assert!(
        f.store
            .mark_processed(&mut first, "ledger", "evt_3", window)
            .await
            .unwrap()
    );
    let store = f.store.clone();
    let second = tokio::spawn({
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let again = store
                .mark_processed(&mut tx, "ledger", "evt_3", window)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            again
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the second delivery waits on the first one's row"
    );
    first.commit().await.unwrap();
    assert!(!second.await.unwrap(), "and skips once it committed");
    // Message ids never meet HTTP keys of the same text.
    assert_eq!(f.record("evt_3").await, None);
}

/// §8.6, §11: a message redelivered after its window (its row expired, not yet swept) is
/// processed again, and its new record lasts the new window: the redelivery after that is
/// skipped, not run a third time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_redelivered_after_its_window_is_processed_once_more() {
    let f = fixture().await;
    let mut conn = f.store.pool().acquire().await.unwrap();
    let mut mark = async |window: Duration| {
        f.store
            .mark_processed(&mut conn, "ledger", "evt", window)
            .await
            .unwrap()
    };
    assert!(mark(Duration::from_millis(1)).await);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let window = Duration::from_secs(3600);
    assert!(mark(window).await, "past its window, the message is new");
    assert!(!mark(window).await, "and processed for the new window");
}

/// §5.1, §11.1: a message id never names the record of an HTTP key with the same text in a scope
/// of the same name: a request whose key is a processed message's id runs, and a message whose id
/// is a key a request ran under is processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_id_and_an_http_key_of_the_same_text_are_different_records() {
    let f = fixture().await;
    let window = Duration::from_secs(3600);
    let mut conn = f.store.pool().acquire().await.unwrap();
    assert!(
        f.store
            .mark_processed(&mut conn, "ledger", "evt_1", window)
            .await
            .unwrap()
    );
    let fingerprint = Fingerprint::from_bytes([1; 32]);
    let key = RecordId::new(b"ledger", "evt_1");
    let Ok(Claim::Claimed(token)) = f.store.claim(&key, &fingerprint, window).await else {
        panic!("§11.1: the request is not the message");
    };
    let ran = Completed::tombstone(fingerprint);
    assert!(f.store.complete(&key, &token, &ran, window).await.unwrap());

    let key = RecordId::new(b"ledger", "evt_2");
    let Ok(Claim::Claimed(token)) = f.store.claim(&key, &fingerprint, window).await else {
        panic!("a new key");
    };
    assert!(f.store.complete(&key, &token, &ran, window).await.unwrap());
    assert!(
        f.store
            .mark_processed(&mut conn, "ledger", "evt_2", window)
            .await
            .unwrap(),
        "§11.1: the message is not the request"
    );
}

/// A serializable handler whose write skews with a transaction that commits first: its own commit
/// fails with a serialization failure (40001), which a retry can fix.
async fn write_skew(mut tx: PgTx) -> Result<(StatusCode, &'static str), StatusCode> {
    let fail = |_| StatusCode::INTERNAL_SERVER_ERROR;
    tx.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        .await
        .map_err(fail)?;
    tx.execute("SELECT count(*) FROM effects WHERE body = 'skew-other'")
        .await
        .map_err(fail)?;
    tx.execute("INSERT INTO effects (body) VALUES ('skew')")
        .await
        .map_err(fail)?;
    // Another transaction reads what this one wrote and writes what it read, and commits first.
    let url = SERVER_URL.with(Clone::clone);
    let mut other = PgConnection::connect(&url).await.map_err(fail)?;
    other
        .execute(
            "BEGIN ISOLATION LEVEL SERIALIZABLE;
             SELECT count(*) FROM effects WHERE body = 'skew';
             INSERT INTO effects (body) VALUES ('skew-other');
             COMMIT;",
        )
        .await
        .map_err(fail)?;
    Ok((StatusCode::CREATED, "skewed"))
}

/// The client's view of a rejected commit: the answer, and the attempts the crate's own retry
/// client made for it.
async fn send_through_the_retry_client(f: &Fixture, key: &str, body: &str) -> (StatusCode, u32) {
    let client = ServiceBuilder::new()
        .layer(
            IdempotentRetryLayer::new()
                .backoff(Duration::from_millis(1), Duration::from_millis(10))
                .deadline(Duration::from_secs(10)),
        )
        .service(f.app.clone());
    let request = Request::post("/charges")
        .header("idempotency-key", key)
        .body(Full::<axum::body::Bytes>::from(body.to_owned()))
        .unwrap();
    let response = SERVER_URL
        .scope(f.server.url(), client.oneshot(request))
        .await
        .expect("an answer");
    let attempts = response
        .extensions()
        .get::<Attempts>()
        .expect("the client's attempts")
        .count();
    (response.status(), attempts)
}

/// A deferred foreign key that fails at commit is no store outage: the client gets 422
/// `commit-rejected` without `Retry-After`, nothing stays, and the claim is released. The retry
/// client does not retry it; a retry with the same key runs again and is rejected again (never a
/// 503 that asks for a retry), and once the missing customer exists, it commits once.
/// PROTOCOL.md §9.9, §7.2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_foreign_key_failing_at_commit_is_rejected_not_unavailable() {
    let f = fixture().await;
    for attempt in 1..=3 {
        let answer = f.send("/charges", "k", "orphan").await;
        answer.assert_commit_rejected(&format!("attempt {attempt}"));
        assert_ne!(
            answer.body, "orphan",
            "the rolled-back response is not delivered"
        );
        assert_eq!(
            f.effects("orphan").await,
            0,
            "attempt {attempt}: nothing stays"
        );
        assert_eq!(
            f.record("k").await,
            None,
            "attempt {attempt}: the claim was released"
        );
    }
    assert_eq!(f.calls(), 3, "each retry ran, and was rejected again");

    let (status, attempts) = send_through_the_retry_client(&f, "k", "orphan").await;
    assert_eq!(
        (status, attempts),
        (StatusCode::UNPROCESSABLE_ENTITY, 1),
        "the retry client takes the rejection as an answer"
    );

    // The data fixed, the same key runs and commits once.
    admin(&f.server)
        .await
        .execute("INSERT INTO customers (id) VALUES (42)")
        .await
        .expect("the customer");
    let fixed = f.send("/charges", "k", "orphan").await;
    assert_eq!(
        (fixed.status, fixed.outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    assert_eq!(f.effects("orphan").await, 1);
    assert_eq!(f.record("k").await, Some((true, true)));
    let replay = f.send("/charges", "k", "orphan").await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(f.effects("orphan").await, 1, "committed once");
}

/// A deferred unique constraint that fails at commit (the reference is taken) is rejected the same
/// way: 422 `commit-rejected`, nothing stays, the claim is released. PROTOCOL.md §9.9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unique_violation_at_commit_is_rejected() {
    let f = fixture().await;
    let answer = f.send("/charges", "k", "taken").await;
    answer.assert_commit_rejected("a unique violation at commit");
    assert_eq!(f.effects("taken").await, 0);
    assert_eq!(f.record("k").await, None, "the claim was released");
}

/// A handler whose own statement broke a constraint, and which answered with a status the layer
/// stores, left a transaction that can only roll back: rejected, not a 503. PROTOCOL.md §9.9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_answer_after_a_failed_statement_is_rejected() {
    let f = fixture().await;
    let answer = f.send("/charges", "k", "swallowed").await;
    answer.assert_commit_rejected("a stored answer after a failed statement");
    assert_eq!(f.effects("swallowed").await, 0);
    assert_eq!(f.record("k").await, None, "the claim was released");
}

/// The way out of the above: the failed statement in a savepoint the handler rolls back to. Its
/// own 402 commits with the record, with its earlier write, and is replayed. PROTOCOL.md §9.9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_rolls_back_to_a_savepoint_commits_its_own_answer() {
    let f = fixture().await;
    let answer = f.send("/charges", "k", "savepoint").await;
    assert_eq!(
        (answer.status, answer.outcome),
        (StatusCode::PAYMENT_REQUIRED, Some(Outcome::Executed)),
        "{}",
        answer.body
    );
    assert_eq!(
        f.effects("savepoint").await,
        1,
        "the write before the savepoint committed"
    );
    assert_eq!(f.record("k").await, Some((true, true)));
    let replay = f.send("/charges", "k", "savepoint").await;
    assert_eq!(
        (replay.status, replay.outcome),
        (StatusCode::PAYMENT_REQUIRED, Some(Outcome::Replayed))
    );
}

/// A serialization failure is one a retry can fix: a handler whose write skews with a transaction
/// that committed first (its completion statement fails with 40001) gets a 503
/// `store-unavailable` with `Retry-After`, nothing stays, and the claim is released for the retry.
/// PROTOCOL.md §9.9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serialization_failure_stays_unavailable() {
    let f = fixture().await;
    let answer = f.send("/serializable", "k", "").await;
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        answer.body
    );
    assert!(
        answer.problem_type().ends_with("#store-unavailable"),
        "{}",
        answer.body
    );
    assert_eq!(answer.outcome, Some(Outcome::StoreUnavailable));
    assert_eq!(answer.retry_after.as_deref(), Some("1"));
    assert_eq!(answer.kind, Some(ProblemKind::StoreUnavailable));
    assert!(
        f.server
            .log_contents()
            .contains("could not serialize access due to read/write dependencies"),
        "the handler's transaction failed as a serialization failure"
    );
    assert_eq!(
        f.effects("skew").await,
        0,
        "the handler's write rolled back"
    );
    assert_eq!(
        f.effects("skew-other").await,
        1,
        "the other transaction committed"
    );
    assert_eq!(f.record("k").await, None, "the claim was released");
}

/// At the commit itself, a serialization failure (40001) or a deadlock (40P01) stays a 503 with
/// `Retry-After`; a data exception (22P02) is rejected. Each leaves nothing, and releases the
/// claim. PROTOCOL.md §9.9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_at_commit_are_told_apart_by_sqlstate() {
    let f = fixture().await;
    for (code, status, kind) in [
        (
            "40001",
            StatusCode::SERVICE_UNAVAILABLE,
            ProblemKind::StoreUnavailable,
        ),
        (
            "40P01",
            StatusCode::SERVICE_UNAVAILABLE,
            ProblemKind::StoreUnavailable,
        ),
        (
            "22P02",
            StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::CommitRejected,
        ),
    ] {
        let body = format!("at-commit:{code}");
        let answer = f.send("/charges", code, &body).await;
        assert_eq!(
            (answer.status, answer.kind),
            (status, Some(kind)),
            "{code}: {}",
            answer.body
        );
        assert_eq!(
            answer.retry_after.is_some(),
            kind == ProblemKind::StoreUnavailable,
            "{code}: Retry-After only where a retry can help"
        );
        assert_eq!(f.effects(&body).await, 0, "{code}: nothing stays");
        assert_eq!(f.record(code).await, None, "{code}: the claim was released");
    }
    assert!(
        f.server.log_contents().contains("STATEMENT:  COMMIT"),
        "the deferred checks failed at the commit"
    );
}

/// Writes outside `PgTx` (through the pool) commit on their own: a run that fails after one keeps
/// it, and the retry makes it again; keyed by the operation with a unique constraint, the retry's
/// write finds the first one. The handler's `PgTx` write commits once either way. PROTOCOL.md
/// §9.9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_the_pool_are_not_undone_with_the_transaction() {
    let f = fixture().await;
    admin(&f.server)
        .await
        .execute("CREATE TABLE outside_writes (operation text PRIMARY KEY)")
        .await
        .expect("the table of keyed writes");
    let runs = Arc::new(AtomicUsize::new(0));
    let (pool, counter) = (f.store.pool().clone(), runs.clone());
    let app = Router::new()
        .route(
            "/outside",
            post(move |key: IdempotencyKey, mut tx: PgTx| {
                let (pool, first) = (pool.clone(), counter.fetch_add(1, Ordering::SeqCst) == 0);
                async move {
                    let fail = |_| StatusCode::INTERNAL_SERVER_ERROR;
                    // Not undone with the transaction.
                    sqlx::query("INSERT INTO effects (body) VALUES ('outside')")
                        .execute(&pool)
                        .await
                        .map_err(fail)?;
                    // Keyed by the operation: the retry's write finds the first one.
                    sqlx::query(
                        "INSERT INTO outside_writes (operation) VALUES ($1)
                         ON CONFLICT DO NOTHING",
                    )
                    .bind(key.derive("outside"))
                    .execute(&pool)
                    .await
                    .map_err(fail)?;
                    sqlx::query("INSERT INTO effects (body) VALUES ('inside')")
                        .execute(&mut *tx)
                        .await
                        .map_err(fail)?;
                    if first {
                        return Err(StatusCode::INTERNAL_SERVER_ERROR);
                    }
                    Ok(StatusCode::CREATED)
                }
            }),
        )
        .route_layer(IdempotencyLayer::new(f.store.clone()));
    let send = || {
        app.clone().oneshot(
            Request::post("/outside")
                .header("idempotency-key", "k")
                .body(Body::empty())
                .unwrap(),
        )
    };
    let failed = send().await.unwrap();
    assert_eq!(failed.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let retried = send().await.unwrap();
    assert_eq!(retried.status(), StatusCode::CREATED);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the retry ran the handler again"
    );

    assert_eq!(
        f.effects("inside").await,
        1,
        "the PgTx write committed once"
    );
    assert_eq!(
        f.effects("outside").await,
        2,
        "the pool write was kept by the failed run and made again by the retry"
    );
    let keyed: i64 = sqlx::query("SELECT count(*) FROM outside_writes")
        .fetch_one(&mut admin(&f.server).await)
        .await
        .expect("a count")
        .get(0);
    assert_eq!(keyed, 1, "the write keyed by the operation was made once");
}

/// `PgTx` behind a `SealedStore`: the sealed store hands the claim's transaction through
/// (`Store::prepare`), so the handler's rows commit with the record, the record at rest is sealed,
/// and the retry replays the opened response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_store_hands_the_transaction_through() {
    use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};

    let mut f = fixture().await;
    let keys = SealKeys::new([SealKey::new("k1", [7; 32]).unwrap()]).unwrap();
    let counter = f.calls.clone();
    f.app = Router::new()
        .route(
            "/charges",
            post(move |tx: PgTx, body: String| {
                counter.fetch_add(1, Ordering::SeqCst);
                charge(tx, body)
            }),
        )
        .route_layer(IdempotencyLayer::new(SealedStore::new(
            f.store.clone(),
            keys,
        )));

    let first = f.send("/charges", "k", "a-sealed-charge").await;
    assert_eq!(
        (first.status, first.outcome),
        (StatusCode::CREATED, Some(Outcome::Executed)),
        "{}",
        first.body
    );
    assert_eq!(f.effects("a-sealed-charge").await, 1);
    assert_eq!(f.record("k").await, Some((true, true)));

    let mut admin = admin(&f.server).await;
    let stored: Vec<u8> = sqlx::query("SELECT completed FROM idempotency_records WHERE id = $1")
        .bind(RecordId::new(b"", "k").as_bytes().as_slice())
        .fetch_one(&mut admin)
        .await
        .expect("the record")
        .get(0);
    assert!(
        !stored.windows(15).any(|w| w == b"a-sealed-charge"),
        "the stored response is sealed at rest"
    );

    let replay = f.send("/charges", "k", "a-sealed-charge").await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, "a-sealed-charge");
    assert_eq!((f.effects("a-sealed-charge").await, f.calls()), (1, 1));
}
