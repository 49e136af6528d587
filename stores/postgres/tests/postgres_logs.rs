//! What `PgStore` logs when its table is missing (PROTOCOL.md §10.8, §12.3): the calls fail with
//! `PgStoreError::MissingTable` from the first one on, and the fix is logged once, at ERROR, not
//! once per request. One capturing subscriber is the global default of this test binary, which
//! holds this one test, so every event it sees is the test's.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use test_servers::logs::{Captured, LogEvent};
use test_servers::postgres_server::PostgresServer;
use tower::ServiceExt;
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::record::{ClaimToken, Completed, Fence, Fingerprint, RecordId};
use tower_idempotency::store::{Store, StoreError};
use tower_idempotency::{IdempotencyLayer, Outcome};
use tower_idempotency_postgres::PgStore;
use tower_idempotency_postgres::PgStoreError;
use tracing::Level;

/// The layer's and the store's events at `level`.
fn at(captured: &Captured, level: Level) -> Vec<LogEvent> {
    (captured.events().into_iter())
        .filter(|e| e.level == level && e.target == "tower_idempotency")
        .collect()
}

/// Whether `err` is `Unavailable` with `PgStoreError::MissingTable` of the default table.
fn is_missing_table(err: &StoreError) -> bool {
    matches!(
        err,
        StoreError::Unavailable(source)
            if matches!(
                source.downcast_ref::<PgStoreError>(),
                Some(PgStoreError::MissingTable(table)) if table == "idempotency_records"
            )
    )
}

/// Without `migrate`, the first call, and every one after it, fails with `MissingTable`; requests
/// get 503 `store-unavailable`; the store logs the fix once, at ERROR, and the layer's claim-time
/// warning is not repeated per request. Once the table exists, the store works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_named_at_the_first_call_and_logged_once_with_its_fix() {
    let captured = Captured::global();
    let server = PostgresServer::start();
    let store = PgStore::connect(&server.url()).expect("a store");
    let (id, fingerprint, lease) = (
        RecordId::new(b"", "first"),
        Fingerprint::from_bytes([1; 32]),
        Duration::from_secs(5),
    );

    let first = store.claim(&id, &fingerprint, lease).await;
    match &first {
        Err(err) if is_missing_table(err) => {}
        other => panic!("the first call names the missing table: {other:?}"),
    }
    let token = ClaimToken::new(Fence::new(1));
    let done = Completed::tombstone(fingerprint);
    let window = Duration::from_secs(60);
    for (call, answer) in [
        (
            "claim",
            store.claim(&id, &fingerprint, lease).await.map(drop),
        ),
        (
            "complete",
            store.complete(&id, &token, &done, window).await.map(drop),
        ),
        ("renew", store.renew(&id, &token, lease).await.map(drop)),
        ("release", store.release(&id, &token).await.map(drop)),
    ] {
        assert!(
            answer.as_ref().is_err_and(is_missing_table),
            "{call}: {answer:?}"
        );
    }

    let app = Router::new()
        .route("/charges", post(|| async { StatusCode::CREATED }))
        .route_layer(IdempotencyLayer::new(store.clone()).single_tenant());
    for n in 0..5 {
        let request = Request::post("/charges")
            .header("idempotency-key", format!("k-{n}"))
            .body(Body::empty())
            .expect("a request");
        let response = app.clone().oneshot(request).await.expect("an answer");
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            response.extensions().get::<ProblemKind>(),
            Some(&ProblemKind::StoreUnavailable)
        );
    }

    let errors = at(captured, Level::ERROR);
    assert_eq!(errors.len(), 1, "the fix is logged once: {errors:?}");
    let message = errors[0].field("message").unwrap_or_default();
    assert!(
        message.contains("PgStore::migrate()") && message.contains("PgStore::schema_sql()"),
        "the log says what to do: {message}"
    );
    assert_eq!(errors[0].field("table"), Some("idempotency_records"));
    let warnings = at(captured, Level::WARN);
    assert_eq!(
        warnings.len(),
        1,
        "no warning per request, only the layer's throttled one: {warnings:?}"
    );

    store.migrate().await.expect("the table is created");
    let request = Request::post("/charges")
        .header("idempotency-key", "after-migrate")
        .body(Body::empty())
        .expect("a request");
    let response = app.oneshot(request).await.expect("an answer");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        response.extensions().get::<Outcome>(),
        Some(&Outcome::Executed)
    );
    assert_eq!(at(captured, Level::ERROR).len(), 1, "nothing more logged");
}
